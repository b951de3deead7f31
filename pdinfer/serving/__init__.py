"""Serving: ``AsyncEngine`` (an engine stepped on a background thread, driven from asyncio) and
the OpenAI-compatible HTTP app of one engine (``build_app``). The P/D router reuses both."""

from pdinfer.serving.api_server import OpenAIServer, build_app
from pdinfer.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    RequestStream,
)

__all__ = [
    "AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineStats", "RequestStream",
    "OpenAIServer", "build_app",
]
