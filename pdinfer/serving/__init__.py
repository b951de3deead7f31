"""Serving: the OpenAI-compatible HTTP app of one engine (``build_app``) over any
``EngineClient`` (``engine/client``); ``AsyncEngine`` is the in-process client (an engine stepped
on a background thread, driven from asyncio). The P/D router reuses the app's pieces.

Names are imported lazily, so the router, ``launch`` and ``bench`` do not import torch.
"""

import importlib as _importlib

_EXPORTS = {
    "AsyncEngine": "pdinfer.engine.inproc_client",
    "InProcessEngineClient": "pdinfer.engine.inproc_client",
    "MPEngineClient": "pdinfer.engine.mp_client",
    "EngineClient": "pdinfer.engine.client",
    "EngineDeadError": "pdinfer.engine.client",
    "EngineOverloadedError": "pdinfer.engine.client",
    "EngineStats": "pdinfer.engine.core_messages",
    "RequestStream": "pdinfer.engine.client",
    "OpenAIServer": "pdinfer.serving.api_server",
    "build_app": "pdinfer.serving.api_server",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name == "AsyncEngine":
        name = "InProcessEngineClient"
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdinfer.serving' has no attribute {name!r}")
