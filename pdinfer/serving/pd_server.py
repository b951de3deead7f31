"""HTTP endpoints of the P/D roles: a CE reserves and streams, a PE prefills and hands over.

The router (``pdinfer router``) drives them; see ``pd_protocol`` for the exchange.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdinfer.engine.completion_engine import NoRoomError
from pdinfer.engine_type import EngineType
from pdinfer.kv_transfer.connector import HandshakeError
from pdinfer.serving.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from pdinfer.serving.pd_protocol import (
    DecodeRequest,
    PrefillRequest,
    output_delta,
    reservation_to_dict,
    sampling_from_dict,
)
from pdinfer.serving.protocol import APIError, bad_request

_JSON_SEP = (",", ":")


class PDEndpoints:
    def __init__(self, engine: AsyncEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics

    async def _add(self, body: DecodeRequest, **extra):
        try:
            params = sampling_from_dict(body.sampling)
            prompt = {"prompt_token_ids": list(body.prompt_token_ids)}
            return await self.engine.add_request(body.request_id, prompt, params, **extra)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from None
        except (NoRoomError, EngineOverloadedError) as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="no_room") from None
        except HandshakeError as exc:
            raise APIError(502, str(exc), type="server_error", code="kv_handshake_failed") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None

    async def decode(self, body: DecodeRequest) -> StreamingResponse:
        """CE: reserve (or 503 at once), then stream the request's outputs as deltas."""
        self._require(EngineType.COMPLETION)
        stream = await self._add(body)
        reservation = stream.accepted

        async def events() -> AsyncIterator[str]:
            yield _event({"reservation": reservation_to_dict(reservation)})
            seen: dict[int, tuple[int, int]] = {}
            try:
                async for output in stream:
                    deltas = []
                    for c in output.outputs:
                        chars, tokens = seen.get(c.index, (0, 0))
                        logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
                        deltas.append(
                            output_delta(c.index, c.text[chars:], c.token_ids[tokens:], logprobs, c.finish_reason)
                        )
                        seen[c.index] = (len(c.text), len(c.token_ids))
                    yield _event(
                        {
                            "outputs": deltas,
                            "finished": output.finished,
                            "error": output.error if output.finished else None,
                        }
                    )
            finally:
                stream.close()  # the router went away: abort (frees reserved or decoding blocks)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def prefill(self, body: PrefillRequest) -> dict:
        """PE: prefill, push K/V + first token to the reserving CE, answer once it confirmed."""
        self._require(EngineType.PROMPT)
        try:
            reservation = body.parsed_reservation()
        except (TypeError, ValueError) as exc:
            raise bad_request(f"invalid reservation: {exc}") from None
        start = time.monotonic()
        stream = await self._add(body, reservation=reservation)
        first_tokens: list[int] = []
        final = None
        try:
            async for output in stream:
                if output.outputs and output.outputs[0].token_ids:
                    first_tokens = output.outputs[0].token_ids[:1]
                final = output
        finally:
            stream.close()
        if final is None or not final.finished or final.error:
            error = final.error if final is not None else "no output"
            raise APIError(
                504 if "lease" in (error or "") else 502,
                f"the hand-off failed: {error}",
                type="server_error",
                code="handoff_failed",
            )
        return {"first_tokens": first_tokens, "handoff_s": time.monotonic() - start}

    def _require(self, role: EngineType) -> None:
        if self.engine.role is not role:
            raise APIError(
                400,
                f"this engine plays {self.engine.role.name}; this endpoint is for {role.name} engines",
                code="wrong_role",
            )


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=_JSON_SEP)}\n\n"


def add_pd_routes(app: FastAPI, engine: AsyncEngine, dependencies=None) -> PDEndpoints:
    endpoints = PDEndpoints(engine)
    app.add_api_route("/pd/decode", endpoints.decode, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/pd/prefill", endpoints.prefill, methods=["POST"], dependencies=dependencies)
    return endpoints
