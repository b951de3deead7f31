"""``pdinfer router``: the P/D front door, the same OpenAI API as ``pdinfer serve``.

Per request the router validates the body (``protocol``), tokenizes the prompts (or applies the
chat template) with the model's tokenizer, and sends token ids to the engines:
- a request whose prompts total at most ``--normal-max-prompt-tokens`` goes to a NORMAL engine
  when ``--normal`` engines are configured (and any request does while no PE/CE pair is healthy),
  proxied as-is to that engine's own /v1 API; a NORMAL engine that refuses (5xx) or is
  unreachable passes the request on to the next one, then to P/D;
- every other prompt goes through a CE and a PE (``router_pd``: reservation, prefill, relay,
  retries), chosen by the balancers of ``load_balancer`` (their rules are stated there).
The answer has the shapes of ``api_server`` (both use ``frontend``). Health checks every
``--health-interval-s`` eject dead engines and re-admit them (``router_pool``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdinfer.outputs import PromptLogprobs
from pdinfer.serving import protocol, upstream
from pdinfer.serving.frontend import (
    CLIENT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    BodyLimit,
    Delta,
    PromptBuilder,
    ResponseFormat,
    check_api_key,
    install_error_handlers,
    run_unless_disconnected,
    sse_response,
)
from pdinfer.serving.load_balancer import (
    DecodeBalancer,
    Engine,
    NormalBalancer,
    PrefillBalancer,
)
from pdinfer.serving.pd_job import PDJob
from pdinfer.serving.pd_protocol import OutputDelta, sampling_to_dict
from pdinfer.serving.prompt_echo import PromptEcho
from pdinfer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from pdinfer.serving.router_pd import PDDriver
from pdinfer.serving.router_pool import EnginePool, RouterMetrics

logger = logging.getLogger("pdinfer")


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    normal_urls: list[str] = field(default_factory=list)
    api_key: str | None = None
    engine_api_key: str | None = None  # sent to the engines (``launch`` gives them one)
    protect_metrics: bool = False
    normal_max_prompt_tokens: int = 256
    prefix_tolerance_tokens: int = 2048
    max_attempts: int = 3
    queue_timeout_s: float = 60.0
    engine_timeout_s: float = 600.0
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.normal_urls and not (self.prefill_urls and self.decode_urls):
            raise ValueError("the router needs --prefill and --decode engines, or --normal ones")
        if bool(self.prefill_urls) != bool(self.decode_urls):
            raise ValueError("P/D needs both --prefill and --decode engines")
        if self.protect_metrics and not self.api_key:
            raise ValueError("--protect-metrics needs an API key (--api-key or PDINFER_API_KEY)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


@dataclass
class _Choice:
    """One output as relayed so far: the CE's deltas pass through as they are; the parts are
    kept only for a whole (non-streamed) answer."""

    num_chars: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    keep: bool = False
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None

    def relay(self, index: int, d: OutputDelta) -> Delta:
        delta = Delta(index, d.text, d.token_ids, d.logprobs, d.finish_reason, self.num_chars)
        self.num_chars += len(d.text)
        self.num_tokens += len(d.token_ids)
        self.finish_reason = d.finish_reason or self.finish_reason
        if self.keep:
            self.texts.append(d.text)
            self.token_ids += d.token_ids
            if d.logprobs is not None:
                self.logprobs = (self.logprobs or []) + d.logprobs
        return delta

    def final(self, index: int) -> Delta:
        return Delta(index, "".join(self.texts), self.token_ids, self.logprobs, self.finish_reason, 0)


@dataclass
class _Prompt:
    """One prompt of a request as its answer shows it (a ``prompt_echo.PromptSource``)."""

    job: PDJob
    prompt: str | None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.job.token_ids

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        return self.job.prompt_logprobs


# The prompts of one request that the router drives at once (a PE answers 503 once
# ``serve --max-waiting`` requests, 1024 by default, wait in its queue).
MAX_PROMPTS_IN_FLIGHT = 128


@dataclass
class _Generation:
    """The P/D jobs behind one HTTP request (one per prompt), feeding one queue."""

    request_id: str
    n: int
    prompt_tokens: list[int]
    whole: bool  # a non-streamed answer: keep every choice's parts for the body
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Future] = field(default_factory=list)
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompts: list[_Prompt] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        completion = sum(c.num_tokens for c in self.choices.values())
        return protocol.usage(sum(self.prompt_tokens), completion)

    def finals(self) -> list[Delta]:
        return [c.final(i) for i, c in self.choices.items()]

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()  # each driver closes its CE stream: the engines abort


class Router:
    def __init__(
        self,
        config: RouterConfig,
        model_name: str,
        tokenizer,
        vocab_size: int | None,
        default_max_model_len: int | None,
    ):
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.default_max_model_len = default_max_model_len
        self.created = int(time.time())
        self.metrics = RouterMetrics(model_name)
        headers = {"Authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else None
        self._engine_headers = {"content-type": "application/json", **(headers or {})}
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=CLIENT_KEEP_ALIVE_S
            ),
            headers=headers,
        )
        engines = (
            [Engine(u, "prefill") for u in config.prefill_urls]
            + [Engine(u, "decode") for u in config.decode_urls]
            + [Engine(u, "normal") for u in config.normal_urls]
        )
        self.pool = EnginePool(engines, self.client, self.metrics, config.health_interval_s)
        self.prefill_lb = PrefillBalancer(self.pool.by_role("prefill"), config.prefix_tolerance_tokens)
        self.decode_lb = DecodeBalancer(self.pool.by_role("decode"))
        self.normal_lb = NormalBalancer(self.pool.by_role("normal"))
        self.driver = PDDriver(
            self.pool,
            self._engine_headers,
            self.metrics,
            self.prefill_lb,
            self.decode_lb,
            config.max_attempts,
            config.queue_timeout_s,
            config.engine_timeout_s,
        )
        self._prompts = PromptBuilder(tokenizer, None, vocab_size)

    # --- checks ----------------------------------------------------------------------------------
    async def authorize(self, request: Request) -> None:
        check_api_key(request, self.config.api_key)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @property
    def prompts(self) -> PromptBuilder:
        """One builder (it keeps a tokenizer copy for its worker thread); the context limit is
        the shortest the engines report now."""
        self._prompts.prompt_limit = self._prompts.max_model_len = self.pool.max_model_len()
        return self._prompts

    # --- endpoints -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        params = body.sampling_params()
        prompts = [await self.prompts.completion_async(p, "prompt") for p in body.prompts()]
        self.prompts.check_room(prompts, params.max_tokens)
        return await self._serve(request, body, "cmpl", prompts, params, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        params = body.sampling_params()
        prompt = await self.prompts.chat_async(body)
        self.prompts.check_room([prompt], params.max_tokens)
        return await self._serve(request, body, "chatcmpl", [prompt], params, chat=True)

    async def _serve(self, request: Request, body, prefix: str, prompts: list[dict], params, chat: bool):
        num_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        if self.pool.healthy("normal") and (
            num_tokens <= self.config.normal_max_prompt_tokens or not self.pool.pd_servable
        ):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            response = await self._proxy_normal(request, path, body, num_tokens)
            if response is not None:
                return response
        if not self.pool.pd_servable:
            raise APIError(
                503,
                "no healthy prefill and completion engines to serve this request",
                type="server_error",
                code="no_engine",
            )
        gen = self._start(prefix, prompts, params, whole=not body.stream)
        echo = PromptEcho.of(body, self.tokenizer, gen.prompts, params.logprobs)
        fmt = ResponseFormat(
            self.tokenizer,
            self.model_name,
            gen.request_id,
            chat,
            params.logprobs,
            [p["prompt_token_ids"] for p in prompts] if body.return_token_ids else None,
            body.tool_request() if chat else None,
            self.prompts.tool_format(),
            body.n,
            prompt_echo=echo,
        )
        if body.stream:
            chunks = (fmt.chunk(d) async for d in self._deltas(gen))
            return sse_response(
                chunks, fmt, gen.usage, body.include_usage, self._count_error, gen.cancel, body.continuous_usage
            )
        try:
            await run_unless_disconnected(request, self._drain(gen))
        except APIError as exc:  # an engine's 400 names the field as the engine knows it
            if exc.status_code == 400:
                exc.param = body.param_of(exc.message, exc.param)
            raise
        return fmt.body(gen.finals(), gen.usage())

    def _start(self, prefix: str, prompts: list[dict], params, whole: bool) -> _Generation:
        num_tokens = [len(p["prompt_token_ids"]) for p in prompts]
        gen = _Generation(f"{prefix}-{uuid.uuid4().hex}", params.n, num_tokens, whole)
        sampling = sampling_to_dict(params)
        # A batch of many prompts runs at most MAX_PROMPTS_IN_FLIGHT at a time: all at once, it
        # would fill a PE's waiting queue by itself and be refused as overload.
        gate = asyncio.Semaphore(MAX_PROMPTS_IN_FLIGHT)
        for i, prompt in enumerate(prompts):
            job = PDJob(i, f"{gen.request_id}-{i}", list(prompt["prompt_token_ids"]), sampling, gen.queue, gen.whole)
            gen.prompts.append(_Prompt(job, prompt.get("prompt")))
            gen.tasks.append(asyncio.ensure_future(self._drive(job, gate)))
        return gen

    async def _drive(self, job: PDJob, gate: asyncio.Semaphore) -> None:
        async with gate:
            await self.driver.drive(job)

    async def _deltas(self, gen: _Generation) -> AsyncIterator[Delta]:
        """The CEs' deltas, renumbered into the request's choices (prompt-major)."""
        remaining = len(gen.tasks)
        try:
            while remaining:
                i, kind, payload = await gen.queue.get()
                if kind == "done":
                    remaining -= 1
                    continue
                if kind == "error":
                    raise payload
                for d in payload:
                    index = i * gen.n + d.index
                    choice = gen.choices.get(index)
                    if choice is None:
                        choice = gen.choices[index] = _Choice(keep=gen.whole)
                    elif choice.finish_reason is not None:
                        continue  # nothing follows a finish
                    yield choice.relay(index, d)
        finally:
            gen.cancel()

    async def _drain(self, gen: _Generation) -> None:
        async for _ in self._deltas(gen):
            pass

    def _count_error(self, exc: APIError) -> None:
        self.metrics.errors.labels(kind=exc.code or exc.type).inc()

    # --- NORMAL engines --------------------------------------------------------------------------
    async def _proxy_normal(self, request: Request, path: str, body, num_tokens: int) -> Response | None:
        """The answer of the first NORMAL engine that takes the request; None if none does. The
        client's body goes on as it came (it was checked); the answer comes back as bytes
        (``upstream``: no re-parsing, several events per write when the router falls behind)."""
        payload = await request.body()
        refusal: Response | None = None
        for engine in self.normal_lb.candidates():
            assignment = self.normal_lb.assign(engine, num_tokens)
            resp = None
            for attempt in (0, 1):
                sent = upstream.send(
                    engine.url,
                    "POST",
                    path,
                    payload,
                    self._engine_headers,
                    self.config.engine_timeout_s,
                )
                try:  # a client that leaves while the engine works on a whole answer cancels it
                    resp = await run_unless_disconnected(request, sent)
                    break
                except APIError:  # the client left: the engine's request was cancelled with it
                    assignment.release()
                    raise
                except upstream.UpstreamError as exc:
                    # A connection reset before any answer is tried once more; anything else,
                    # or a second failure, takes the engine out of rotation.
                    if attempt or not exc.before_head:
                        self.pool.eject(engine, f"{path} failed ({exc})")
                        break
            if resp is None:
                assignment.release()
                continue
            engine.last_heard_s = time.monotonic()
            if resp.status_code >= 500:  # overloaded or failing: someone else
                assignment.release()
                try:
                    content = await resp.read()
                    refusal = Response(
                        content, resp.status_code, _relayed_headers(resp), resp.headers.get("content-type")
                    )
                except upstream.UpstreamError:
                    pass
                finally:
                    resp.close()
                continue
            self.metrics.routed.labels(engine=engine.url, role=engine.role).inc()
            if body.stream and resp.status_code == 200:
                return StreamingResponse(
                    self._relay_stream(resp, assignment),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            try:
                content = await run_unless_disconnected(request, resp.read())
            except upstream.UpstreamError as exc:
                raise APIError(502, f"the engine failed: {exc}", type="server_error", code="engine_failed") from None
            finally:
                assignment.release()
                resp.close()
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
        # Every engine refused: without P/D engines to try, the client gets the last refusal
        # (an overloaded engine's 503 and its Retry-After) rather than a vaguer one of ours.
        return refusal if not self.pool.pd_servable else None

    async def _relay_stream(self, resp: upstream.UpstreamResponse, assignment) -> AsyncIterator[bytes]:
        engine = assignment.engine
        try:
            async for data in resp.chunks():
                engine.last_heard_s = time.monotonic()
                yield data
        except upstream.UpstreamError as exc:
            error = APIError(502, f"the engine failed mid-stream: {exc}", type="server_error", code="engine_failed")
            self._count_error(error)
            yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            assignment.release()
            resp.close()  # before the end: the client went away, and the engine aborts

    # --- the rest of the API ---------------------------------------------------------------------
    async def models(self) -> dict:
        max_len = self.pool.max_model_len() or self.default_max_model_len
        return {"object": "list", "data": [protocol.model_card(self.model_name, self.created, max_len)]}

    async def model(self, model_id: str) -> dict:
        return protocol.one_model((await self.models())["data"], model_id)

    async def health(self) -> JSONResponse:
        counts = {role: len(self.pool.healthy(role)) for role in ("prefill", "decode", "normal")}
        ok = self.pool.pd_servable or counts["normal"] > 0
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "role": "router", **counts}, status_code=200 if ok else 503
        )

    async def render_metrics(self) -> Response:
        body, content_type = self.metrics.render(self.pool.engines)
        return Response(body, media_type=content_type)

    async def debug_engines(self) -> list[dict]:
        return [
            {
                "url": e.url,
                "role": e.role,
                "healthy": e.healthy,
                "in_flight": e.in_flight,
                "kv_tokens": e.kv_tokens,
                "queued_tokens": e.total_queued_tokens,
            }
            for e in self.pool.engines
        ]

    # --- lifecycle -------------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.pool.check_all()
        health = asyncio.ensure_future(self.pool.run())
        try:
            yield
        finally:
            health.cancel()
            await self.driver.close()
            await self.client.aclose()


def _relayed_headers(resp: upstream.UpstreamResponse) -> dict[str, str]:
    return {"Retry-After": resp.headers["retry-after"]} if "retry-after" in resp.headers else {}


def build_router_app(router: Router, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pdinfer router", docs_url=None, redoc_url=None, lifespan=router.lifespan)
    app.state.router = router
    install_error_handlers(app, router.metrics.errors)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    auth = [Depends(router.authorize)]
    app.add_api_route("/v1/completions", router.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", router.chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", router.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", router.model, methods=["GET"], dependencies=auth)
    app.add_api_route("/version", protocol.version, methods=["GET"])
    app.add_api_route("/health", router.health, methods=["GET", "HEAD"])
    watch = auth if router.config.protect_metrics else None
    app.add_api_route("/metrics", router.render_metrics, methods=["GET"], dependencies=watch)
    app.add_api_route("/debug/engines", router.debug_engines, methods=["GET"], dependencies=watch)
    return app
