"""Typed messages between an engine core (``engine/core``) and its clients, msgpack on ZeroMQ.

Client -> core: ``Hello`` (answered by ``Ready``), ``AddRequest`` (answered by ``Accepted`` or
``Refused``), ``AbortRequests``, ``StopSeqs`` (stop strings found on the client side),
``Drain`` (answered by ``Drained``), ``Shutdown``.
Core -> client: ``Ready``, ``Accepted``, ``Refused``, ``Drained``, ``StepOutputs`` (one per step
and client: the new tokens of that client's requests, plus the engine's stats; also sent alone
as a heartbeat), ``CoreFailed``.

Nothing is ever pickled; every field has a type that msgspec checks on decode.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdinfer.engine.pd_common import Reservation
from pdinfer.outputs import RequestDelta, Resume


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of one engine, taken by its loop; safe to read from any thread."""

    num_waiting: int = 0
    num_running: int = 0
    num_prompted: int = 0
    num_requests: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_migrated: int = 0
    num_steps: int = 0
    # PE only: confirmed K/V hand-offs (``PrefillRole.handoff_stats``), cumulative
    num_handoffs: int = 0
    handoff_bytes: int = 0
    handoff_seconds: float = 0.0
    num_handoffs_failed: int = 0
    # speculative decoding (``DraftPool``), cumulative: drafts verified, and accepted
    num_drafted_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draining: bool = False  # ``LLMEngine.drain()`` ran: the engine takes no new request

    @property
    def kv_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.num_prefix_query_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens


def take_stats(engine, num_steps: int) -> EngineStats:
    scheduler, blocks = engine.scheduler, engine.block_manager
    handoffs = engine.role.handoff_stats or {}
    pool = getattr(scheduler, "draft_pool", None)
    return EngineStats(
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        num_prompted=len(scheduler.prompted),
        num_requests=len(engine.requests),
        num_free_blocks=blocks.num_free_blocks,
        num_total_blocks=blocks.num_total_blocks,
        num_prefix_hit_tokens=blocks.num_prefix_hits,
        num_prefix_query_tokens=blocks.num_prefix_queries,
        num_preemptions=scheduler.num_preemptions,
        num_aborted=engine.num_aborted,
        num_migrated=engine.num_migrated,
        num_steps=num_steps,
        num_handoffs=handoffs.get("count", 0),
        handoff_bytes=handoffs.get("bytes", 0),
        handoff_seconds=handoffs.get("seconds", 0.0),
        num_handoffs_failed=handoffs.get("failed", 0),
        num_drafted_tokens=pool.num_drafted_tokens if pool is not None else 0,
        num_accepted_draft_tokens=pool.num_accepted_tokens if pool is not None else 0,
        draining=engine.draining,
    )


# --- client -> core ---------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    pass


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, validated again by the core
    reservation: Reservation | None = None  # a PE's: where the CE wants the K/V
    resume: Resume | None = None  # a migrated request: the output it continues


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StopSeqs(msgspec.Struct, tag="stop"):
    items: list[tuple[str, int]]  # (request id, output index)


class Drain(msgspec.Struct, tag="drain"):
    """``LLMEngine.drain()``: take no new request; a CE sends its live requests away."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


# --- core -> client ---------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    pid: int
    engine_type: int
    model_folder: str
    tokenizer: str | None  # the tokenizer source when it is not the model's own
    max_model_len: int
    prompt_limit: int
    vocab_size: int
    num_total_blocks: int
    block_size: int
    kv_address: str | None = None  # a CE's K/V port


class Accepted(msgspec.Struct, tag="accepted"):
    request_id: str
    reservation: Reservation | None = None  # a CE's answer to a request


class Refused(msgspec.Struct, tag="refused"):
    request_id: str
    kind: str  # "invalid", "no_room" (a CE is full), "handshake" (a PE cannot reach the CE)
    message: str


class Drained(msgspec.Struct, tag="drained"):
    num_migrated: int  # the live requests the drain sent away (``LLMEngine.drain``'s count)


class StepOutputs(msgspec.Struct, tag="step"):
    deltas: list[RequestDelta]
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag="failed"):
    error: str


ToCore = Hello | AddRequest | AbortRequests | StopSeqs | Drain | Shutdown
ToClient = Ready | Accepted | Refused | Drained | StepOutputs | CoreFailed

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_client = msgspec.msgpack.Decoder(ToClient)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_to_client(data: bytes) -> ToClient:
    return _to_client.decode(data)
