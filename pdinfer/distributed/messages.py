"""Typed messages between the DP front and its rank processes (msgspec JSON, never pickle).

Front -> rank: ``AddRequest``, ``AbortRequest``, ``StopRanks``, ``Ping``.
Rank -> front: ``RankReady``, ``StepReport`` (output deltas + load, doubling as the heartbeat),
``RankFailed``. Agent <-> front (ranks on another host): ``AgentHello``, ``StartGeneration``,
``RankExited``.

Outputs travel as deltas: the engine reports the whole text so far every step, which would make
a long generation cost O(n^2) bytes; ``OutputEncoder`` sends what changed (a kept prefix length
and the new suffix, so a stop string that trims the end still round-trips) and
``OutputDecoder`` rebuilds the cumulative ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from pdinfer.config import EngineArgs
from pdinfer.outputs import CompletionOutput, RequestOutput
from pdinfer.sampling_params import SamplingParams


# --- front -> rank ---------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class StopRanks(msgspec.Struct, tag="stop"):
    pass


class Ping(msgspec.Struct, tag="ping"):
    generation: int


# --- rank -> front ---------------------------------------------------------------------------------
class RankStats(msgspec.Struct):
    num_waiting: int = 0
    num_running: int = 0
    num_prompted: int = 0
    num_requests: int = 0
    waiting_prefill_tokens: int = 0  # prompt tokens not computed yet
    running_kv_tokens: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_allreduce: int = 0  # collective calls so far (loop + scheduler vote)
    allreduce_ns: int = 0  # time spent in them, waiting for the slowest rank included


class CompletionDelta(msgspec.Struct, array_like=True):
    index: int
    text_keep: int  # characters of the previous text that stay
    text_add: str
    ids_keep: int
    ids_add: list[int]
    logprobs_keep: int
    logprobs_add: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class OutputDelta(msgspec.Struct):
    request_id: str
    finished: bool
    error: str | None
    completions: list[CompletionDelta]
    num_cached_tokens: int = 0


class RankReady(msgspec.Struct, tag="ready"):
    rank: int
    generation: int
    pid: int
    num_total_blocks: int
    block_size: int


class StepReport(msgspec.Struct, tag="step"):
    rank: int
    generation: int
    outputs: list[OutputDelta]
    stats: RankStats


class RankFailed(msgspec.Struct, tag="failed"):
    rank: int
    generation: int
    error: str
    peer: bool = False  # a collective failed: the cause is (most likely) another rank


# --- how a rank process is started (its only argument) ----------------------------------------------
class RankConfig(msgspec.Struct):
    rank: int
    size: int
    generation: int
    master_addr: str  # the rendezvous store, hosted by the front
    master_port: int
    front_address: str  # the front's ZeroMQ socket, tcp://host:port
    engine_args: dict[str, Any]
    parent_pid: int  # exit at once if this process is no longer our parent
    backend: str = "auto"
    timeout_s: float = 60.0  # the DP group timeout (a collective never waits longer)
    startup_timeout_s: float = 600.0
    front_timeout_s: float = 30.0  # stop when the front has been silent this long
    max_idle_sleep_ms: float = 20.0


# --- agent (ranks of another host) <-> front --------------------------------------------------------
class AgentHello(msgspec.Struct, tag="agent_hello"):
    rank_offset: int
    num_local_ranks: int


class StartGeneration(msgspec.Struct, tag="start_generation"):
    generation: int  # the agent kills its ranks of older generations and starts these
    template: RankConfig  # what its ranks run (rank, generation and parent pid filled in)


class RankExited(msgspec.Struct, tag="rank_exited"):
    rank: int
    generation: int
    returncode: int


def engine_args_to_dict(args: EngineArgs) -> dict[str, Any]:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    values["engine_type"] = int(args.role.value)
    return values


def engine_args_from_dict(values: dict[str, Any]) -> EngineArgs:
    return EngineArgs(**values)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__ if not name.startswith("_")}


ToRank = AddRequest | AbortRequest | StopRanks | Ping | StartGeneration
ToFront = RankReady | StepReport | RankFailed | AgentHello | RankExited

_encoder = msgspec.json.Encoder()
_to_rank = msgspec.json.Decoder(ToRank)
_to_front = msgspec.json.Decoder(ToFront)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_rank(data: bytes) -> ToRank:
    return _to_rank.decode(data)


def decode_to_front(data: bytes) -> ToFront:
    return _to_front.decode(data)


# --- output deltas ---------------------------------------------------------------------------------
def _kept(new, old) -> int:
    """Length of the common prefix of two strings or lists (usually all of ``old``)."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return n
    i = 0
    for a, b in zip(new, old):
        if a != b:
            break
        i += 1
    return i


class OutputEncoder:
    """Rank side: remembers what each request's outputs looked like when last sent."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, int], tuple[str, list[int], list]] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        deltas = []
        for c in output.outputs:
            key = (output.request_id, c.index)
            text, ids, logprobs = self._sent.get(key, ("", [], []))
            new_logprobs = c.logprobs or []
            tk, ik, lk = _kept(c.text, text), _kept(c.token_ids, ids), _kept(new_logprobs, logprobs)
            deltas.append(
                CompletionDelta(
                    c.index,
                    tk,
                    c.text[tk:],
                    ik,
                    c.token_ids[ik:],
                    lk,
                    new_logprobs[lk:] if c.logprobs is not None else None,
                    c.cumulative_logprob,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
            self._sent[key] = (c.text, list(c.token_ids), list(new_logprobs))
        if output.finished:
            for c in output.outputs:
                self._sent.pop((output.request_id, c.index), None)
        cached = output.metrics.num_cached_tokens if output.metrics else 0
        return OutputDelta(output.request_id, output.finished, output.error, deltas, cached)


class OutputDecoder:
    """Front side: one per request; applies deltas to the cumulative output."""

    def __init__(self) -> None:
        self.completions: dict[int, CompletionOutput] = {}

    def apply(self, delta: OutputDelta) -> None:
        for d in delta.completions:
            c = self.completions.get(d.index)
            if c is None:
                c = self.completions[d.index] = CompletionOutput(d.index, "", [])
            c.text = c.text[: d.text_keep] + d.text_add
            del c.token_ids[d.ids_keep :]
            c.token_ids.extend(d.ids_add)
            if d.logprobs_add is not None:
                c.logprobs = c.logprobs if c.logprobs is not None else []
                del c.logprobs[d.logprobs_keep :]
                c.logprobs.extend(d.logprobs_add)
            c.cumulative_logprob = d.cumulative_logprob
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason

    def snapshot(self) -> list[CompletionOutput]:
        """Copies: the consumer may keep an output while later deltas arrive."""
        return [
            CompletionOutput(
                c.index,
                c.text,
                list(c.token_ids),
                c.cumulative_logprob,
                list(c.logprobs) if c.logprobs is not None else None,
                c.finish_reason,
                c.stop_reason,
            )
            for _, c in sorted(self.completions.items())
        ]

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions.values())
