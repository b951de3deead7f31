"""Per-request sampling parameters (names follow vLLM's where the concept is shared)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

SEED_BITS = 31
_INT32_MAX = 2**31 - 1
# Bounds on what one request may ask for (vLLM's default max_logprobs is 20 too).
MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_GRAMMAR_CHARS = 1 << 16  # a JSON schema (as JSON), regex or grammar; the choices together
# vLLM's names for the constraint kinds of ``structured_outputs`` (exactly one per request).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _token_key(key):
    """A logit_bias key: an int, or the decimal string JSON turned it into."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return key


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
    # vLLM's: EOS and stop_token_ids are masked, and stop strings not looked for, until this
    # many tokens are out
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token
    # log-prob of every prompt token after the first given its prefix, plus this many top
    # entries (0: the prompt token's only); None: off. See RequestOutput.prompt_logprobs.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit, in [-100, 100] (OpenAI's logit_bias; JSON keys may be strings)
    logit_bias: dict[int, float] | None = None
    # one of {"json": schema, "json_object": True, "regex": str, "choice": [str, ...],
    # "grammar": EBNF str}: the output must match it (engine/structured.py)
    structured_outputs: dict | None = None
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):  # JSON object keys arrive as strings
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.verify()
        self._stop_strings = tuple(s for s in (self.stop or []) if s)
        if self.top_k == 0:
            self.top_k = -1

    def verify(self) -> None:
        """Check every field as if it came from a stranger (the P/D endpoints take any field):
        a value that passes is one the sampler, the stop checks and the scheduler can handle."""

        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT32_MAX):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or _INT32_MAX):
            bad(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.min_tokens and self.structured_outputs is not None:  # the grammar decides the end
            bad("min_tokens cannot be combined with structured outputs")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            bad(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        self._verify_stops()
        self._verify_logit_bias()
        self._verify_structured()

    def _verify_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers")
        for token_id, value in bias.items():
            if not _is_int(token_id) or not 0 <= token_id <= _INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            if not _is_number(value) or not math.isfinite(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token_id}")

    def _verify_structured(self) -> None:
        spec = self.structured_outputs
        if spec is None:
            return
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs must be an object, got {spec!r}")
        kinds = [k for k in spec if spec[k] not in (None, False)]
        unknown = [k for k in kinds if k not in STRUCTURED_KINDS]
        if unknown or len(kinds) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}, got {sorted(spec)}"
            )
        kind = kinds[0]
        value = spec[kind]
        if kind == "json" and not isinstance(value, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        if kind == "json_object" and value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice" and (
            not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        size = len(value) if isinstance(value, str) else len(repr(value))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{kind} is longer than {MAX_GRAMMAR_CHARS} characters")

    def _verify_stops(self) -> None:
        stop = self.stop or []
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"
            )
        token_ids = self.stop_token_ids or []
        if not isinstance(token_ids, list | tuple) or len(token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        for token_id in token_ids:
            if not _is_int(token_id) or not 0 <= token_id <= _INT32_MAX:
                raise ValueError(f"stop_token_ids must be non-negative 32-bit integers, got {token_id!r}")

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
            return self.seed & ((1 << SEED_BITS) - 1)
        return random.getrandbits(SEED_BITS)

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if not name.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
