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


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Log-probs of a prompt's tokens 1..P-1, each given the tokens before it (token 0 has no
    prefix, so none), as parallel lists with one entry per position.

    ``ranks``: the prompt token's rank in the vocabulary, the number of tokens at least as
    likely (1: the most likely; vLLM's definition). ``top_ids``/``top_logprobs``: the k most
    likely tokens of each position, most likely first (k = ``SamplingParams.prompt_logprobs``;
    empty lists for 0).
    """

    token_logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def extend(self, other: PromptLogprobs) -> None:
        self.token_logprobs += other.token_logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def as_dicts(self, prompt_token_ids: list[int], top_k: int | None = None) -> list[dict[int, float] | None]:
        """vLLM's shape, with floats (as ``CompletionOutput.logprobs``): None for token 0, then
        per token {its id: log-prob, then the top ids (at most ``top_k``): theirs}."""
        out: list[dict[int, float] | None] = [None]
        for i, logprob in enumerate(self.token_logprobs):
            entry = {prompt_token_ids[i + 1]: logprob}
            for token_id, top in zip(self.top_ids[i][:top_k], self.top_logprobs[i][:top_k]):
                entry.setdefault(token_id, top)
            out.append(entry)
        return out


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news since its last delta."""

    index: int  # which of the request's n outputs
    token_ids: list[int]  # the new tokens only
    logprobs: list[dict[int, float]] | None = None  # one entry per new token (when asked for)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # set once, with the sequence's last delta
    stop_reason: int | None = None  # the stop token id that ended it


class Resume(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One output to continue rather than start: request migration. A request that left an
    engine (its CE ran out of blocks, was drained or died) is added again with the prompt and
    this, what its client already has of output ``index``: the engine computes the K/V of
    prompt + ``token_ids`` (a prefill, which the prefix cache and the KV store shorten) and
    samples the next token where the first engine would have (same seed, same position), so
    greedy and seeded output equal an unmigrated run. ``num_shown_chars``: how much of the
    output's text the client has seen (a stop string's held-back tail is not), so the text
    goes on from there."""

    token_ids: list[int]
    index: int = 0
    num_shown_chars: int = 0


# Why an engine ended a request that another engine can continue (``RequestDelta.migrate``):
MIGRATE_PREEMPTED = "preempted"  # a CE ran out of KV blocks (it cannot recompute a prompt)
MIGRATE_DRAIN = "drain"  # the engine is drained (``POST /admin/drain``, SIGTERM)
MIGRATE_REASONS = (MIGRATE_PREEMPTED, MIGRATE_DRAIN)


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one engine step."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False  # the engine is done with the request (every sequence finished)
    error: str | None = None  # why it ended without a normal completion
    num_cached_tokens: int = 0  # prefix-cache hit of its prefill
    prompt_logprobs: PromptLogprobs | None = None  # sent once, when the whole prompt is computed
    migrate: str | None = None  # ended to move elsewhere (``MIGRATE_REASONS``): continue it, not an error


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
    # SamplingParams.prompt_logprobs: None for the first token, then {token id: log-prob} of
    # each prompt token given the ones before it (its own entry first, then the top ones);
    # None when not asked for, or when the request ended before its prompt was computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    extra: dict = field(default_factory=dict)
