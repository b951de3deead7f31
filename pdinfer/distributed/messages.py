"""Typed messages between the DP front and its rank processes (msgspec JSON, never pickle).

Front -> rank: ``AddRequest``, ``AbortRequest``, ``StopSeq`` (a stop string the front found),
``Drain`` (answered by ``Drained``), ``StopRanks``, ``Ping``.
Rank -> front: ``RankReady``, ``AddAnswer`` (the engine's answer to an add: a CE's reservation,
or a refusal), ``Drained``, ``StepReport`` (the engine's ``RequestDelta``s -- new token ids, never text --
plus load, doubling as the heartbeat), ``RankFailed``. Agent <-> front (ranks on another host):
``AgentHello``, ``StartGeneration``, ``RankExited``.

A reservation crosses as plain fields (``msgspec.to_builtins`` of the engine's ``Reservation``):
this module sits below the engine and names none of its types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from pdinfer.config import EngineArgs
from pdinfer.outputs import RequestDelta, Resume
from pdinfer.sampling_params import SamplingParams


# --- front -> rank ---------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields
    reservation: dict[str, Any] | None = None  # a PE rank's: where the CE wants the K/V
    resume: Resume | None = None  # a migrated request: the output it continues


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class StopSeq(msgspec.Struct, tag="stop_seq"):
    request_id: str
    index: int


class Drain(msgspec.Struct, tag="drain"):
    """``LLMEngine.drain()``: take no new request; a CE rank sends its live requests away."""


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
    num_expert_rearrangements: int = 0  # EPLB (MoE models with expert parallelism or replicas)
    num_expert_slots_received: int = 0  # expert weights that came from another rank
    num_aborted: int = 0
    num_migrated: int = 0
    num_handoffs: int = 0  # a PE rank's confirmed K/V hand-offs (``EngineStats``' fields)
    handoff_bytes: int = 0
    handoff_seconds: float = 0.0
    num_handoffs_failed: int = 0
    draining: bool = False


class RankReady(msgspec.Struct, tag="ready"):
    rank: int
    generation: int
    pid: int
    num_total_blocks: int
    block_size: int
    kv_address: str | None = None  # a CE rank's K/V port: its reservations name it


class AddAnswer(msgspec.Struct, tag="answer"):
    """The engine took the request (``refused`` None; ``answer``: a CE's reservation) or
    refused it (``refused``: "invalid", "no_room" or "handshake", as the engine core says)."""

    rank: int
    generation: int
    request_id: str
    answer: dict[str, Any] | None = None
    refused: str | None = None
    error: str | None = None


class Drained(msgspec.Struct, tag="drained"):
    rank: int
    generation: int
    num_migrated: int  # the live requests the rank's drain sent away


class StepReport(msgspec.Struct, tag="step"):
    rank: int
    generation: int
    outputs: list[RequestDelta]
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


ToRank = AddRequest | AbortRequest | StopSeq | Drain | StopRanks | Ping | StartGeneration
ToFront = RankReady | AddAnswer | Drained | StepReport | RankFailed | AgentHello | RankExited

_encoder = msgspec.json.Encoder()
_to_rank = msgspec.json.Decoder(ToRank)
_to_front = msgspec.json.Decoder(ToFront)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_rank(data: bytes) -> ToRank:
    return _to_rank.decode(data)


def decode_to_front(data: bytes) -> ToFront:
    return _to_front.decode(data)
