"""The chat roles both APIs take, ``LLM.chat`` and ``/v1/chat/completions``, and the role a
chat template sees for each."""

from __future__ import annotations

from typing import Literal, get_args

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def template_role(role: str) -> str:
    """developer is OpenAI's newer name for system: templates know only system."""
    return "system" if role == "developer" else role
