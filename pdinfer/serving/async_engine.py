"""``AsyncEngine``: one ``LLMEngine`` stepped on a background thread, driven from asyncio.

The engine is not thread-safe, so only the loop thread ever calls into it. Callers put commands
(add, abort) on a queue that the loop thread drains between steps; outputs go back to each
request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. With nothing to do the thread
sleeps on a condition variable; it never spins.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdinfer.engine.llm_engine import LLMEngine
from pdinfer.engine_type import EngineType
from pdinfer.outputs import RequestOutput
from pdinfer.sampling_params import SamplingParams

logger = logging.getLogger("pdinfer")

_ADDED = object()  # the loop thread's acknowledgement that add_request succeeded
_IDLE_POLL_S = 0.002


def _refusals() -> tuple[type[BaseException], ...]:
    from pdinfer.engine.completion_engine import NoRoomError
    from pdinfer.kv_transfer.connector import HandshakeError

    return (NoRoomError, HandshakeError)


_REFUSALS = _refusals()


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed, or it was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its limit (``max_waiting``); the caller should retry later."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by the loop thread; safe to read from any thread."""

    num_waiting: int = 0
    num_running: int = 0
    num_prompted: int = 0
    num_requests: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    # PE only: confirmed K/V hand-offs (``PrefillEngine.handoff_stats``), cumulative
    num_handoffs: int = 0
    handoff_bytes: int = 0
    handoff_seconds: float = 0.0
    num_handoffs_failed: int = 0

    @property
    def kv_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.num_prefix_query_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens


class RequestStream:
    """The outputs of one request, cumulative, as its steps produce them.

    Leaving it before the final output (``close``, a cancelled ``__anext__``, garbage
    collection) aborts the request, so its KV blocks are freed.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, accepted=None):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self.accepted = accepted  # what the engine answered on add (a CE: its Reservation)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for no limit), got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        # The serving thread tokenizes with its own copy: the loop thread detokenizes with the
        # engine's, and a Rust tokenizer must not be used from two threads at once.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._waiters: dict[str, _Waiter] = {}
        self._num_unapplied_adds = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._num_steps = 0
        self._stats = self._take_stats()

    # --- what the server reads -------------------------------------------------------------------
    @property
    def role(self) -> EngineType:
        return self.engine.engine_type

    @property
    def scheduler_config(self):
        return self.engine.scheduler_config

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        """Waiting in the scheduler plus adds the loop thread has not applied yet."""
        return self._stats.num_waiting + self._num_unapplied_adds

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pdinfer-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()

    # --- requests --------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams, **extra) -> RequestStream:
        """Add a request and return its output stream once the engine accepted it.

        A ``ValueError`` from ``LLMEngine.add_request`` is raised here, as is
        ``EngineOverloadedError`` (``max_waiting`` reached) and ``EngineDeadError``.
        """
        if not self.is_healthy:
            raise EngineDeadError(self._dead_message())
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(
                f"the engine has {self.num_waiting()} requests waiting (limit {self.max_waiting}); retry later"
            )
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDeadError(self._dead_message())
            if request_id in self._waiters:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._waiters[request_id] = waiter
            self._commands.append(("add", request_id, prompt, params, extra))
            self._num_unapplied_adds += 1
            self._cond.notify()
        try:
            ack = await waiter.queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(ack, BaseException):
            raise ack
        return RequestStream(self, request_id, waiter.queue, accepted=ack[1])

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; stopping the iteration early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify()

    # --- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._num_steps += 1
                    self._stats = self._take_stats()
                    self._dispatch(outputs)
                    if not outputs and not self.engine.last_step_ran:
                        self._nap()  # waiting on a peer (K/V, an ack): poll, don't spin
        except BaseException as exc:  # the engine is in an unknown state: fail loudly, stay down
            logger.exception("the engine loop died")
            with self._cond:
                self.error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))
            return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _nap(self) -> None:
        with self._cond:
            if not (self._commands or self._stopping):
                self._cond.wait(_IDLE_POLL_S)

    def _wait_for_work(self) -> list[tuple[Any, ...]] | None:
        with self._cond:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, commands: list[tuple[Any, ...]]) -> None:
        num_adds = 0
        for command in commands:
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                continue
            _, request_id, prompt, params, extra = command
            num_adds += 1
            try:
                accepted = self._add(request_id, prompt, params, extra)
            except (ValueError, TypeError) as exc:  # bad input: that request fails, not the loop
                self._send(request_id, ValueError(str(exc)), last=True)
            except _REFUSALS as exc:  # no room (CE), handshake refused (PE): the caller decides
                self._send(request_id, exc, last=True)
            else:
                self._send(request_id, (_ADDED, accepted), last=False)
        if num_adds:
            # Snapshot before the unapplied count drops, so num_waiting() never dips below truth.
            self._stats = self._take_stats()
            with self._cond:
                self._num_unapplied_adds -= num_adds

    def _add(self, request_id: str, prompt, params: SamplingParams, extra: dict):
        """NORMAL and PROMPT engines add the request; a CE reserves blocks for it first."""
        if self.engine.engine_type is EngineType.COMPLETION and hasattr(self.engine, "reserve"):
            return self.engine.reserve(request_id, prompt, params, **extra)
        return self.engine.add_request(request_id, prompt, params, **extra)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output, last=output.finished)

    def _send(self, request_id: str, item, last: bool) -> None:
        with self._cond:
            waiter = self._waiters.pop(request_id, None) if last else self._waiters.get(request_id)
        if waiter is None:
            return
        try:
            waiter.loop.call_soon_threadsafe(waiter.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            with self._cond:
                self._waiters.pop(request_id, None)
            if not last:
                self.engine.abort_request(request_id)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cond:
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            try:
                waiter.loop.call_soon_threadsafe(waiter.queue.put_nowait, EngineDeadError(str(error)))
            except RuntimeError:
                pass

    def _take_stats(self) -> EngineStats:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        handoffs = getattr(self.engine, "handoff_stats", None) or {}
        return EngineStats(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_prompted=len(scheduler.prompted),
            num_requests=len(self.engine.requests),
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_total_blocks,
            num_prefix_hit_tokens=blocks.num_prefix_hits,
            num_prefix_query_tokens=blocks.num_prefix_queries,
            num_preemptions=scheduler.num_preemptions,
            num_aborted=self.engine.num_aborted,
            num_steps=self._num_steps,
            num_handoffs=handoffs.get("count", 0),
            handoff_bytes=handoffs.get("bytes", 0),
            handoff_seconds=handoffs.get("seconds", 0.0),
            num_handoffs_failed=handoffs.get("failed", 0),
        )

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"the engine loop died: {self.error!r}"
        if self._thread is None:
            return "the engine loop is not started"
        return "the engine is shut down"
