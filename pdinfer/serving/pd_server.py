"""HTTP endpoints of the P/D roles: a CE reserves and streams, a PE prefills and hands over.

The router (``pdinfer router``) drives them; see ``pd_protocol`` for the exchange.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdinfer.engine.client import EngineClient, EngineDeadError, EngineOverloadedError
from pdinfer.engine.pd_common import NoRoomError
from pdinfer.kv_transfer.connector import HandshakeError
from pdinfer.serving.frontend import check_prompt_length, run_unless_disconnected
from pdinfer.serving.pd_protocol import (
    DecodeEvent,
    DecodeRequest,
    OutputDelta,
    PrefillRequest,
    encode_event,
    reservation_to_dict,
    sampling_from_dict,
)
from pdinfer.serving.protocol import APIError, bad_request, param_named


class PDEndpoints:
    def __init__(self, engine: EngineClient, metrics=None):
        self.engine = engine
        self.metrics = metrics

    async def _add(self, body: DecodeRequest, **extra):
        try:
            resume = body.parsed_resume()
        except ValueError as exc:
            raise bad_request(str(exc), param="resume") from None
        # before any block is reserved: a migrated request's prefill covers its tokens so far too
        num_tokens = len(body.prompt_token_ids) + (len(resume.token_ids) if resume is not None else 0)
        check_prompt_length(num_tokens, self.engine.limits.prompt_limit, "prompt_token_ids")
        if resume is not None:
            extra["resume"] = resume
        try:
            params = sampling_from_dict(body.sampling)
            prompt = {"prompt_token_ids": list(body.prompt_token_ids)}
            return await self.engine.add_request(body.request_id, prompt, params, show_token_ids=True, **extra)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param=param_named(str(exc))) from None
        except (NoRoomError, EngineOverloadedError) as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="no_room") from None
        except HandshakeError as exc:
            raise APIError(502, str(exc), type="server_error", code="kv_handshake_failed") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None

    async def decode(self, body: DecodeRequest) -> StreamingResponse:
        """CE: reserve (or 503 at once), then stream the request's outputs as deltas."""
        self._require("decode")
        stream = await self._add(body)
        reservation = stream.accepted

        async def events() -> AsyncIterator[bytes]:
            yield encode_event(DecodeEvent(reservation=reservation_to_dict(reservation)))
            tracker = stream.tracker
            try:
                async for shown in stream:
                    deltas = [OutputDelta(d.index, d.text, d.token_ids, d.finish_reason, d.logprobs) for d in shown]
                    finished = tracker.finished
                    error, migrate = (tracker.error, tracker.migrate) if finished else (None, None)
                    yield encode_event(DecodeEvent(None, deltas, finished, error, migrate))
            except EngineDeadError as exc:  # the router continues it on another engine
                yield encode_event(DecodeEvent(finished=True, error=str(exc), migrate="engine_dead"))
            finally:
                stream.close()  # the router went away: abort (frees reserved or decoding blocks)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def prefill(self, body: PrefillRequest, request: Request) -> dict:
        """PE: prefill, push K/V + first token to the reserving CE, answer once it confirmed. If
        the router goes away first (its client left, or the attempt failed), the request is
        aborted: no prefill for nobody, its blocks back at once. (The router keeps this
        connection open until the answer even when the CE's output is complete before it.)"""
        self._require("prefill")
        try:
            reservation = body.parsed_reservation()
        except (TypeError, ValueError) as exc:
            raise bad_request(f"invalid reservation: {exc}") from None
        start = time.monotonic()
        stream = await self._add(body, apply_stops=False, reservation=reservation)

        async def drain() -> None:
            async for _ in stream:
                pass

        try:
            await run_unless_disconnected(request, drain())
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
        finally:
            stream.close()
        final = stream.output()
        first_tokens = final.outputs[0].token_ids[:1] if final.outputs else []
        if not final.finished or final.error:
            error = final.error or "no output"
            raise APIError(
                504 if "lease" in (error or "") else 502,
                f"the hand-off failed: {error}",
                type="server_error",
                code="handoff_failed",
            )
        answer = {"first_tokens": first_tokens, "handoff_s": time.monotonic() - start}
        if stream.tracker.prompt_logprobs is not None:  # the router relays them to the client
            answer["prompt_logprobs"] = msgspec.to_builtins(stream.tracker.prompt_logprobs)
        return answer

    def _require(self, side: str) -> None:
        if self.engine.role.handoff_side != side:
            raise APIError(
                400,
                f"this engine plays {self.engine.role.name}; this endpoint is for the {side} side of a P/D hand-off",
                code="wrong_role",
            )


def add_pd_routes(app: FastAPI, engine: EngineClient, dependencies=None) -> PDEndpoints:
    endpoints = PDEndpoints(engine)
    app.add_api_route("/pd/decode", endpoints.decode, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/pd/prefill", endpoints.prefill, methods=["POST"], dependencies=dependencies)
    return endpoints
