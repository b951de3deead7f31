"""``NormalRole``: prefill and decode in one engine (NORMAL).

DeepInfer's base engine class is NORMAL, and so is ``Role``: every hook as the seed defines it.
A NORMAL engine prefills and decodes, finalizes finished sequences, loads stored prefixes and
saves full blocks to the KV store (after decode steps, and after prefill steps for sequences
that ended there). Its DP group votes on each step's type (``core/scheduler.py``).
"""

from __future__ import annotations

from typing import ClassVar

from pdinfer.engine.roles.base import Role
from pdinfer.engine_type import EngineType


class NormalRole(Role):
    engine_type: ClassVar[EngineType] = EngineType.NORMAL
