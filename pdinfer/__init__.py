"""pdinfer: one engine class that plays NORMAL, PROMPT and COMPLETION, with a working P/D hand-off.

Public names are imported lazily, so ``pdinfer.core`` (scheduler, block manager) can be used
without importing torch.
"""

import importlib as _importlib
import logging as _logging

from pdinfer import env as _env

_logger = _logging.getLogger("pdinfer")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_env.get("PDINFER_LOG_LEVEL").upper())
    _logger.propagate = False

_EXPORTS = {
    "LLM": "pdinfer.engine.llm",
    "LLMEngine": "pdinfer.engine.llm_engine",
    "EngineArgs": "pdinfer.config",
    "EngineType": "pdinfer.engine_type",
    "SamplingParams": "pdinfer.sampling_params",
    "RequestOutput": "pdinfer.outputs",
    "CompletionOutput": "pdinfer.outputs",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdinfer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
