"""``MPEngineClient``: an engine core (``engine/core``) in a process of its own, driven over ZeroMQ.

``start_engine_core`` spawns the core and waits until it answers; then each API-server process
makes an ``MPEngineClient`` on that address (``--api-server-count N``: N clients of one core).
The client's reader task takes the core's messages on the event loop: answers to adds, and per
step the new tokens of its requests, which go to their ``RequestStream``s (detokenized there).

A core that dies is noticed at once: a watcher checks its process every ``_WATCH_S``; then
``is_healthy`` is False, ``/health`` answers 503 and every open request ends with
``EngineDeadError``. A core that fails in its loop says so first (``CoreFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from pdinfer import env
from pdinfer.engine.client import EngineClient, EngineDeadError, EngineLimits
from pdinfer.engine.core import CoreConfig, refusal_error
from pdinfer.engine.core_messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    CoreFailed,
    Drain,
    Drained,
    Hello,
    Ready,
    Refused,
    Shutdown,
    StepOutputs,
    StopSeqs,
    decode_to_client,
    encode,
)
from pdinfer.engine_type import EngineType
from pdinfer.sampling_params import SamplingParams

logger = logging.getLogger("pdinfer")

_WATCH_S = 0.05


def pid_alive(pid: int) -> bool:
    """False once ``pid`` exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


@dataclass
class CoreProcess:
    """An engine core this process started (``start_engine_core``)."""

    process: subprocess.Popen
    address: str
    ready: Ready
    socket_dir: str

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the core to stop (it finishes its KV-store writes), then make sure it did."""
        if self.process.poll() is None:
            socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self.address)
            socket.send(encode(Shutdown()))
            socket.close()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_engine_core(engine_args, startup_timeout_s: float = 1800.0) -> CoreProcess:
    """Spawn the engine core of ``engine_args`` and wait until it is ready to serve."""
    from pdinfer.distributed.messages import engine_args_to_dict

    socket_dir = tempfile.mkdtemp(prefix="pdinfer-core-")  # 0700: only this user may connect
    address = f"ipc://{socket_dir}/core.sock"
    cfg = CoreConfig(engine_args_to_dict(engine_args), address, os.getpid())
    process = subprocess.Popen(
        [sys.executable, "-m", "pdinfer.engine.core"], stdin=subprocess.PIPE, env=env.child_environ()
    )
    assert process.stdin is not None
    process.stdin.write(msgspec.json.encode(cfg))
    process.stdin.close()
    try:
        ready = _wait_ready(process, address, startup_timeout_s)
    except BaseException:
        process.kill()
        process.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    return CoreProcess(process, address, ready, socket_dir)


def _wait_ready(process: subprocess.Popen, address: str, timeout_s: float) -> Ready:
    socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        socket.send(encode(Hello()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EngineDeadError(f"the engine core exited with code {process.returncode} while starting")
            if socket.poll(200):
                message = decode_to_client(socket.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, CoreFailed):
                    raise EngineDeadError(message.error)
        raise TimeoutError(f"the engine core was not ready within {timeout_s:.0f} s")
    finally:
        socket.close()


class MPEngineClient(EngineClient):
    def __init__(self, address: str, ready: Ready, max_waiting: int | None = None, tokenizer=None):
        from pdinfer.models.loader import load_tokenizer

        if tokenizer is None:
            tokenizer = load_tokenizer(ready.model_folder, ready.tokenizer)
        super().__init__(tokenizer, max_waiting)
        self.address = address
        self.ready = ready
        self.role = EngineType.from_int(ready.engine_type)
        self.limits = EngineLimits(ready.max_model_len, ready.prompt_limit, ready.vocab_size)
        self.kv_address = ready.kv_address
        self._socket: zmq.asyncio.Socket | None = None
        self._answers: dict[str, asyncio.Future] = {}
        self._drains: deque[asyncio.Future] = deque()  # the core answers drains in order
        self._tasks: list[asyncio.Task] = []

    @property
    def is_healthy(self) -> bool:
        return self._socket is not None and self.error is None

    # --- lifecycle -------------------------------------------------------------------------------
    async def attach(self) -> None:
        if self._socket is not None:
            return
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        self._socket = socket
        self._send(Hello())
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    async def detach(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._socket is not None:
            self._socket.close()

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        """The core's owner stops it (``CoreProcess.stop``); a client only lets go."""
        self.error = self.error or EngineDeadError("the engine was shut down")

    # --- transport -------------------------------------------------------------------------------
    async def _submit(self, request_id: str, text, token_ids, params: SamplingParams, extra: dict):
        from pdinfer.distributed.messages import params_to_dict

        reservation, resume = extra.pop("reservation", None), extra.pop("resume", None)
        if extra:
            raise ValueError(f"unknown request options: {sorted(extra)}")
        try:
            payload = encode(AddRequest(request_id, text, token_ids, params_to_dict(params), reservation, resume))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # a stranger's numbers
            raise ValueError(f"the request cannot be encoded: {exc}") from None
        answer = asyncio.get_running_loop().create_future()
        self._answers[request_id] = answer
        try:
            self._send_bytes(payload)
            return await answer
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        finally:
            self._answers.pop(request_id, None)

    async def drain(self) -> int:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message())
        answer = asyncio.get_running_loop().create_future()
        self._drains.append(answer)
        self._draining = True
        self._send(Drain())
        return await answer

    def abort(self, request_id: str) -> None:
        if self._socket is not None and self.error is None:
            self._send(AbortRequests([request_id]))

    def stop_seqs(self, items: list[tuple[str, int]]) -> None:
        if self._socket is not None and self.error is None:
            self._send(StopSeqs(items))

    def _send(self, message) -> None:
        self._send_bytes(encode(message))

    def _send_bytes(self, payload: bytes) -> None:
        assert self._socket is not None
        self._socket.send(payload, flags=zmq.NOBLOCK)

    # --- the reader and the watcher (tasks on the event loop) -------------------------------------
    async def _read(self) -> None:
        assert self._socket is not None
        while True:
            message = decode_to_client(await self._socket.recv())
            if isinstance(message, StepOutputs):
                self._stats = message.stats
                if message.deltas:
                    self._deliver(message.deltas)
            elif isinstance(message, Accepted):
                self._settle(message.request_id, message.reservation)
            elif isinstance(message, Refused):
                self._settle(message.request_id, refusal_error(message.kind, message.message))
            elif isinstance(message, Drained) and self._drains:
                answer = self._drains.popleft()
                if not answer.done():
                    answer.set_result(message.num_migrated)
            elif isinstance(message, CoreFailed):
                self._die(EngineDeadError(message.error))
                return

    async def _watch(self) -> None:
        while pid_alive(self.ready.pid):
            await asyncio.sleep(_WATCH_S)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(_WATCH_S)  # a CoreFailed it sent before exiting goes first
        self._die(EngineDeadError(f"the engine core (pid {self.ready.pid}) exited"))

    def _settle(self, request_id: str, value) -> None:
        answer = self._answers.pop(request_id, None)
        if answer is None or answer.done():
            return
        if isinstance(value, BaseException):
            answer.set_exception(value)
        else:
            answer.set_result(value)

    def _die(self, error: EngineDeadError) -> None:
        if self.error is not None:
            return
        logger.error("%s", error)
        self.error = error
        answers, self._answers = self._answers, {}
        drains, self._drains = self._drains, deque()
        for answer in [*answers.values(), *drains]:
            if not answer.done():
                answer.set_exception(EngineDeadError(str(error)))
        self._fail_all(error)
