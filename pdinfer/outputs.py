"""What the engine returns per request.

- ``RequestDelta`` / ``SeqDelta``: what the engine loop emits each step -- every sequence's new
  token ids (and log-probs), never text and never what was sent before. They cross the process
  boundary between an engine core and its clients as msgspec messages.
- ``RequestOutput`` / ``CompletionOutput``: what a user reads (``LLM.generate``,
  ``LLMEngine.step``): cumulative, with text, assembled from the deltas by ``OutputTracker``
  (``engine/output_tracker.py``), which also applies stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news since its last delta."""

    index: int  # which of the request's n outputs
    token_ids: list[int]  # the new tokens only
    logprobs: list[dict[int, float]] | None = None  # one entry per new token (when asked for)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # set once, with the sequence's last delta
    stop_reason: int | None = None  # the stop token id that ended it


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one engine step."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False  # the engine is done with the request (every sequence finished)
    error: str | None = None  # why it ended without a normal completion
    num_cached_tokens: int = 0  # prefix-cache hit of its prefill


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None (running)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request ended without a normal completion
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
