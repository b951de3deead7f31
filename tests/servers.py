"""Start real ``pdinfer`` processes for tests and stop them cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdinfer.env import child_environ
from pdinfer.serving.launch import terminate_with_parent

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdinfer_command() -> list[str]:
    script = Path(sys.executable).with_name("pdinfer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdinfer.cli"]


class Server:
    """One ``pdinfer serve`` (or other subcommand) process listening on a local port, or with
    ``netns`` on ``host`` in that network namespace (tests/netns.py)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.args, self.log_path = args + (["--host", host] if host != "127.0.0.1" else []), log_path
        self.prefix = ["ip", "netns", "exec", netns] if netns else []
        self.env = child_environ({"PDINFER_LOG_LEVEL": "WARNING", **(env or {})})
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Server:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.prefix + pdinfer_command() + self.args + ["--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=terminate_with_parent,  # a killed test run leaves no server behind
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.args[0]} did not become healthy:\n{self.log()}")
            time.sleep(0.3)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def kv(self) -> dict:
        return httpx.get(f"{self.url}/debug/kv", timeout=10).json()

    def wait_blocks_back(self, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            kv = self.kv()
            if kv["free_blocks"] == kv["total_blocks"] or time.monotonic() > deadline:
                return kv
            time.sleep(0.2)


def wait_for(condition, what: str, timeout_s: float = 120, interval_s: float = 0.2) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(interval_s)
