"""The router's engines: health checks (eject a dead engine, re-admit it when it returns) and the
router's Prometheus metrics.

An engine is admitted when its ``/health`` answers 200 (its ``/v1/models`` tells the context
length). It is ejected at once when a connection to it is refused or breaks (on the request
path or in a health check) or its ``/health`` answers an error, and after ``_MAX_SLOW_CHECKS``
checks in a row that time out (a busy engine on a small machine may answer late now and then)
while none of its streams sent the router anything: under load a late answer is usually the
router's own busy event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pdinfer.serving.load_balancer import Engine
from pdinfer.serving.metrics import PREFIX, RequestLatencyMetrics

logger = logging.getLogger("pdinfer")

_HEALTH_TIMEOUT_S = 2.0
_MAX_SLOW_CHECKS = 3
_HANDOFF_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics(RequestLatencyMetrics):
    def __init__(self, model_name: str):
        super().__init__()
        r = self.registry
        self.handoff_latency = Histogram(
            PREFIX + "router_handoff_latency_seconds",
            "Time from the prefill POST to its 200 (prefill + K/V hand-off confirmed).",
            buckets=_HANDOFF_BUCKETS_S,
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "request_errors", "HTTP requests answered with an error, by kind.", ["kind"], registry=r
        )
        self.retries = Counter(
            PREFIX + "router_retries", "Attempts retried on other engines, by reason.", ["reason"], registry=r
        )
        self.migrations = Counter(
            PREFIX + "router_migrations",
            "Requests continued on another CE after tokens went out, by reason (preempted: the CE ran "
            "out of KV blocks; drain; decode_engine_failed: the CE died or its stream broke).",
            ["reason"],
            registry=r,
        )
        self.migration_latency = Histogram(
            PREFIX + "router_migration_latency_seconds",
            "Time from a CE giving a request up to the request's next token from its new CE.",
            buckets=_HANDOFF_BUCKETS_S,
            registry=r,
        )
        self.migration_tokens = Counter(
            PREFIX + "router_migration_prefill_tokens",
            "Tokens (prompt + output so far) a PE was asked to prefill again for migrated requests; "
            "its prefix cache and the KV store serve what they hold of them.",
            registry=r,
        )
        self.ejections = Counter(
            PREFIX + "router_ejections", "Engines ejected from rotation.", ["engine", "role"], registry=r
        )
        self.readmissions = Counter(
            PREFIX + "router_readmissions", "Engines (re-)admitted into rotation.", ["engine", "role"], registry=r
        )
        self.routed = Counter(
            PREFIX + "router_requests_routed", "Engine requests sent, by engine.", ["engine", "role"], registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "router_engine_in_flight", "Requests in flight, per engine.", ["engine", "role"], registry=r
        )
        self.kv_tokens = Gauge(
            PREFIX + "router_engine_kv_tokens",
            "Prompt + generated tokens of the requests on a CE.",
            ["engine"],
            registry=r,
        )
        self.queued_tokens = Gauge(
            PREFIX + "router_engine_queued_prompt_tokens",
            "Uncached prompt tokens waiting for prefill on a PE.",
            ["engine"],
            registry=r,
        )
        self.healthy = Gauge(
            PREFIX + "router_engine_healthy", "1 while the engine is in rotation.", ["engine", "role"], registry=r
        )
        info = Gauge(PREFIX + "engine_info", "Constant 1, labelled with the identity.", ["model", "role"], registry=r)
        info.labels(model=model_name, role="router").set(1)

    def render(self, engines: list[Engine]) -> tuple[bytes, str]:
        for e in engines:
            self.in_flight.labels(engine=e.url, role=e.role).set(e.in_flight)
            self.healthy.labels(engine=e.url, role=e.role).set(1 if e.healthy else 0)
            if e.role == "prefill":
                self.queued_tokens.labels(engine=e.url).set(e.total_queued_tokens)
            else:
                self.kv_tokens.labels(engine=e.url).set(e.kv_tokens)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _note_steps(engine: Engine, resp: httpx.Response) -> None:
    try:
        num_steps = int(resp.json().get("num_steps", 0))
    except (ValueError, AttributeError, TypeError):
        return  # an engine of another version: no progress to read
    if num_steps != engine.num_steps:
        engine.num_steps, engine.last_stepped_s = num_steps, time.monotonic()


class EnginePool:
    def __init__(
        self, engines: list[Engine], client: httpx.AsyncClient, metrics: RouterMetrics, interval_s: float = 1.0
    ):
        self.engines = engines
        self.client = client
        self.metrics = metrics
        self.interval_s = interval_s
        self._slow_checks: dict[str, int] = {}

    def by_role(self, role: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role]

    def healthy(self, role: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role and e.healthy]

    @property
    def pd_servable(self) -> bool:
        return bool(self.healthy("prefill")) and bool(self.healthy("decode"))

    def max_model_len(self) -> int | None:
        """The shortest context among the engines that reported one."""
        known = [e.max_model_len for e in self.engines if e.max_model_len]
        return min(known) if known else None

    def eject(self, engine: Engine, reason: str) -> None:
        if engine.healthy:
            engine.healthy = False
            self.metrics.ejections.labels(engine=engine.url, role=engine.role).inc()
            logger.warning("router: ejected %s engine %s: %s", engine.role, engine.url, reason)

    async def run(self) -> None:
        """Check every engine every ``interval_s`` until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _check(self, engine: Engine) -> None:
        try:
            resp = await self.client.get(f"{engine.url}/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.TimeoutException:
            if time.monotonic() - engine.last_heard_s < _HEALTH_TIMEOUT_S + self.interval_s:
                # Its streams are flowing: the late answer is this router's busy event loop
                # (or the engine's), not a dead engine. Ejecting it would fail live requests.
                self._slow_checks[engine.url] = 0
                return
            slow = self._slow_checks[engine.url] = self._slow_checks.get(engine.url, 0) + 1
            if slow >= _MAX_SLOW_CHECKS:
                self.eject(engine, f"{slow} health checks in a row timed out")
            return
        except httpx.HTTPError as exc:
            self.eject(engine, f"unreachable ({type(exc).__name__})")
            return
        self._slow_checks[engine.url] = 0
        if resp.status_code != 200:
            self.eject(engine, f"/health answered {resp.status_code}")
            return
        _note_steps(engine, resp)
        if not engine.healthy:
            await self._admit(engine)

    def last_stepped_s(self, role: str) -> float:
        """When a health check last saw an engine of ``role`` step: a full cluster that steps
        is busy, one that does not is stuck (each router worker checks every engine, so this
        holds for requests of other workers too)."""
        return max((e.last_stepped_s for e in self.by_role(role)), default=float("-inf"))

    async def _admit(self, engine: Engine) -> None:
        try:
            cards = (await self.client.get(f"{engine.url}/v1/models", timeout=_HEALTH_TIMEOUT_S)).json()["data"]
            engine.max_model_len = cards[0].get("max_model_len")
            if engine.prefix is not None:  # its prefix cache cannot outgrow its KV blocks
                kv = (await self.client.get(f"{engine.url}/debug/kv", timeout=_HEALTH_TIMEOUT_S)).json()
                engine.prefix.resize(int(kv["total_blocks"]))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            logger.warning("router: %s answers /health but not /v1/models or /debug/kv: %s", engine.url, exc)
            return
        engine.healthy = True
        self.metrics.readmissions.labels(engine=engine.url, role=engine.role).inc()
        logger.info("router: %s engine %s is in rotation", engine.role, engine.url)
