"""Per-request sampling parameters (names follow vLLM's where the concept is shared)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_SEED_BITS = 31


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop_strings = tuple(s for s in (self.stop or []) if s)
        self.verify()
        if self.top_k == 0:
            self.top_k = -1

    def verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        for token_id in self.stop_token_ids or []:
            if not isinstance(token_id, int) or token_id < 0:
                bad(f"stop_token_ids must be non-negative integers, got {token_id!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def resolved_seed(self) -> int:
        """The seed of this request's random stream; an unseeded request draws one."""
        if self.seed is not None:
            return self.seed & ((1 << _SEED_BITS) - 1)
        return random.getrandbits(_SEED_BITS)

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if not name.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
