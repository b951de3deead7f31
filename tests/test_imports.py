"""pdinfer's imports go one way (issue 26, item 5): no module imports a module of a higher layer,
and no two modules import each other, directly or around a circle. Imports inside functions
count (a lazy import is still a dependency); imports under ``if TYPE_CHECKING:`` do not (they
name a type for the reader and run nothing).

The layers, bottom to top. A module belongs to the layer of the longest prefix below that names
it. Where a package's modules sit on two layers the split is by what they are:
- ``distributed``'s process groups and their messages (``dp_group``, ``ep_group``, ``messages``,
  ``group_error``) are plumbing that the engine's DP vote, expert parallelism and the NCCL
  transport stand on; the DP front, supervisor, ranks and clients run engines, so they sit above
  the engine.
- ``kv_transfer`` (the transports) sits below the engine: a transport moves bytes and knows no
  engine; the engine's roles drive it. (The issue proposed it above the engine; the engine's
  hand-off hooks import the connectors, so below is the order that holds.)
- The KV store's storage (``kv_store``) sits below the engine, and the engine's policy over it
  (``engine/kv_store_agent.py``) inside the engine.
- ``engine.llm`` (the offline ``LLM``) is a front end over engine clients, the DP one included:
  it sits with the serving code, and so do ``cli_args`` (the flags every command shares).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdinfer

ROOT = Path(pdinfer.__file__).parent

LAYERS: list[list[str]] = [
    [  # the shared vocabulary
        "pdinfer.env",
        "pdinfer.engine_type",
        "pdinfer.config",
        "pdinfer.sampling_params",
        "pdinfer.outputs",
        "pdinfer.sequence",
        "pdinfer.chat",
    ],
    ["pdinfer.core"],  # scheduler, block manager, DP step vote
    [
        "pdinfer.distributed.dp_group",
        "pdinfer.distributed.ep_group",
        "pdinfer.distributed.group_error",
        "pdinfer.distributed.messages",
    ],
    ["pdinfer.layers"],
    ["pdinfer.models", "pdinfer.moe"],
    ["pdinfer.worker"],
    ["pdinfer.kv_transfer", "pdinfer.kv_store"],
    ["pdinfer.engine"],
    ["pdinfer.distributed"],
    ["pdinfer.serving", "pdinfer.engine.llm", "pdinfer.cli_args"],
    ["pdinfer", "pdinfer.cli", "pdinfer.generate_cli"],
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("pdinfer", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def imports_of(module: str) -> set[str]:
    """The pdinfer modules ``module`` imports (a package's ``from . import x``: the module x)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module and target.startswith("pdinfer"):
                found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_import_goes_down_or_sideways():
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a) and not a.startswith(b + ".")
    ]
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_around_a_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    # A package's __init__ re-exporting its modules is no circle of dependencies.
    circles = [c for c in circles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_walk_sees_the_imports_it_judges():
    """The walk itself: it must find imports that exist (a broken walk would pass anything)."""
    assert "pdinfer.core.scheduler" in GRAPH["pdinfer.engine.llm_engine"]
    assert "pdinfer.engine.llm_engine" in GRAPH["pdinfer.engine.prefill_engine"]
    # the engine builds its role (the roles import no engine: no circle, above)
    assert any(m.startswith("pdinfer.engine.roles") for m in GRAPH["pdinfer.engine.llm_engine"])
    assert any(m.startswith("pdinfer.serving") for m in GRAPH["pdinfer.cli"])
