"""What the engine hands the model runner for one step: plain lists, snapshotted on the host.

The runner may execute on another thread (zero-overhead scheduling) while the host mutates its
sequences, so it never reads a ``Sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PENDING_TOKEN = -2  # in a penalty token list: the token the previous step sampled


@dataclass
class SampleSpec:
    """One token to sample: which logits row, and how."""

    row: int  # index into the step's tokens
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    position: int  # position of the token being sampled in its sequence
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    output_tokens: list[int] | None = None  # for penalties; -2 marks the pending token
    prompt_tokens: list[int] | None = None
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed: Any = None  # structured outputs: the allowed tokens, int32 words of 32 bits (a tensor)
    masked_later: bool = False  # a grammar mask that ``StepInput.masks_later`` fills in before sampling

    @property
    def needs_penalties(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    @property
    def constrained(self) -> bool:
        """A logit bias or a grammar mask changes this row's logits."""
        return bool(self.logit_bias) or self.allowed is not None or self.masked_later


@dataclass
class StepInput:
    step_id: int
    is_prompt: bool
    input_ids: list[int]  # -1 where the token is the previous step's sample (see pending)
    positions: list[int]
    query_lens: list[int]  # per sequence
    context_lens: list[int]  # per sequence, after this step
    block_tables: list[list[int]]
    samples: list[SampleSpec] = field(default_factory=list)
    # (input row, step id, sample index): tokens an earlier step sampled that the host has not
    # seen yet (zero-overhead scheduling); the runner takes them from that step's output.
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    clone_blocks: list[tuple[int, int]] = field(default_factory=list)
    clone_states: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots
    # Prompt log-probs (only for requests that ask): the rows whose logits score the next
    # prompt token, that token, and how many top entries each row reports (the step's largest).
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top_k: int = 0
    # Grammar masks computed while this step's forward runs (``engine.structured.DeferredMasks``):
    # the runner calls ``fill(samples)`` just before sampling.
    masks_later: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepResult:
    step_id: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # One entry per ``StepInput.prompt_rows`` row (see ``outputs.PromptLogprobs``).
    prompt_logprobs: list[float] | None = None
    prompt_ranks: list[int] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    # Last-layer hidden states (before the final norm) of every input row, on the device;
    # only for a drafter that reads them (``StepRunner.keep_hidden``, the MTP drafter).
    hidden: Any = None
