"""Every ``PDINFER_*`` environment variable, declared once, typed and documented.

Values are read once into a snapshot at import (reading ``os.environ`` on hot paths is slow and
makes behaviour depend on when a value was read). A component that changes a variable at run
time, as ``EngineArgs.__post_init__`` does with role defaults, calls ``rearm(name)`` afterwards.
A value that does not parse fails loudly, naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (0/1/true/false), got {text!r}")


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def _parse_non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {value}")
    return value


def _parse_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a number in [0, 1], got {value}")
    return value


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


_VARS: dict[str, EnvVar] = {}


def _declare(name: str, parse: Callable[[str], Any], default: Any, doc: str) -> None:
    _VARS[name] = EnvVar(name, parse, default, doc)


_declare(
    "PDINFER_ZERO_OVERHEAD_SCHEDULING",
    _parse_bool,
    None,
    "Overlap host scheduling/output processing of step N with the forward of step N+1. "
    "Unset: the role decides (on for NORMAL and COMPLETION, off for PROMPT).",
)
_declare(
    "PDINFER_PREFILL_ATTEMPT_INTERVAL",
    _parse_positive_int,
    70,
    "NORMAL engines: every this many decode steps is an ALL point, where the DP group "
    "prefills only if every rank wants to.",
)
_declare(
    "PDINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
    _parse_positive_int,
    100,
    "NORMAL engines: every this many decode steps is an ANY point, where the DP group "
    "prefills if any rank wants to (so a lone request never starves).",
)
_declare(
    "PDINFER_PREFILL_KV_WATERMARK",
    _parse_fraction,
    0.95,
    "NORMAL engines: a rank wants to prefill only while its KV cache usage is at most this.",
)
_declare(
    "PDINFER_ENFORCE_EAGER",
    _parse_bool,
    False,
    "Disable CUDA graphs (GPU only). CUDA graphs are never used by PROMPT engines.",
)
_declare(
    "PDINFER_EPLB_INTERVAL",
    _parse_non_negative_int,
    None,
    "MoE engines with expert parallelism or redundant experts: rearrange the experts every this "
    "many counted steps (0: never). Unset: the role decides (1000 on PROMPT, 10000 on NORMAL and "
    "COMPLETION); EngineArgs(eplb_interval=...) / --eplb-interval wins over both.",
)
_declare(
    "PDINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE",
    _parse_bool,
    True,
    "NORMAL MoE engines: a prefill step schedules the expert rearrangement for the next "
    "non-prefill step (the seed's default). 0: prefill steps are only skipped, not counted.",
)
_declare(
    "PDINFER_CACHE_DIR",
    str,
    os.path.join(os.path.expanduser("~"), ".cache", "pdinfer"),
    "Where converted model folders (dequantized GGUF) are cached.",
)
_declare(
    "PDINFER_CPU_QUANT_GEMM",
    _parse_bool,
    True,
    "CPU, float32, GGUF models: steps of up to 192 rows (decode; 64 for Q8_0) read the file's "
    "Q4_0/Q4_1/Q8_0 blocks instead of the de-quantized floats (the same values; 3-4x fewer bytes). 0: floats.",
)
_declare(
    "PDINFER_CPU_AMX",
    _parse_bool,
    True,
    "CPU with AMX (Sapphire Rapids and later), float32, GGUF models: steps of 32 rows or more "
    "(prefill, large decode batches) multiply the file's blocks on AMX tiles, each input split in "
    "three bfloat16 parts (float32 accuracy). 0: the other quantized GEMMs and oneDNN.",
)
_declare(
    "PDINFER_CPU_DECODE_STACK",
    _parse_bool,
    True,
    "CPU, float32: a decode step's decoder layers run as one native call (the same kernels in "
    "the same order as the torch modules, without their Python overhead). 0: the modules.",
)
_declare(
    "PDINFER_LOG_LEVEL",
    str,
    "INFO",
    "Log level of the pdinfer logger (DEBUG, INFO, WARNING, ERROR).",
)
_declare(
    "PDINFER_KV_SECRET",
    str,
    "",
    "The shared secret of a P/D cluster's KV hand-off (what --kv-secret sets; the flag wins). "
    "`pdinfer launch` generates one per cluster and hands it to its engines here, out of `ps`.",
)
_declare(
    "PDINFER_API_KEY",
    str,
    "",
    "The API key of `pdinfer serve` or `pdinfer router` when --api-key is not given (the flag "
    "wins): a key set here stays out of `ps`. `pdinfer launch` gives its engines a random one.",
)
_declare(
    "PDINFER_ENGINE_API_KEY",
    str,
    "",
    "`pdinfer router`: the key it sends (Authorization: Bearer) on every call to an engine. "
    "`pdinfer launch` sets it to the key it gave its engines.",
)
_declare(
    "PDINFER_STEP_LOG",
    str,
    "",
    "If set, a file path; every engine step appends one line with its step type (used by DP tests to compare ranks).",
)

_snapshot: dict[str, Any] = {}


def _read(var: EnvVar) -> Any:
    raw = os.environ.get(var.name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {var.name}={raw!r} is invalid: {exc}") from None


def rearm(name: str) -> Any:
    """Re-read one variable from ``os.environ`` into the snapshot and return its value."""
    if name not in _VARS:
        raise KeyError(f"{name} is not a declared pdinfer environment variable")
    _snapshot[name] = _read(_VARS[name])
    return _snapshot[name]


_role_defaults: dict[str, str] = {}


def set_role_default(name: str, value: str) -> None:
    """``os.environ.setdefault`` that still lets a later engine of another role set its own.

    A value the operator exported wins. A value pdinfer itself set as an earlier engine's role
    default is replaced: several engines of different roles may share one process (tests, the
    in-process P/D pair), and the first one's default must not become the second one's.
    """
    if name not in _VARS:
        raise KeyError(f"{name} is not a declared pdinfer environment variable")
    current = os.environ.get(name)
    if current is None or _role_defaults.get(name) == current:
        os.environ[name] = value
        _role_defaults[name] = value


def set_mooncake_defaults(host: str) -> None:
    """Mooncake's own settings, which it reads only from the environment: its TCP lanes on our
    host (else it may advertise another interface), and only its errors on stderr (it logs every
    connection at INFO). An operator's values win. This module is the only one that writes the
    environment."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def set_parent_death_signal(sig: int) -> None:
    """Linux: this process gets ``sig`` when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG),
    so no child pdinfer starts outlives its launcher; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def die_with_parent(sig: int, parent_pid: int | None) -> bool:
    """``set_parent_death_signal(sig)``, then whether ``parent_pid`` is still this process's
    parent: one that died before the signal was set never sends it (the child was handed to
    another process), so a False caller must exit at once."""
    set_parent_death_signal(sig)
    return os.getppid() == parent_pid


def child_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` for a child process, without the role defaults pdinfer exported itself.

    ``set_role_default`` writes into ``os.environ`` (the seed's ``setdefault``), and a child
    process inherits it. There it would look like an operator's explicit value and override the
    child's own role: a PROMPT engine spawned after an in-process NORMAL engine would run with
    zero-overhead scheduling on. Every process pdinfer spawns gets its environment from here.
    """
    environ = {k: v for k, v in os.environ.items() if _role_defaults.get(k) != v}
    environ.update(extra or {})
    return environ


def get(name: str) -> Any:
    if name not in _VARS:
        raise KeyError(f"{name} is not a declared pdinfer environment variable")
    return _snapshot[name]


def declared() -> dict[str, EnvVar]:
    return dict(_VARS)


def __getattr__(name: str) -> Any:
    # ``env.PDINFER_X`` reads the snapshot.
    if name in _VARS:
        return _snapshot[name]
    raise AttributeError(name)


for _name in _VARS:
    rearm(_name)
