"""``InProcessEngineClient``: one engine stepped on a background thread of this process.

For unit tests and for embedding an engine in an asyncio program. (``pdinfer serve`` runs the
engine in a process of its own, ``mp_client``: a step loop sharing the interpreter with HTTP
work loses its throughput to the GIL.) The engine is not thread-safe, so only the loop thread
calls into it: callers queue commands (add, abort, stop, drain) that it applies between steps; each
step's deltas go to the asyncio loop(s) of their streams in one ``call_soon_threadsafe``. With
nothing to do the thread sleeps on a condition variable; it never spins.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict, deque
from typing import Any

from pdinfer.engine.client import EngineClient, EngineDeadError, EngineLimits
from pdinfer.engine.core import refusal_kind
from pdinfer.engine.core_messages import take_stats
from pdinfer.engine_type import EngineType
from pdinfer.outputs import RequestDelta
from pdinfer.sampling_params import SamplingParams

logger = logging.getLogger("pdinfer")

_IDLE_POLL_S = 0.002


class InProcessEngineClient(EngineClient):
    def __init__(self, engine, max_waiting: int | None = None):
        super().__init__(engine.tokenizer, max_waiting)
        self.engine = engine
        self.role: EngineType = engine.engine_type
        sc = engine.scheduler_config
        self.limits = EngineLimits(sc.max_model_len, sc.prompt_limit, engine.spec.vocab_size)
        self._cond = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # request id -> its stream's loop
        self._answers: dict[str, asyncio.Future] = {}  # adds the loop thread has not answered
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._num_steps = 0
        self._stats = take_stats(engine, 0)

    @property
    def scheduler_config(self):
        return self.engine.scheduler_config

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

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

    # --- transport -------------------------------------------------------------------------------
    async def _submit(self, request_id: str, text, token_ids, params: SamplingParams, extra: dict):
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDeadError(self.dead_message())
            self._loops[request_id] = loop
            self._answers[request_id] = answer
            prompt = {"prompt": text, "prompt_token_ids": token_ids}
            self._commands.append(("add", request_id, prompt, params, extra))
            self._cond.notify()
        try:
            return await answer
        except BaseException:
            self.abort(request_id)
            raise

    async def drain(self) -> int:
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDeadError(self.dead_message())
            self._draining = True
            self._commands.append(("drain", answer))
            self._cond.notify()
        return await answer

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""
        self._command(("abort", request_id))

    def stop_seqs(self, items: list[tuple[str, int]]) -> None:
        self._command(("stop", items))

    def _command(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def dead_message(self) -> str:
        if self.error is not None:
            return f"the engine loop died: {self.error!r}"
        if self._thread is None:
            return "the engine loop is not started"
        return "the engine is shut down"

    # --- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                self._apply(commands)
                if engine.has_unfinished_requests():
                    deltas = engine.step_deltas()
                    self._num_steps += 1
                    self._stats = take_stats(engine, self._num_steps)
                    self._dispatch(deltas)
                    if not deltas and not engine.last_step_ran:
                        self._nap()  # waiting on a peer (K/V, an ack): poll, don't spin
        except BaseException as exc:  # the engine is in an unknown state: fail loudly, stay down
            logger.exception("the engine loop died")
            with self._cond:
                self.error = exc
            self._fail_everywhere(EngineDeadError(f"the engine loop died: {exc!r}"))
            return
        self._fail_everywhere(EngineDeadError("the engine was shut down"))

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
        engine = self.engine
        for command in commands:
            kind = command[0]
            if kind == "abort":
                engine.abort_request(command[1])
            elif kind == "stop":
                for request_id, index in command[1]:
                    engine.stop_seq(request_id, index)
            elif kind == "drain":
                _settle_from_thread(command[1], engine.drain())
            else:
                _, request_id, prompt, params, extra = command
                self._add(request_id, prompt, params, extra)
        if commands:
            self._stats = take_stats(engine, self._num_steps)

    def _add(self, request_id, prompt, params, extra) -> None:
        try:
            result = self.engine.admit(request_id, prompt, params, **extra)
        except Exception as exc:
            kind = refusal_kind(exc)
            if kind is None:
                raise
            self._resolve(request_id, exc if kind != "invalid" else ValueError(str(exc)))
            with self._cond:
                self._loops.pop(request_id, None)
            return
        self._resolve(request_id, result)

    def _resolve(self, request_id: str, value) -> None:
        with self._cond:
            answer = self._answers.pop(request_id, None)
        if answer is not None and not _settle_from_thread(answer, value):
            self.engine.abort_request(request_id)  # nobody is listening any more

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestDelta]] = defaultdict(list)
        loops = self._loops
        with self._cond:
            for delta in deltas:
                loop = loops.get(delta.request_id)
                if loop is not None:
                    by_loop[loop].append(delta)
                    if delta.finished:
                        del loops[delta.request_id]
        for loop, owned in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, owned)
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                for delta in owned:
                    if not delta.finished:
                        self.engine.abort_request(delta.request_id)

    def _fail_everywhere(self, error: EngineDeadError) -> None:
        with self._cond:
            self._loops.clear()
            pending = list(self._answers)
            drains = [command[1] for command in self._commands if command[0] == "drain"]
        for request_id in pending:
            self._resolve(request_id, error)
        for answer in drains:
            _settle_from_thread(answer, error)
        self._fail_all(error)


def _settle_from_thread(answer: asyncio.Future, value) -> bool:
    """Settle ``answer`` (a result, or an exception to raise) on its event loop, from the loop
    thread; False if that event loop is closed."""

    def settle() -> None:
        if answer.done():  # the caller went away meanwhile (an add's abort is queued)
            return
        if isinstance(value, BaseException):
            answer.set_exception(value)
        else:
            answer.set_result(value)

    try:
        answer.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        return False
    return True
