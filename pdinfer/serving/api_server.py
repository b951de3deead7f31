"""The OpenAI-compatible HTTP API of one engine: ``build_app(async_engine, served_model_name)``.

POST /v1/completions, POST /v1/chat/completions (both with ``stream``), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET /debug/kv. Bad input is a 4xx in OpenAI's error
shape, never a 500. A client that goes away (stream or not) aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdinfer.engine_type import EngineType
from pdinfer.outputs import RequestOutput
from pdinfer.serving import protocol
from pdinfer.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from pdinfer.serving.metrics import RequestTimer, ServerMetrics
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

logger = logging.getLogger("pdinfer")

_DISCONNECT_POLL_S = 0.5
_END = object()
_JSON_SEP = (",", ":")


@dataclass
class _Delta:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    text_offset: int


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
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def _check_servable(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        if self.engine.role is not EngineType.NORMAL:
            # P/D serving (requests arriving through the router) is wired by the router's work.
            raise APIError(501, f"this engine plays {self.engine.role.name}: it serves requests "
                                "only as part of a P/D pair behind `pdinfer router`",
                           type="not_implemented", code="role_not_servable")

    def _engine_prompt(self, prompt: str | list[int], param: str) -> dict:
        """Tokenize here (with the serving copy of the tokenizer) to check the length up front."""
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if self.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", param=param)
            token_ids = self.engine.tokenizer(prompt).input_ids
            return self._checked({"prompt": prompt, "prompt_token_ids": token_ids}, param)
        return self._checked({"prompt_token_ids": list(prompt)}, param)

    def _checked(self, prompt: dict, param: str) -> dict:
        num_tokens, limit = len(prompt["prompt_token_ids"]), self.engine.scheduler_config.prompt_limit
        if num_tokens > limit:
            raise bad_request(f"the prompt has {num_tokens} tokens, more than this engine's limit "
                              f"of {limit}", param=param, code="context_length_exceeded")
        return prompt

    def _chat_prompt(self, body: ChatCompletionRequest) -> dict:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions")
        messages = [m.as_template_input() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # a template raising on odd input is the input's fault
            raise bad_request(f"the chat template failed on these messages: {exc}",
                              param="messages") from None
        token_ids = tokenizer(text, add_special_tokens=False).input_ids
        return self._checked({"prompt": text, "prompt_token_ids": token_ids}, "messages")

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
            for stream in gen.streams:
                stream.close()
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
                if item.finished and item.error and any(
                        c.finish_reason == "error" for c in item.outputs):
                    raise APIError(503, f"the engine could not finish the request: {item.error}",
                                   type="server_error", code="engine_error")
                yield i, item
        finally:
            for task in tasks:
                task.cancel()  # a cancelled stream aborts its request
            for stream in gen.streams:
                stream.close()

    async def _deltas(self, gen: _Generation) -> AsyncIterator[_Delta]:
        seen: dict[int, tuple[int, int, bool]] = {}  # choice -> (text chars, tokens, finished)
        async for i, output in self._outputs(gen):
            for c in output.outputs:
                index = i * gen.n + c.index
                num_chars, num_tokens, done = seen.get(index, (0, 0, False))
                if done:
                    continue
                text = c.text[num_chars:] if len(c.text) >= num_chars else ""
                token_ids = c.token_ids[num_tokens:]
                logprobs = c.logprobs[num_tokens:] if c.logprobs is not None else None
                if not (text or c.finish_reason or (logprobs and token_ids)):
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                seen[index] = (max(num_chars, len(c.text)), len(c.token_ids), c.finished)
                yield _Delta(index, text, token_ids, logprobs, c.finish_reason, num_chars)

    async def _collect(self, request: Request, gen: _Generation) -> None:
        """Run to the end; a client that disconnects meanwhile aborts its requests."""

        async def drain() -> None:
            async for _ in self._outputs(gen):
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise APIError(499, "the client disconnected", code="client_disconnected")
            task.result()
        finally:
            task.cancel()

    def _logprobs(self, gen: _Generation, delta: _Delta, chat: bool):
        if gen.logprobs is None or delta.logprobs is None:
            return None
        tok = self.engine.tokenizer
        if chat:
            return protocol.chat_logprobs(tok, delta.token_ids, delta.logprobs, gen.logprobs)
        return protocol.completion_logprobs(tok, delta.token_ids, delta.logprobs, gen.logprobs,
                                            delta.text_offset)

    def _final_deltas(self, gen: _Generation) -> list[_Delta]:
        deltas = []
        for i, output in enumerate(gen.finals):
            for c in output.outputs if output else []:
                deltas.append(_Delta(i * gen.n + c.index, c.text, c.token_ids, c.logprobs,
                                     c.finish_reason, 0))
        return sorted(deltas, key=lambda d: d.index)

    # --- endpoints -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        prompts = [self._engine_prompt(p, "prompt") for p in body.prompts()]
        gen = await self._start("cmpl", prompts, params, "prompt")
        head = {"id": gen.streams[0].request_id, "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}

        def choice(delta: _Delta) -> dict:
            return {"index": delta.index, "text": delta.text,
                    "logprobs": self._logprobs(gen, delta, chat=False),
                    "finish_reason": delta.finish_reason}

        if body.stream:
            chunks = ({**head, "choices": [choice(d)]} async for d in self._deltas(gen))
            return self._sse(chunks, gen, head, body.include_usage)
        await self._collect(request, gen)
        choices = [choice(d) for d in self._final_deltas(gen)]
        return {**head, "choices": choices, "usage": gen.usage()}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_servable(body.model)
        params = body.sampling_params()
        gen = await self._start("chatcmpl", [self._chat_prompt(body)], params, "messages")
        head = {"id": gen.streams[0].request_id, "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name}
        if body.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}
            return self._sse(self._chat_chunks(gen, chunk_head), gen, chunk_head,
                             body.include_usage)
        await self._collect(request, gen)
        choices = [{"index": d.index, "message": {"role": "assistant", "content": d.text},
                    "logprobs": self._logprobs(gen, d, chat=True), "finish_reason": d.finish_reason}
                   for d in self._final_deltas(gen)]
        return {**head, "choices": choices, "usage": gen.usage()}

    async def _chat_chunks(self, gen: _Generation, head: dict) -> AsyncIterator[dict]:
        started: set[int] = set()
        async for d in self._deltas(gen):
            delta: dict = {} if d.index in started else {"role": "assistant"}
            started.add(d.index)
            if d.text or not d.finish_reason:
                delta["content"] = d.text
            yield {**head, "choices": [{"index": d.index, "delta": delta,
                                        "logprobs": self._logprobs(gen, d, chat=True),
                                        "finish_reason": d.finish_reason}]}

    def _sse(self, chunks: AsyncIterator[dict], gen: _Generation, head: dict,
             include_usage: bool) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=_JSON_SEP)}\n\n"
                if include_usage:
                    last = {**head, "choices": [], "usage": gen.usage()}
                    yield f"data: {json.dumps(last)}\n\n"
            except APIError as exc:  # headers are gone: the error travels as an event
                self.metrics.errors.labels(kind=exc.code or exc.type).inc()
                yield f"data: {json.dumps(exc.body())}\n\n"
            finally:
                for stream in gen.streams:
                    stream.close()
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def models(self) -> dict:
        card = protocol.model_card(self.model_name, self.created,
                                   self.engine.scheduler_config.max_model_len)
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if self.engine.is_healthy:
            return JSONResponse({"status": "ok", "role": self.engine.role.name.lower()})
        return JSONResponse({"status": "unhealthy", "error": repr(self.engine.error)},
                            status_code=503)

    async def render_metrics(self) -> Response:
        body, content_type = self.metrics.render(self.engine.stats, self.engine.is_healthy)
        return Response(body, media_type=content_type)

    async def debug_kv(self) -> dict:
        stats = self.engine.stats
        return {"free_blocks": stats.num_free_blocks, "total_blocks": stats.num_total_blocks}


def build_app(async_engine: AsyncEngine, served_model_name: str,
              api_key: str | None = None) -> FastAPI:
    """The app of one engine. The caller starts and shuts down ``async_engine``."""
    server = OpenAIServer(async_engine, served_model_name, api_key)
    app = FastAPI(title="pdinfer", docs_url=None, redoc_url=None)
    app.state.server = server

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        server.metrics.errors.labels(kind=exc.code or exc.type).inc()
        return JSONResponse(exc.body(), status_code=exc.status_code)

    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await on_api_error(request, protocol.validation_error(exc.errors()))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    auth = [Depends(server.authorize)]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"],
                      dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.render_metrics, methods=["GET"])
    app.add_api_route("/debug/kv", server.debug_kv, methods=["GET"])
    if async_engine.role is not EngineType.NORMAL:
        from pdinfer.serving.pd_server import add_pd_routes

        add_pd_routes(app, async_engine, dependencies=auth)
    return app
