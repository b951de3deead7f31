"""The roles one ``LLMEngine`` plays, as components: ``engine.role`` is built from
``EngineArgs.role`` by ``make_role``.

- ``base.py``: ``Role`` (the seed's default hooks, NORMAL's) and ``EngineView`` (what a role
  sees of its engine);
- ``normal.py``: NORMAL, prefill and decode in one engine;
- ``prefill.py``: PROMPT, the PE's half of the P/D hand-off (stage, push, wait for the ack);
- ``completion.py``: COMPLETION, the CE's half (reserve, verify, land, quarantine).
"""

from __future__ import annotations

from pdinfer.engine.roles.base import EngineView, Role
from pdinfer.engine.roles.completion import CompletionRole
from pdinfer.engine.roles.normal import NormalRole
from pdinfer.engine.roles.prefill import PrefillRole
from pdinfer.engine_type import EngineType

ROLES: dict[EngineType, type[Role]] = {cls.engine_type: cls for cls in (NormalRole, PrefillRole, CompletionRole)}

__all__ = ["ROLES", "CompletionRole", "EngineView", "NormalRole", "PrefillRole", "Role", "make_role", "role_class"]


def role_class(engine_type: EngineType) -> type[Role]:
    return ROLES[engine_type]


def make_role(engine: EngineView) -> Role:
    """The role component of ``engine``, from its ``EngineArgs.role``."""
    return role_class(engine.engine_type)(engine)
