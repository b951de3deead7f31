"""A sequence: one stream of tokens the engine computes. A request with ``n > 1`` owns n of them.

Pure Python (the scheduler and block manager read it; no torch here).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pdinfer.outputs import PromptLogprobs
from pdinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PROMPTED = enum.auto()  # prefix computed elsewhere (fork or P/D hand-off), not yet running
    HANDED_OFF = enum.auto()  # PROMPT engine: prefilled and sent to a completion engine
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # refused by the scheduler (e.g. prompt over prompt_limit)
    FINISHED_PREEMPTED = enum.auto()  # stopped because KV blocks ran out (stop_preempted_request)
    FINISHED_HANDED_OFF = enum.auto()  # PE: the CE confirmed it holds the K/V; it decodes from here

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED  # a set, not ``name.startswith``: read several times a token


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "error",
    SequenceStatus.FINISHED_PREEMPTED: "error",
    SequenceStatus.FINISHED_HANDED_OFF: "handoff",
}
_FINISHED = frozenset(status for status in SequenceStatus if status.name.startswith("FINISHED"))

_seq_ids = itertools.count()


def next_seq_id() -> int:
    return next(_seq_ids)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    index: int = 0  # which of the request's n outputs
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=next_seq_id)
    max_tokens: int = 0  # resolved output limit (from max_tokens and the context length)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V is in (or being written to) the cache. Advanced when scheduled.
        self.num_computed_tokens = 0
        # Sampled by a step that was launched but whose output the host has not processed
        # (zero-overhead scheduling). The sequence is num_tokens long, token_ids lags behind.
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit of the last prefill, for metrics and tests
        self.num_resumed_tokens = 0  # outputs it came with (a migrated request, ``Resume``)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of this sequence's full blocks
        self.state_id = -1  # slot of per-sequence model state, for models that have one
        self.state_source = -1  # a fork: the slot its state is cloned from
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.output_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.num_reported_tokens = 0  # output tokens already sent out in a delta
        self.reported_finished = False  # its finish already went out
        self.grammar: Any = None  # structured outputs: its matcher (engine/structured.py)
        self.num_steps_scheduled = 0
        # Speculative decoding (core/spec_decode.py): the drafts the step in flight verifies,
        # the blocks it appended for them, and the sequence's slot of the engine's draft pool.
        self.draft_token_ids: list[int] = []
        self.num_draft_blocks = 0
        self.draft_slot = -1
        self.first_token_time: float | None = None
        self.handoff: Any = None  # P/D bookkeeping, owned by the PE/CE subclasses
        self.first_tokens: list[int] = []  # PE: the first token of each of the n outputs
        # SamplingParams.prompt_logprobs: those of prompt tokens 1.. received so far, and how
        # many of them launched steps compute (ahead with zero-overhead scheduling). Only a
        # request's first sequence computes them, in its prefill; a fork never does.
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_prompt_logprobs_scheduled = 0
        self.reported_prompt_logprobs = False

    # --- lengths ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_handoff_tokens(self) -> int:
        """The tokens whose K/V a P/D hand-off moves: the prompt, and the outputs a migrated
        request came with."""
        return self.num_prompt_tokens + self.num_resumed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs asked for and not all computed yet: its prefill must compute every
        prompt position, so it takes no cached prefix (a cached block has no logits)."""
        if self.sampling_params.prompt_logprobs is None or self.index != 0:
            return False
        return self.num_prompt_logprobs_scheduled < self.num_prompt_tokens - 1

    @property
    def has_prompt_logprobs(self) -> bool:
        """Every prompt token's log-prob has arrived (a one-token prompt has none to wait for)."""
        received = len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0
        return received >= self.num_prompt_tokens - 1

    @property
    def reached_max_tokens(self) -> bool:
        """No more tokens may be scheduled: the output limit is met counting pending tokens."""
        return self.num_output_tokens >= self.max_tokens

    # --- state changes -----------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, status: SequenceStatus, error: str | None = None) -> None:
        self.status = status
        self.finish_reason = FINISH_REASONS[status]
        if error is not None:
            self.error = error

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
