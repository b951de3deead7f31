"""``PrefillEngine``: deprecated, kept for existing code. ``LLMEngine(EngineArgs(engine_type=
EngineType.PROMPT, ...))`` is the same engine; the PROMPT role's code is ``roles/prefill.py``."""

from __future__ import annotations

from pdinfer.config import EngineArgs
from pdinfer.core.dp import DPGroup
from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.engine.roles import PrefillRole, role_class


class PrefillEngine(LLMEngine):
    """An ``LLMEngine`` whose args must name the PROMPT role (checked before the model loads)."""

    role: PrefillRole

    def __init__(self, engine_args: EngineArgs, dp_group: DPGroup | None = None):
        if role_class(engine_args.role) is not PrefillRole:
            raise ValueError("PrefillEngine needs engine_type=PROMPT")
        super().__init__(engine_args, dp_group)
