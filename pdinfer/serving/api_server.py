"""The OpenAI-compatible HTTP API of one engine: ``build_app(async_engine, served_model_name)``.

POST /v1/completions, POST /v1/chat/completions (both with ``stream``), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET /debug/kv, POST /admin/drain (``admin``). Bad input
is a 4xx in OpenAI's error shape, never a 500. A client that goes away (stream or not) aborts
its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdinfer.engine.client import EngineClient, EngineDeadError, EngineOverloadedError, RequestStream
from pdinfer.engine.output_tracker import ChoiceDelta
from pdinfer.engine.pd_common import NoRoomError
from pdinfer.serving import protocol
from pdinfer.serving.admin import add_admin_routes
from pdinfer.serving.frontend import (
    DEFAULT_MAX_BODY_BYTES,
    BodyLimit,
    PromptBuilder,
    ResponseFormat,
    check_api_key,
    install_error_handlers,
    run_unless_disconnected,
    sse_response,
)
from pdinfer.serving.metrics import RequestTimer, ServerMetrics
from pdinfer.serving.prompt_echo import PromptEcho
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

logger = logging.getLogger("pdinfer")

_END = object()


@dataclass
class _Generation:
    """The engine requests behind one HTTP request (one per prompt of a batch)."""

    n: int
    streams: list[RequestStream] = field(default_factory=list)
    timers: list[RequestTimer] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        completion = sum(s.tracker.num_output_tokens for s in self.streams)
        return protocol.usage(sum(self.prompt_tokens), completion)

    def finals(self) -> list[ChoiceDelta]:
        """Every output, whole."""
        return [
            ChoiceDelta(i * self.n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, 0)
            for i, stream in enumerate(self.streams)
            for c in stream.tracker.choices.values()
        ]

    def close(self) -> None:
        """Abort what is unfinished."""
        for stream in self.streams:
            stream.close()


class OpenAIServer:
    """The handlers behind the routes; a router or launcher can reuse the pieces."""

    def __init__(self, engine: EngineClient, served_model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine.role.name.lower())
        limits = engine.limits
        self.prompts = PromptBuilder(engine.tokenizer, limits.prompt_limit, limits.vocab_size, limits.max_model_len)

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
        if not self.engine.role.answers_clients:
            raise APIError(
                501,
                f"this engine plays {self.engine.role.name}: it serves requests "
                "only as part of a P/D pair behind `pdinfer router`",
                type="not_implemented",
                code="role_not_servable",
            )
        if self.engine.draining:
            raise _draining_error()

    # --- running requests ------------------------------------------------------------------------
    async def _start(self, prefix: str, prompts: list[dict], params, body, show_ids: bool) -> _Generation:
        arrival_s = time.monotonic()
        base = f"{prefix}-{uuid.uuid4().hex}"
        gen = _Generation(params.n)
        try:
            for i, prompt in enumerate(prompts):
                request_id = base if len(prompts) == 1 else f"{base}-{i}"
                stream = await self.engine.add_request(request_id, prompt, params, show_token_ids=show_ids)
                gen.streams.append(stream)
                gen.timers.append(RequestTimer(self.metrics, arrival_s))
                gen.prompt_tokens.append(len(prompt["prompt_token_ids"]))
        except BaseException as exc:
            gen.close()
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param=body.param_of(str(exc))) from None
            if isinstance(exc, EngineOverloadedError):
                raise APIError(503, str(exc), type="server_overloaded", code="overloaded") from None
            if isinstance(exc, NoRoomError):  # drained meanwhile, or through another API server
                raise _draining_error() from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
            raise
        return gen

    async def _deltas(self, gen: _Generation) -> AsyncIterator[ChoiceDelta]:
        """What every output gained, as it comes; ends when every stream ended."""
        try:
            if len(gen.streams) == 1:  # the common case: no merging
                async for shown in gen.streams[0]:
                    for delta in self._checked(gen, 0, shown):
                        yield delta
                return
            queue: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(gen.streams)]
            try:
                remaining = len(tasks)
                while remaining:
                    i, item = await queue.get()
                    if item is _END:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        for delta in self._checked(gen, i, item):
                            yield delta
            finally:
                for task in tasks:
                    task.cancel()
        except EngineDeadError as exc:
            raise APIError(500, str(exc), type="server_error", code="engine_dead") from None
        finally:
            gen.close()  # a consumer that stops early aborts the rest

    def _checked(self, gen: _Generation, i: int, shown: list[ChoiceDelta]) -> list[ChoiceDelta]:
        tracker = gen.streams[i].tracker
        gen.timers[i].observe(tracker)
        if tracker.finished and tracker.error and any(c.finish_reason == "error" for c in tracker.choices.values()):
            raise APIError(
                503,
                f"the engine could not finish the request: {tracker.error}",
                type="server_error",
                code="engine_error",
            )
        if i:
            for delta in shown:
                delta.index += i * gen.n
        return shown

    async def _collect(self, request: Request, gen: _Generation) -> None:
        """Run to the end; a client that disconnects meanwhile aborts its requests."""

        async def drain() -> None:
            async for _ in self._deltas(gen):
                pass

        await run_unless_disconnected(request, drain())

    # --- endpoints -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        prompts = [await self.prompts.completion_async(p, "prompt") for p in body.prompts()]
        self.prompts.check_room(prompts, params.max_tokens)
        show_ids = body.return_token_ids or params.logprobs is not None
        gen = await self._start("cmpl", prompts, params, body, show_ids)
        return await self._respond(gen, body, request, prompts, params.logprobs, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        prompt = await self.prompts.chat_async(body)
        self.prompts.check_room([prompt], params.max_tokens)
        show_ids = body.return_token_ids or params.logprobs is not None
        gen = await self._start("chatcmpl", [prompt], params, body, show_ids)
        return await self._respond(gen, body, request, [prompt], params.logprobs, chat=True)

    async def _respond(
        self, gen: _Generation, body, request: Request, prompts: list[dict], logprobs: int | None, chat: bool
    ):
        tokenizer = self.engine.tokenizer
        echo = PromptEcho.of(body, tokenizer, [stream.tracker for stream in gen.streams], logprobs)
        fmt = ResponseFormat(
            tokenizer,
            self.model_name,
            gen.streams[0].request_id,
            chat,
            logprobs,
            [p["prompt_token_ids"] for p in prompts] if body.return_token_ids else None,
            body.tool_request() if chat else None,
            self.prompts.tool_format(),
            body.n,
            prompt_echo=echo,
        )
        if body.stream:
            chunks = (fmt.chunk(d) async for d in self._deltas(gen))
            return sse_response(
                chunks, fmt, gen.usage, body.include_usage, self._count_error, gen.close, body.continuous_usage
            )
        await self._collect(request, gen)
        return fmt.body(gen.finals(), gen.usage())

    def _count_error(self, exc: APIError) -> None:
        self.metrics.errors.labels(kind=exc.code or exc.type).inc()

    async def models(self) -> dict:
        card = protocol.model_card(self.model_name, self.created, self.engine.limits.max_model_len)
        return {"object": "list", "data": [card]}

    async def model(self, model_id: str) -> dict:
        return protocol.one_model((await self.models())["data"], model_id)

    async def health(self) -> Response:
        role = self.engine.role.name.lower()
        if not self.engine.is_healthy:
            return JSONResponse({"status": "unhealthy", "error": repr(self.engine.error)}, status_code=503)
        if self.engine.draining:  # a router's health checks take it out of rotation
            return JSONResponse({"status": "draining", "role": role}, status_code=503)
        # num_steps: a router tells a busy engine (stepping) from a stuck one by it
        return JSONResponse({"status": "ok", "role": role, "num_steps": self.engine.stats.num_steps})

    async def render_metrics(self) -> Response:
        engine = self.engine
        body, content_type = self.metrics.render(engine.stats, engine.is_healthy, engine.draining)
        return Response(body, media_type=content_type)

    async def debug_kv(self) -> dict:
        stats = self.engine.stats
        answer: dict = {
            "free_blocks": stats.num_free_blocks,
            "total_blocks": stats.num_total_blocks,
            "num_aborted": stats.num_aborted,
        }
        ranks = self.engine.debug_ranks()
        if ranks:  # a DP group: each rank's own
            answer["ranks"] = ranks
        return answer


def build_app(
    async_engine: EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    protect_metrics: bool = False,
) -> FastAPI:
    """The app of one engine. The caller starts and shuts down ``async_engine``; the app
    attaches it to its event loop (``EngineClient.attach``) when it starts. ``api_key`` guards
    /v1/*, /pd/* and /admin/*, and with ``protect_metrics`` /metrics and /debug/* too; /health
    is open."""
    server = OpenAIServer(async_engine, served_model_name, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.attach()
        yield

    app = FastAPI(title="pdinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server

    install_error_handlers(app, server.metrics.errors)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    auth = [Depends(server.authorize)]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"], dependencies=auth)
    app.add_api_route("/version", protocol.version, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET", "HEAD"])
    watch = auth if protect_metrics else None
    app.add_api_route("/metrics", server.render_metrics, methods=["GET"], dependencies=watch)
    app.add_api_route("/debug/kv", server.debug_kv, methods=["GET"], dependencies=watch)
    add_admin_routes(app, async_engine, dependencies=auth)
    if async_engine.role.handoff_side is not None:
        from pdinfer.serving.pd_server import add_pd_routes

        add_pd_routes(app, async_engine, dependencies=auth)
    return app


def _draining_error() -> APIError:
    return APIError(503, "this engine is draining: it takes no new requests", type="server_overloaded", code="draining")


async def _pump(i: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        async for shown in stream:
            queue.put_nowait((i, shown))
        queue.put_nowait((i, _END))
    except Exception as exc:
        queue.put_nowait((i, exc))
