"""Settings flow one way (issue 26, items 1 and 4): the role's defaults go into the environment
in one place (``EngineArgs``, the seed's setdefault), are read back once into fields, and from
there reach the engine, the worker and the models as arguments. Only ``pdinfer.env`` writes the
environment; the engine and everything below it never read it; code outside the role modules
asks a role what it does (``EngineType.answers_clients``, ``engine.role.finalizes_seqs`` and the
like), never which role it is (issue 26, item 1: the roles are components).

The source walks parse pdinfer's modules (the same walk as test_imports.py); the behaviour tests
build ``EngineArgs`` under a changing environment.
"""

from __future__ import annotations

import ast
import os

from test_imports import MODULES

from pdinfer import EngineArgs, EngineType
from pdinfer.cli import build_parser
from pdinfer.cli_args import engine_args_from

# The engine and what it stands on: settings arrive as fields, never from the environment.
NO_ENV_READS = ("core", "layers", "models", "moe", "worker", "kv_transfer", "kv_store", "engine")
# The only places that ask which role an engine plays: the enum's own answers, the role defaults
# of the config, the scheduler's switch (the seed's ``_schedule()``) and the role components.
ROLE_CHECKS_ALLOWED = ("engine_type", "config", "core.scheduler", "engine.roles")
ROLE_NAMES = {name.lower() for name in EngineType.__members__} | set(EngineType.__members__)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == f"pdinfer.{p}" or module.startswith(f"pdinfer.{p}.") for p in packages)


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", "") == "os"


def _env_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AugAssign) and any(
            isinstance(t, ast.Subscript) and _is_os_environ(t.value) for t in targets
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if _is_os_environ(f.value) and f.attr in ("setdefault", "update", "pop", "clear", "__setitem__"):
                lines.append(node.lineno)
            if f.attr in ("putenv", "unsetenv") and getattr(f.value, "id", "") == "os":
                lines.append(node.lineno)
    return lines


def _env_reads(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if _is_os_environ(node):
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") in ("env", "pdinfer_env"):
            if node.attr in ("get", "rearm", "snapshot"):
                lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "getenv" and getattr(node.value, "id", "") == "os":
            lines.append(node.lineno)
    return lines


def _role_checks(tree: ast.AST) -> list[int]:
    """``EngineType.PROMPT`` and the like, and comparisons of an ``engine_type`` or ``role``
    with a constant (``engine_type == 1``, ``role != "prompt"``)."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", "") == "EngineType"
            and node.attr in EngineType.__members__
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {getattr(side, "attr", getattr(side, "id", None)) for side in sides}
            constants = [side.value for side in sides if isinstance(side, ast.Constant)]
            if names & {"engine_type", "role"} and any(
                c in ROLE_NAMES or (isinstance(c, int) and not isinstance(c, bool) and c in (0, 1, 2))
                for c in constants
            ):
                lines.append(node.lineno)
    return lines


def _walk(rule, packages=None) -> dict[str, list[int]]:
    found = {}
    for module, path in MODULES.items():
        if packages is not None and not _in(module, packages):
            continue
        lines = rule(ast.parse(path.read_text()))
        if lines:
            found[module] = lines
    return found


def test_only_pdinfer_env_writes_the_environment():
    writers = _walk(_env_writes)
    assert set(writers) == {"pdinfer.env"}, writers  # env.py itself: the walk sees writes


def test_the_engine_and_below_never_read_the_environment():
    assert _walk(_env_reads, NO_ENV_READS) == {}
    assert "pdinfer.config" in _walk(_env_reads)  # EngineArgs does, once: the walk sees reads


def test_role_checks_only_where_roles_are_defined():
    found = _walk(_role_checks)
    allowed = {module for module in found if _in(module, ROLE_CHECKS_ALLOWED)}
    assert set(found) == allowed, {m: lines for m, lines in found.items() if m not in allowed}
    # The walk sees the checks that are there: each role module names its role, the
    # scheduler switches on it, the config sets its defaults.
    assert {
        "pdinfer.engine_type",
        "pdinfer.config",
        "pdinfer.core.scheduler",
        "pdinfer.engine.roles.normal",
        "pdinfer.engine.roles.prefill",
        "pdinfer.engine.roles.completion",
    } <= set(found)
    # ...and both forms of a check: an enum member, and a comparison with a constant.
    assert _role_checks(ast.parse("if e.engine_type is EngineType.PROMPT: pass")) == [1]
    assert _role_checks(ast.parse("ok = engine.engine_type == 1 or r.role != 'completion'")) == [1, 1]
    assert _role_checks(ast.parse("ok = seq.num_tokens == 1 or engine.engine_type is kind")) == []


def test_engine_args_read_the_environment_once_and_explicit_arguments_win(monkeypatch):
    monkeypatch.setenv("PDINFER_CPU_AMX", "0")
    monkeypatch.setenv("PDINFER_PREFILL_ATTEMPT_INTERVAL", "9")
    monkeypatch.setenv("PDINFER_STEP_LOG", "/tmp/steps.log")
    args = EngineArgs()
    explicit = EngineArgs(prefill_attempt_interval=4)
    monkeypatch.setenv("PDINFER_CPU_AMX", "1")  # later changes reach only later EngineArgs
    monkeypatch.setenv("PDINFER_PREFILL_ATTEMPT_INTERVAL", "11")
    assert args.runner_options.cpu_amx is False and args.step_log == "/tmp/steps.log"
    assert args.create_scheduler_config(2048).prefill_attempt_interval == 9
    assert explicit.create_scheduler_config(2048).prefill_attempt_interval == 4
    assert EngineArgs().runner_options.cpu_amx is True


def test_serves_prefill_attempt_interval_is_an_argument_not_an_environment_variable(monkeypatch):
    monkeypatch.delenv("PDINFER_PREFILL_ATTEMPT_INTERVAL", raising=False)
    cli = build_parser().parse_args(["serve", "--prefill-attempt-interval", "5"])
    args = engine_args_from(cli, role=cli.role)
    assert args.create_scheduler_config(2048).prefill_attempt_interval == 5
    assert "PDINFER_PREFILL_ATTEMPT_INTERVAL" not in os.environ


def test_roles_answer_what_they_do():
    normal, prompt, completion = EngineType.NORMAL, EngineType.PROMPT, EngineType.COMPLETION
    assert [r.answers_clients for r in (normal, prompt, completion)] == [True, False, False]
    assert [r.handoff_side for r in (normal, prompt, completion)] == [None, "prefill", "decode"]
    assert [r.votes_on_step_type for r in (normal, prompt, completion)] == [True, False, False]
    assert [r.sizes_for_decode for r in (normal, prompt, completion)] == [False, False, True]
    assert [r.eplb_counts_prefill_steps for r in (normal, prompt, completion)] == [False, True, True]
