"""API-server processes: the OpenAI HTTP app over an engine core, one or several per core.

``pdinfer serve`` binds the listening socket, starts the engine core and runs API server 0
itself; with ``--api-server-count N`` it starts N - 1 more of these processes, each accepting on
the same socket (inherited) and each a client of the same core. JSON, SSE and detokenization
then spread over N interpreters while the core's step loop keeps one of its own.

SIGTERM with ``--drain-timeout-s``: only ``serve``'s own process, the core's owner, drains the
core (one ``Drain``, whoever else got the signal), still answering meanwhile; then it stops
these processes and the core as before. One of these that gets the signal (a SIGTERM to the
whole group) stops accepting and gives its open responses as long to end: the drain ends them.

    python -m pdinfer.serving.api_process   (an ``APIServerConfig`` as JSON on stdin; the
                                             API key stays off argv)
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import msgspec
import uvicorn

from pdinfer import env
from pdinfer.engine.core_messages import Ready

logger = logging.getLogger("pdinfer")


class APIServerConfig(msgspec.Struct):
    core_address: str
    ready: Ready
    served_model_name: str
    api_key: str | None
    max_waiting: int | None
    max_body_bytes: int
    protect_metrics: bool
    listen_fd: int
    parent_pid: int
    index: int  # 1 .. N-1 (0 is ``serve``'s own process)
    drain_timeout_s: float = 0.0  # how long open responses may take to end after a SIGTERM


def listening_socket(host: str, port: int) -> socket.socket:
    """The server socket every API-server process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_on(
    app,
    sock: socket.socket,
    before_stop: Callable[[], Awaitable[object]] | None = None,
    grace_s: float | None = None,
) -> None:
    """Run the app's uvicorn server on an already bound socket. SIGTERM stops it as Ctrl-C does,
    and then ends the process through the callers' ``finally`` blocks (the engine core stopped,
    its socket folder removed): uvicorn raises the signal it caught again once it has stopped,
    and the default action of SIGTERM would end the process on the spot.

    ``before_stop``: what a SIGTERM runs first, while the server still answers (``serve`` drains
    its engine); a second SIGTERM, or Ctrl-C, stops at once. ``grace_s``: how long responses
    still open when the server stops may take to end (uvicorn's default: 5 s)."""
    from pdinfer.serving.frontend import http_server

    host, port = sock.getsockname()[:2]
    server = http_server(app, host, port)
    if grace_s is not None:
        server.config.timeout_graceful_shutdown = max(server.config.timeout_graceful_shutdown or 0, math.ceil(grace_s))
    if before_stop is not None:
        server = _StopsAfter(server.config, before_stop)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


class _StopsAfter(uvicorn.Server):
    """A uvicorn server whose first SIGTERM runs ``before_stop`` on its event loop, then stops it."""

    def __init__(self, config: uvicorn.Config, before_stop: Callable[[], Awaitable[object]]):
        super().__init__(config)
        self.before_stop = before_stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._signalled or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._run_before_stop)  # not from inside a signal handler

    def _run_before_stop(self) -> None:
        self._task = asyncio.ensure_future(self.before_stop())
        self._task.add_done_callback(self._stop)

    def _stop(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("before stopping: %r", task.exception())
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._task is not None:  # a second signal stops it at once
            self._task.cancel()
        await super().shutdown(sockets)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def start_api_servers(cfg: APIServerConfig, count: int) -> list[subprocess.Popen]:
    """API servers 1 .. count-1 (the caller runs number 0)."""
    procs = []
    for index in range(1, count):
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdinfer.serving.api_process"],
            stdin=subprocess.PIPE,
            pass_fds=(cfg.listen_fd,),
            env=env.child_environ(),
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(msgspec.structs.replace(cfg, index=index)))
        proc.stdin.close()
        procs.append(proc)
    return procs


def stop_api_servers(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=APIServerConfig)
    if not env.die_with_parent(signal.SIGTERM, cfg.parent_pid):
        return 1
    import pdinfer  # noqa: F401  (sets up the pdinfer logger)
    from pdinfer.engine.mp_client import MPEngineClient
    from pdinfer.serving.api_server import build_app

    for handler in logger.handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s pdinfer[api{cfg.index}]: %(message)s"))
    client = MPEngineClient(cfg.core_address, cfg.ready, max_waiting=cfg.max_waiting)
    app = build_app(client, cfg.served_model_name, cfg.api_key, cfg.max_body_bytes, cfg.protect_metrics)
    serve_on(app, socket.socket(fileno=cfg.listen_fd), grace_s=cfg.drain_timeout_s or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
