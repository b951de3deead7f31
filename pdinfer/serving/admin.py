"""Engine administration: ``POST /admin/drain``, and the drain ``serve`` runs on SIGTERM.

A drained engine (``EngineClient.drain``) takes no new request: an add is answered 503 (code
"draining" on /v1/*, "no_room" on /pd/*, which a router takes as "try another engine"), and
``/health`` answers 503 ``{"status": "draining"}``, so a router's health checks take the engine
out of rotation. A CE sends its live requests away: their /pd/decode streams end with
``migrate``, and the router resumes each on another CE from the tokens its client has. Other
roles finish what they hold. ``drain_engine`` then waits, at most ``timeout_s``, until nothing
is left: ``{"draining": true, "migrated": N, "remaining": M}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field

from pdinfer.engine.client import EngineClient, EngineDeadError
from pdinfer.serving.errors import APIError

logger = logging.getLogger("pdinfer")

DEFAULT_DRAIN_TIMEOUT_S = 60.0
_POLL_S = 0.05


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    timeout_s: float | None = Field(None, ge=0, allow_inf_nan=False)  # the longest wait for the end


async def drain_engine(engine: EngineClient, timeout_s: float) -> dict[str, Any]:
    """Drain the engine, then wait at most ``timeout_s`` until it holds no request and no
    stream of this server is open."""
    migrated = await engine.drain()
    deadline = time.monotonic() + timeout_s
    while not _drained(engine) and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return {"draining": True, "migrated": migrated, "remaining": engine.num_unfinished()}


def _drained(engine: EngineClient) -> bool:
    # Stats from before the drain (``draining`` False) may miss a request taken just before it.
    return engine.stats.draining and engine.num_unfinished() == 0


async def drain_before_stop(engine: EngineClient, timeout_s: float) -> None:
    """``serve``'s SIGTERM: drain, so that a router continues or finishes every request first."""
    logger.info("SIGTERM: draining the engine (at most %g s) before stopping", timeout_s)
    try:
        answer = await drain_engine(engine, timeout_s)
    except EngineDeadError as exc:
        logger.warning("SIGTERM: nothing to drain: %s", exc)
        return
    if answer["remaining"]:
        logger.warning(
            "SIGTERM: %d requests still ran after %g s of draining; stopping anyway", answer["remaining"], timeout_s
        )
    else:
        logger.info("SIGTERM: drained (%d requests migrated); stopping", answer["migrated"])


def add_admin_routes(app: FastAPI, engine: EngineClient, dependencies=None) -> None:
    async def drain(
        body: DrainRequest | None = None,
        timeout_s: float | None = Query(None, ge=0, allow_inf_nan=False),
    ) -> dict[str, Any]:
        """Drain the engine; ``timeout_s`` (the query's, else the body's; default 60) bounds the
        wait for its requests to end."""
        if timeout_s is None:
            timeout_s = body.timeout_s if body is not None else None
        try:
            return await drain_engine(engine, DEFAULT_DRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None

    app.add_api_route("/admin/drain", drain, methods=["POST"], dependencies=dependencies)
