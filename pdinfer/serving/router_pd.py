"""One prompt through a CE and a PE (the exchange of ``pd_protocol``), with retries and migration.

An attempt: reserve on the CE the decode balancer ranks first (503 no room: the next one; all
full: wait and try again), pick a PE, POST the prefill while reading the CE's stream, relay the
CE's deltas. A PE whose waiting queue is full (503 no room) is back-pressure too: a new attempt
after a pause, not counted. A request waits out back-pressure as long as the cluster moves: it
fails ("overloaded") only once it has waited ``queue_timeout_s`` and, for that long, no CE took
a request of this router worker's nor ran a step (the health checks see each CE's step count):
a busy cluster queues, a stuck one answers.
A failure of either engine (connection refused or broken, 5xx, a CE stream that ends early, a
request the CE gave up) makes a new attempt elsewhere: the failed CE stream and the PE's
connection are closed, which makes the CE abort the reservation and the PE its prefill (so
does a client that leaves). 4xx answers are the request's fault and end it at once.

Migration (``docs/kv-transfer.md``): the job records every token its CEs sent, per output.
Once it has tokens, a new attempt does not start over: it resumes (``outputs.Resume``) from
them, through a PE that prefills prompt + tokens so far and a CE that decodes on, so the
client's answer goes on with no gap, repeat or error, and greedy or seeded output equals an
unmigrated run (``PDJob`` fixes the seed, so an unseeded request keeps its random stream).
An attempt that brought tokens and then ended (the CE ran out of blocks, was drained, died) is
a migration, never counted against ``max_attempts``; one that brought none is a retry, as
before. With ``n > 1``, the outputs still running when a CE gave up are resumed one after
another. A request that succeeded leaves the PE's answer to come in the background: the CE's
output can be complete before the CE's ack reached the PE, and closing the connection then
would make the PE abort a hand-off that went through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pdinfer.outputs import MIGRATE_DRAIN, MIGRATE_PREEMPTED
from pdinfer.serving import upstream
from pdinfer.serving.load_balancer import Assignment, DecodeBalancer, Engine, PrefillBalancer
from pdinfer.serving.pd_job import GIVEN_UP, PDJob, without_give_up
from pdinfer.serving.pd_protocol import DecodeEvent, decode_event, prompt_logprobs_of
from pdinfer.serving.protocol import APIError
from pdinfer.serving.router_pool import EnginePool, RouterMetrics

logger = logging.getLogger("pdinfer")

_NO_ROOM_BACKOFF_S = 0.05
# A full PE (503 no_room), or a CE that gave the request up (out of blocks, drained) before it
# had sent a token: wait for room, without counting an attempt (``PDDriver._stalled`` bounds it).
_BACK_PRESSURE = ("prefill_full", "decode_preempted", "drain")
_BACKGROUND_GRACE_S = 2.0  # at shutdown, how long PE answers still to come may take


class Retry(Exception):
    """This attempt failed; ``exclude`` the engine at fault. The job's record says whether it
    is a retry (no token yet) or a migration (``PDDriver.drive``)."""

    def __init__(self, reason: str, message: str, exclude: str | None = None):
        super().__init__(message)
        self.reason, self.exclude = reason, exclude


# A CE's ``migrate`` reason -> the reason the router counts (and retries) it under.
_MIGRATE_REASONS = {MIGRATE_PREEMPTED: "decode_preempted", MIGRATE_DRAIN: "drain"}


def _error(resp: upstream.UpstreamResponse, body: bytes) -> tuple[str, str | None, str | None]:
    """(message, code, param) of an engine's OpenAI-shaped error answer."""
    try:
        error = json.loads(body)["error"]
        param = error.get("param")
        return str(error["message"]), error.get("code"), param if isinstance(param, str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"HTTP {resp.status_code}: {body[:200]!r}", None, None


class PDDriver:
    def __init__(
        self,
        pool: EnginePool,
        engine_headers: dict[str, str],
        metrics: RouterMetrics,
        prefill_lb: PrefillBalancer,
        decode_lb: DecodeBalancer,
        max_attempts: int = 3,
        queue_timeout_s: float = 60.0,
        engine_timeout_s: float = 600.0,
    ):
        self.pool, self.metrics = pool, metrics
        self.engine_headers = engine_headers  # content type and the engines' API key
        self.prefill_lb, self.decode_lb = prefill_lb, decode_lb
        self.max_attempts = max_attempts
        self.queue_timeout_s = queue_timeout_s
        self.engine_timeout_s = engine_timeout_s
        self._background: set[asyncio.Future] = set()  # PE answers still to come (``_keep``)
        self._last_reserved_s = time.monotonic()  # when a CE last took a request (any request)

    def _keep(self, task: asyncio.Future) -> None:
        """Let ``task`` run on after its attempt, held here (the loop keeps only a weak reference)."""
        if not task.done():
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def close(self, grace_s: float = _BACKGROUND_GRACE_S) -> None:
        """At shutdown: give the PE answers still to come ``grace_s``, then cancel the rest."""
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def drive(self, job: PDJob) -> None:
        """Run ``job`` to its end; every outcome, failures included, lands on its queue."""
        try:
            excluded: set[str] = set()
            failures = 0
            waiting_since = time.monotonic()
            while failures < self.max_attempts:
                job.start_attempt()
                tokens_before = job.num_job_tokens
                try:
                    await self._attempt(job, excluded)
                    if job.next_resume() is not None:
                        continue  # n > 1 after a migration: the next output still to finish
                    self._observe_finished(job)
                    job.finish()
                    return
                except Retry as exc:
                    if exc.exclude:
                        excluded.add(exc.exclude)
                    if job.num_job_tokens > tokens_before:  # it got somewhere: a migration
                        self._migrated(job, exc)
                        waiting_since = time.monotonic()
                        continue
                    if exc.reason in _BACK_PRESSURE and not self._stalled(waiting_since):
                        await asyncio.sleep(_NO_ROOM_BACKOFF_S)  # as a full CE's: no attempt counted
                        continue
                    last, failures = exc, failures + 1
                    logger.warning("router: attempt %d of %s failed (%s)", job.attempt, job.request_id, exc)
                    if failures < self.max_attempts:
                        self.metrics.retries.labels(reason=exc.reason).inc()
            raise APIError(
                503,
                f"the request failed on {self.max_attempts} attempts; the last one: {last}",
                type="server_error",
                code="engine_failed",
            )
        except APIError as exc:
            job.queue.put_nowait((job.index, "error", exc))
        except Exception as exc:  # a router bug: fail this request, not the router
            logger.exception("router: request %s failed", job.request_id)
            job.queue.put_nowait(
                (job.index, "error", APIError(500, f"router error: {exc!r}", type="server_error", code="router_error"))
            )

    def _stalled(self, waiting_since: float) -> bool:
        """Back-pressure has lasted ``queue_timeout_s`` for this request and for the cluster."""
        now = time.monotonic()
        moved_s = max(self._last_reserved_s, self.pool.last_stepped_s("decode"))
        return now - waiting_since > self.queue_timeout_s and now - moved_s > self.queue_timeout_s

    def _migrated(self, job: PDJob, exc: Retry) -> None:
        """A CE gave ``job`` up after it had sent tokens: it goes on from them elsewhere."""
        self.metrics.migrations.labels(reason=exc.reason).inc()
        job.given_up_s = time.monotonic()
        logger.info("router: %s moves to another engine after %d tokens (%s)", job.request_id, job.num_job_tokens, exc)

    def _observe_finished(self, job: PDJob) -> None:
        now = time.monotonic()
        self.metrics.e2e_latency.observe(now - job.arrival_s)
        if job.first_token_s is not None and job.num_tokens > 1:
            self.metrics.time_per_output_token.observe((now - job.first_token_s) / (job.num_tokens - 1))

    # --- one attempt ----------------------------------------------------------------------------
    async def _attempt(self, job: PDJob, excluded: set[str]) -> None:
        body = job.body()
        if job.resume is not None:
            self.metrics.migration_tokens.inc(len(job.token_ids) + len(job.resume.token_ids))
        decode, response, lines, reservation = await self._reserve(body, excluded)
        ce = decode.engine
        prefill = self.prefill_lb.pick(job.token_ids, exclude=excluded)
        events: asyncio.Queue = asyncio.Queue()
        reader = prefilling = None
        try:
            if prefill is None:
                raise APIError(503, "no prefill engine is available", type="server_error", code="no_prefill_engine")
            self.metrics.routed.labels(engine=ce.url, role=ce.role).inc()
            self.metrics.routed.labels(engine=prefill.engine.url, role="prefill").inc()
            reader = asyncio.ensure_future(self._read(ce, lines, events))
            prefilling = asyncio.ensure_future(self._prefill(prefill, body, reservation, events))
            await self._relay(job, ce, decode, events)
            # The CE's output can be complete before its ack reached the PE, and a PE aborts a
            # prefill whose connection closed: so the PE's answer is awaited in the background.
            self._keep(prefilling)
            prefilling = None
        finally:
            if reader is not None:
                reader.cancel()
            if prefilling is not None:
                prefilling.cancel()  # a failure, or the client left: the PE aborts the request
            if prefill is not None:
                prefill.release()
            decode.release()
            response.close()  # the CE aborts whatever it still holds for this attempt

    async def _reserve(self, body: dict, excluded: set[str]):
        """The first CE (in balancer order) with room: (assignment, response, lines,
        reservation). A CE is charged when picked, before the await, so a burst spreads."""
        waiting_since = time.monotonic()
        while True:
            candidates = self.decode_lb.candidates(excluded)
            if not candidates:
                raise APIError(503, "no completion engine is available", type="server_error", code="no_decode_engine")
            for ce in candidates:
                num_tokens = len(body["prompt_token_ids"]) + len(body.get("resume", {}).get("token_ids", ()))
                decode = self.decode_lb.assign(ce, num_tokens)
                reserved = None
                try:
                    reserved = await self._try_reserve(ce, body, excluded)
                finally:
                    if reserved is None:
                        decode.release()
                if reserved is not None:
                    self._last_reserved_s = time.monotonic()
                    return (decode, *reserved)
            if self._stalled(waiting_since):
                raise APIError(
                    503,
                    f"every completion engine stayed full, and took no request, for {self.queue_timeout_s:.0f} s; "
                    "retry later",
                    type="server_overloaded",
                    code="overloaded",
                )
            await asyncio.sleep(_NO_ROOM_BACKOFF_S)

    async def _try_reserve(self, ce: Engine, body: dict, excluded: set[str]):
        try:
            response = await self._post(ce, "/pd/decode", body)
        except upstream.UpstreamError as exc:
            self.pool.eject(ce, f"/pd/decode failed ({exc})")
            excluded.add(ce.url)
            return None
        reserved = None
        try:
            reserved = await self._read_reservation(ce, response, excluded)
            return reserved
        finally:
            if reserved is None:  # a refusal, a broken stream, or cancelled while waiting for it
                response.close()  # the CE aborts whatever it reserved

    async def _read_reservation(self, ce: Engine, response: upstream.UpstreamResponse, excluded: set[str]):
        if response.status_code != 200:
            try:
                error, code, param = _error(response, await response.read())
            except upstream.UpstreamError as exc:
                error, code, param = str(exc), None, None
            if response.status_code == 503 and code == "no_room":
                return None  # back-pressure: the next CE, or wait
            if 400 <= response.status_code < 500:
                raise APIError(response.status_code, error, param=param, code=code)
            excluded.add(ce.url)
            return None
        lines = upstream.sse_data(response)
        try:
            async for line in lines:
                reservation = decode_event(line).reservation
                if reservation is None:
                    raise ValueError("the first event carries no reservation")
                return response, lines, reservation
        except (upstream.UpstreamError, ValueError) as exc:
            logger.warning("router: no reservation from %s: %r", ce.url, exc)
        self.pool.eject(ce, "its /pd/decode stream broke before the reservation")
        excluded.add(ce.url)
        return None

    async def _post(self, engine: Engine, path: str, body: dict) -> upstream.UpstreamResponse:
        payload = json.dumps(body, separators=(",", ":")).encode()
        return await upstream.send(engine.url, "POST", path, payload, self.engine_headers, self.engine_timeout_s)

    async def _read(self, ce: Engine, lines, events: asyncio.Queue) -> None:
        try:
            async for line in lines:
                ce.last_heard_s = time.monotonic()
                events.put_nowait(("event", decode_event(line)))
            events.put_nowait(("ce_failed", "its stream ended before the request finished"))
        except (upstream.UpstreamError, ValueError) as exc:
            events.put_nowait(("ce_failed", f"its stream broke ({exc})"))

    async def _prefill(self, prefill: Assignment, body: dict, reservation: dict, events: asyncio.Queue) -> None:
        pe, start = prefill.engine, time.monotonic()
        try:
            resp = await self._post(pe, "/pd/prefill", {**body, "reservation": reservation})
            content = await resp.read()
        except upstream.UpstreamError as exc:
            self.pool.eject(pe, f"/pd/prefill failed ({exc})")
            events.put_nowait(
                (
                    "prefill_failed",
                    Retry("prefill_engine_failed", f"the prefill engine {pe.url} failed: {exc!r}", pe.url),
                )
            )
            return
        finally:
            prefill.release()
        if resp.status_code == 200:
            self.metrics.handoff_latency.observe(time.monotonic() - start)
            try:
                events.put_nowait(("prefilled", prompt_logprobs_of(json.loads(content))))
            except ValueError as exc:  # a PE of another version
                events.put_nowait(("prefill_failed", Retry("handoff_failed", f"prefill on {pe.url}: {exc}", pe.url)))
            return
        error, code, _ = _error(resp, content)
        # The CE accepted this request, so a 4xx here is the PE's disagreement (another
        # version, another model), and a 503 a dying PE: try another PE. A full PE (503
        # no_room: its waiting queue is at --max-waiting) is back-pressure: ``drive`` tries
        # again after a pause, within --queue-timeout-s, without counting an attempt. 502/504:
        # the hand-off failed (a CE that went away is ejected by its own stream or the health
        # checks), so any pair may try again.
        if resp.status_code == 503 and code == "no_room":
            events.put_nowait(("prefill_failed", Retry("prefill_full", f"prefill on {pe.url}: {error}")))
            return
        exclude = pe.url if resp.status_code < 500 or resp.status_code == 503 else None
        events.put_nowait(("prefill_failed", Retry("handoff_failed", f"prefill on {pe.url}: {error}", exclude)))

    async def _relay(self, job: PDJob, ce: Engine, decode: Assignment, events: asyncio.Queue) -> None:
        # Prompt log-probs come in the PE's answer: the CE's events wait for it, so they lead.
        held: list[DecodeEvent] | None = [] if job.wants_prompt_logprobs else None
        while True:
            kind, item = await events.get()
            if kind == "prefilled" and held is not None:
                if item is None:
                    raise Retry("handoff_failed", "the prefill engine answered without the prompt log-probs")
                job.prompt_logprobs, waiting, held = item, held, None
                for event in waiting:
                    if self._on_event(job, decode, event):
                        return
                continue
            if kind == "prefilled" or (kind == "prefill_failed" and job.num_tokens):
                continue  # once tokens flow, the CE holds the K/V: the PE's answer is moot
            if kind == "prefill_failed":
                raise item
            if kind == "ce_failed" and held and held[-1].finished:
                continue  # the CE is done (its stream ended); its events wait for the PE's answer
            if kind == "ce_failed":  # died or cut off: another CE goes on from the tokens so far
                self.pool.eject(ce, str(item))
                raise Retry("decode_engine_failed", f"the completion engine {ce.url}: {item}", ce.url)
            if held is not None:
                held.append(item)
            elif self._on_event(job, decode, item):
                return

    def _on_event(self, job: PDJob, decode: Assignment, event: DecodeEvent) -> bool:
        """Relay one CE event; True once the request finished. A CE that gave the request up
        (``migrate``) ends the attempt with its tokens relayed and its give-up finishes held
        back: the next attempt resumes those outputs."""
        migrate = event.migrate if event.finished else None
        outputs = [without_give_up(d) if d.finish_reason in GIVEN_UP else d for d in event.outputs]
        num_new = sum(len(d.token_ids) for d in outputs)
        error = event.error if event.finished and migrate is None else None
        if error and not job.has_tokens:  # nothing came yet: another attempt may run
            raise Retry("decode_error", f"the completion engine ended the request: {error}")
        decode.add_tokens(num_new)
        if num_new:
            now = time.monotonic()
            if job.first_token_s is None:
                job.first_token_s = now
                self.metrics.time_to_first_token.observe(now - job.arrival_s)
            if job.given_up_s is not None:
                self.metrics.migration_latency.observe(now - job.given_up_s)
                job.given_up_s = None
            job.num_tokens += max(len(d.token_ids) for d in outputs)
        if outputs:
            job.deliver(outputs)
        if migrate is not None:
            reason = _MIGRATE_REASONS.get(migrate, "decode_engine_failed")
            raise Retry(reason, f"the completion engine gave the request up ({migrate}): {event.error}")
        if error:
            raise APIError(
                503, f"the engine could not finish the request: {error}", type="server_error", code="engine_error"
            )
        return event.finished
