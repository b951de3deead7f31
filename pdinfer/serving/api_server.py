"""The OpenAI-compatible HTTP API of one engine: ``build_app(async_engine, served_model_name)``.

POST /v1/completions, POST /v1/chat/completions (both with ``stream``), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET /debug/kv. Bad input is a 4xx in OpenAI's error
shape, never a 500. A client that goes away (stream or not) aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdinfer.engine_type import EngineType
from pdinfer.outputs import RequestOutput
from pdinfer.serving import protocol
from pdinfer.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from pdinfer.serving.frontend import (
    Delta,
    DeltaTracker,
    PromptBuilder,
    ResponseFormat,
    check_api_key,
    install_error_handlers,
    run_unless_disconnected,
    sse_response,
)
from pdinfer.serving.metrics import RequestTimer, ServerMetrics
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

logger = logging.getLogger("pdinfer")

_END = object()


@dataclass
class _Generation:
    """The engine requests behind one HTTP request (one per prompt of a batch)."""

    streams: list[RequestStream]
    timers: list[RequestTimer]
    n: int
    logprobs: int | None
    prompt_tokens: list[int] = field(default_factory=list)
    finals: list[RequestOutput | None] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.token_ids) for out in self.finals if out for c in out.outputs)
        return protocol.usage(sum(self.prompt_tokens), completion)

    def close(self) -> None:
        """Abort what is unfinished."""
        for stream in self.streams:
            stream.close()


class OpenAIServer:
    """The handlers behind the routes; a router or launcher can reuse the pieces."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine.role.name.lower())

    # --- checks ----------------------------------------------------------------------------------
    async def authorize(self, request: Request) -> None:
        check_api_key(request, self.api_key)

    def _check_servable(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if self.engine.role is not EngineType.NORMAL:
            # P/D serving (requests arriving through the router) is wired by the router's work.
            raise APIError(
                501,
                f"this engine plays {self.engine.role.name}: it serves requests "
                "only as part of a P/D pair behind `pdinfer router`",
                type="not_implemented",
                code="role_not_servable",
            )

    @property
    def prompts(self) -> PromptBuilder:
        """Tokenizes with the serving copy of the tokenizer to check the length up front."""
        return PromptBuilder(self.engine.tokenizer, self.engine.scheduler_config.prompt_limit)

    # --- running requests ------------------------------------------------------------------------
    async def _start(self, prefix: str, prompts: list[dict], params, param: str) -> _Generation:
        arrival_s = time.monotonic()
        base = f"{prefix}-{uuid.uuid4().hex}"
        gen = _Generation([], [], params.n, params.logprobs)
        try:
            for i, prompt in enumerate(prompts):
                request_id = base if len(prompts) == 1 else f"{base}-{i}"
                gen.streams.append(await self.engine.add_request(request_id, prompt, params))
                gen.timers.append(RequestTimer(self.metrics, arrival_s))
                gen.prompt_tokens.append(len(prompt["prompt_token_ids"]))
        except BaseException as exc:
            gen.close()
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param=param) from None
            if isinstance(exc, EngineOverloadedError):
                raise APIError(503, str(exc), type="server_overloaded", code="overloaded") from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
            raise
        gen.finals = [None] * len(prompts)
        return gen

    async def _outputs(self, gen: _Generation) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) from all of the generation's streams, as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((i, output))
                queue.put_nowait((i, _END))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(gen.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                    continue
                if isinstance(item, EngineDeadError):
                    raise APIError(500, str(item), type="server_error", code="engine_dead")
                if isinstance(item, Exception):
                    raise item
                gen.timers[i].observe(item)
                gen.finals[i] = item
                if item.finished and item.error and any(c.finish_reason == "error" for c in item.outputs):
                    raise APIError(
                        503,
                        f"the engine could not finish the request: {item.error}",
                        type="server_error",
                        code="engine_error",
                    )
                yield i, item
        finally:
            for task in tasks:
                task.cancel()  # a cancelled stream aborts its request
            gen.close()

    async def _deltas(self, gen: _Generation, token_ids: bool = False) -> AsyncIterator[Delta]:
        tracker = DeltaTracker(token_ids)
        async for i, output in self._outputs(gen):
            for c in output.outputs:
                delta = tracker.update(i * gen.n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason)
                if delta is not None:
                    yield delta

    async def _collect(self, request: Request, gen: _Generation) -> None:
        """Run to the end; a client that disconnects meanwhile aborts its requests."""

        async def drain() -> None:
            async for _ in self._outputs(gen):
                pass

        await run_unless_disconnected(request, drain())

    def _final_deltas(self, gen: _Generation) -> list[Delta]:
        return [
            Delta(i * gen.n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, 0)
            for i, output in enumerate(gen.finals)
            for c in (output.outputs if output else [])
        ]

    # --- endpoints -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        prompts = [self.prompts.completion(p, "prompt") for p in body.prompts()]
        gen = await self._start("cmpl", prompts, params, "prompt")
        return await self._respond(gen, body, request, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        gen = await self._start("chatcmpl", [self.prompts.chat(body)], params, "messages")
        return await self._respond(gen, body, request, chat=True)

    async def _respond(self, gen: _Generation, body, request: Request, chat: bool):
        fmt = ResponseFormat(
            self.engine.tokenizer, self.model_name, gen.streams[0].request_id, chat, gen.logprobs, body.return_token_ids
        )
        if body.stream:
            chunks = (fmt.chunk(d) async for d in self._deltas(gen, body.return_token_ids))
            return sse_response(
                chunks,
                fmt,
                gen.usage,
                body.include_usage,
                self._count_error,
                gen.close,
            )
        await self._collect(request, gen)
        return fmt.body(self._final_deltas(gen), gen.usage())

    def _count_error(self, exc: APIError) -> None:
        self.metrics.errors.labels(kind=exc.code or exc.type).inc()

    async def models(self) -> dict:
        card = protocol.model_card(self.model_name, self.created, self.engine.scheduler_config.max_model_len)
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if self.engine.is_healthy:
            return JSONResponse({"status": "ok", "role": self.engine.role.name.lower()})
        return JSONResponse({"status": "unhealthy", "error": repr(self.engine.error)}, status_code=503)

    async def render_metrics(self) -> Response:
        body, content_type = self.metrics.render(self.engine.stats, self.engine.is_healthy)
        return Response(body, media_type=content_type)

    async def debug_kv(self) -> dict:
        stats = self.engine.stats
        return {
            "free_blocks": stats.num_free_blocks,
            "total_blocks": stats.num_total_blocks,
            "num_aborted": stats.num_aborted,
        }


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The app of one engine. The caller starts and shuts down ``async_engine``."""
    server = OpenAIServer(async_engine, served_model_name, api_key)
    app = FastAPI(title="pdinfer", docs_url=None, redoc_url=None)
    app.state.server = server

    install_error_handlers(app, server.metrics.errors)
    auth = [Depends(server.authorize)]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.render_metrics, methods=["GET"])
    app.add_api_route("/debug/kv", server.debug_kv, methods=["GET"])
    if async_engine.role is not EngineType.NORMAL:
        from pdinfer.serving.pd_server import add_pd_routes

        add_pd_routes(app, async_engine, dependencies=auth)
    return app
