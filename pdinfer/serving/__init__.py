"""Serving: ``AsyncEngine`` (an engine stepped on a background thread, driven from asyncio) and
the OpenAI-compatible HTTP app of one engine (``build_app``). The P/D router reuses both.

Names are imported lazily, so the router, ``launch`` and ``bench`` do not import torch.
"""

import importlib as _importlib

_EXPORTS = {
    "AsyncEngine": "pdinfer.serving.async_engine",
    "EngineDeadError": "pdinfer.serving.async_engine",
    "EngineOverloadedError": "pdinfer.serving.async_engine",
    "EngineStats": "pdinfer.serving.async_engine",
    "RequestStream": "pdinfer.serving.async_engine",
    "OpenAIServer": "pdinfer.serving.api_server",
    "build_app": "pdinfer.serving.api_server",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdinfer.serving' has no attribute {name!r}")
