"""``CompletionEngine``: deprecated, kept for existing code. ``LLMEngine(EngineArgs(engine_type=
EngineType.COMPLETION, ...))`` is the same engine; the COMPLETION role's code is
``roles/completion.py``. ``NoRoomError`` lives in ``pd_common``."""

from __future__ import annotations

from pdinfer.config import EngineArgs
from pdinfer.core.dp import DPGroup
from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.engine.pd_common import NoRoomError
from pdinfer.engine.roles import CompletionRole, role_class

__all__ = ["CompletionEngine", "NoRoomError"]


class CompletionEngine(LLMEngine):
    """An ``LLMEngine`` whose args must name the COMPLETION role (checked before the model loads)."""

    role: CompletionRole

    def __init__(self, engine_args: EngineArgs, dp_group: DPGroup | None = None):
        if role_class(engine_args.role) is not CompletionRole:
            raise ValueError("CompletionEngine needs engine_type=COMPLETION")
        super().__init__(engine_args, dp_group)
