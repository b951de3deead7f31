"""The three roles one engine class can play (DeepInfer's ``EngineType``)."""

from __future__ import annotations

import enum


class EngineType(enum.Enum):
    """Role of an ``LLMEngine``.

    The integer value crosses process boundaries (DP groups, KV transfer messages, router
    registration); never insert a member in between, and turn ints back with ``from_int``.
    """

    NORMAL = 0  # prompts and completions
    PROMPT = 1  # prompts only (prefill engine, "PE")
    COMPLETION = 2  # completions only (decode engine, "CE")

    # --- what each role does: code outside the engine asks these, never "which role is it" ---
    @property
    def answers_clients(self) -> bool:
        """It takes OpenAI requests itself (NORMAL). A PE or CE serves only its half of a P/D
        hand-off, behind the router."""
        return self is EngineType.NORMAL

    @property
    def handoff_side(self) -> str | None:
        """Its half of the P/D hand-off: "prefill" (PE), "decode" (CE) or None (NORMAL)."""
        return {EngineType.PROMPT: "prefill", EngineType.COMPLETION: "decode"}.get(self)

    @property
    def votes_on_step_type(self) -> bool:
        """Its DP group's ranks vote on every step's type (NORMAL): they step together, an
        idle rank running companion empty steps. A PE's or CE's step type is its role's."""
        return self is EngineType.NORMAL

    @property
    def sizes_for_decode(self) -> bool:
        """Its largest step is a decode step (COMPLETION): KV profiling and the MoE workspace
        are sized for max_num_seqs x (1 + draft tokens) tokens, not for a prefill budget."""
        return self is EngineType.COMPLETION

    @property
    def drafts_tokens(self) -> bool:
        """It keeps a draft pool (one slot per request) and speculates in decode steps (NORMAL,
        COMPLETION). A PE never drafts: it only prefills, and in P/D drafting starts on the CE
        after the PE's first token."""
        return self is not EngineType.PROMPT

    @property
    def eplb_counts_prefill_steps(self) -> bool:
        """The seed's ``_update_rearrangement``: PROMPT and COMPLETION count every step toward
        the EPLB interval; NORMAL does not count its prefill steps."""
        return self is not EngineType.NORMAL

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        # A PE's steps are large prefills and it must hand requests over at once; delaying
        # output processing by one step would only add hand-off latency.
        return self in (EngineType.NORMAL, EngineType.COMPLETION)

    @property
    def default_eplb_interval(self) -> int:
        # The seed's production values: decode engines' expert loads drift slowly (EPLB every
        # 10,000 steps), prefill engines' faster (every 1,000). NORMAL mostly decodes.
        return 1000 if self is EngineType.PROMPT else 10000

    @classmethod
    def from_int(cls, value: int) -> EngineType:
        """Validate an int received from elsewhere; an unknown value fails loudly."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"engine_type must be an int, got {value!r}")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown engine_type {value}: expected 0 (NORMAL), 1 (PROMPT) or 2 (COMPLETION)"
            ) from None

    @classmethod
    def parse(cls, value: str | int | EngineType) -> EngineType:
        """Accept an EngineType, its int, or its name in any case ("prompt", "COMPLETION")."""
        if isinstance(value, EngineType):
            return value
        if isinstance(value, int):
            return cls.from_int(value)
        name = str(value).strip().upper()
        if name.isdigit():
            return cls.from_int(int(name))
        if name not in cls.__members__:
            raise ValueError(f"unknown engine role {value!r}: use normal, prompt or completion")
        return cls[name]
