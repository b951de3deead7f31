"""``pdinfer launch``: a whole local P/D cluster in one command.

Starts ``--prefill N`` PROMPT engines, ``--decode M`` COMPLETION engines and ``--normal K`` NORMAL
engines (``pdinfer serve --role ...`` on free local ports, each with the engine flags given here;
on a host with several GPUs, one GPU per engine in turn, see ``engine_devices``). Each PE or CE
may be a DP group with expert parallelism, of sizes of its own (``--prefill-dp/--prefill-ep``,
``--decode-dp/--decode-ep``: small EP on prefill, wide EP on decode);
then ``pdinfer router`` in front of them; waits until the router sees every engine healthy and
prints the URL. Each child runs in its own process group (and, on Linux, gets SIGTERM if this
process dies). Ctrl-C or SIGTERM stops them all: SIGTERM to each group, SIGKILL to what is left
after ``_STOP_GRACE_S``. A child that dies during startup stops the rest: exit 1 with its log tail.

The engines share one KV secret (``--kv-secret``, else a random one per cluster), handed to them
in their environment (``PDINFER_KV_SECRET``), never on a command line ``ps`` shows: without it
nobody else can shake hands with a CE's KV port. Likewise every engine requires a random
per-cluster API key on /v1/* and /pd/* (``PDINFER_API_KEY``), which only the router is given
(``PDINFER_ENGINE_API_KEY``): a client reaches the engines through the router, which requires
the user's key when one is given (``--api-key``, else ``PDINFER_API_KEY`` as with ``serve``; also
handed over in the environment).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdinfer import env
from pdinfer.cli_args import add_engine_args, positive_int
from pdinfer.kv_transfer.cli_args import add_kv_transfer_args

_STOP_GRACE_S = 15.0
_POLL_S = 0.3
_LOG_TAIL_LINES = 40


class _Stop(Exception):
    """Ctrl-C or SIGTERM."""


@dataclass
class Child:
    name: str
    cmd: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of launch's own environment
    proc: subprocess.Popen | None = None

    @property
    def process(self) -> subprocess.Popen:
        """The process ``start_child`` started."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def add_launch_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start a local P/D cluster (engines + router) and print its URL",
        description="Engine flags apply to every engine. Without --num-threads, the CPU cores "
        "are divided among the engines.",
    )
    p.add_argument("--prefill", type=int, default=1, help="PROMPT engines")
    p.add_argument("--decode", type=int, default=1, help="COMPLETION engines")
    p.add_argument("--normal", type=int, default=0, help="NORMAL engines (short prompts)")
    for role, what in (("prefill", "PROMPT"), ("decode", "COMPLETION")):
        p.add_argument(
            f"--{role}-dp",
            type=positive_int,
            default=None,
            help=f"each {what} engine is a DP group of this many ranks behind one front "
            "(default: --data-parallel-size)",
        )
        p.add_argument(
            f"--{role}-ep",
            type=positive_int,
            default=None,
            help=f"expert-parallel size of each {what} engine's group, dividing its DP size "
            "(default: --expert-parallel-size); PEs and CEs may differ",
        )
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument(
        "--api-key",
        default=None,
        help="the router requires it on /v1/* (default: PDINFER_API_KEY, else none; the engines get a random key of their own)",
    )
    p.add_argument("--log-dir", default=None, help="children's logs (default: a new temp dir)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the router, e.g. --router-arg=--normal-max-prompt-tokens=128",
    )
    add_engine_args(p)
    add_kv_transfer_args(p)
    p.set_defaults(func=run_launch)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine and K/V flags that differ from their defaults, as command-line text."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    add_kv_transfer_args(parser)
    flags: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in ("kv_port", "kv_secret") or value == action.default:
            continue  # (each CE picks its own K/V port; the secret goes in the environment)
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(option if value else "--no-" + option[2:])
        elif action.nargs == 0:
            flags.append(option)
        else:
            flags += [option, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_devices(device: str, num_engines: int, num_gpus: int | None = None) -> list[str | None]:
    """With several GPUs visible and ``--device`` auto or cuda, engine k runs on GPU k mod the
    count (PE 0 on cuda:0, CE 0 on cuda:1 for ``--prefill 1 --decode 1`` on two GPUs); every
    process still sees every GPU, as the device KV transports need. Otherwise None: the flag as
    given."""
    if device not in ("auto", "cuda"):
        return [None] * num_engines
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count()  # 0 without CUDA
    if num_gpus < 2:
        return [None] * num_engines
    return [f"cuda:{k % num_gpus}" for k in range(num_engines)]


def role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """``args`` with the role's own DP and EP sizes (``--prefill-dp`` and the like) in place of
    the shared ``--data-parallel-size`` and ``--expert-parallel-size``."""
    side = {"prompt": "prefill", "completion": "decode"}.get(role)
    values = dict(vars(args))
    for suffix, dest in (("dp", "data_parallel_size"), ("ep", "expert_parallel_size")):
        own = getattr(args, f"{side}_{suffix}", None) if side else None
        if own is not None:
            values[dest] = own
    return argparse.Namespace(**values)


def _children(args: argparse.Namespace, log_dir: Path) -> list[Child]:
    pdinfer = [sys.executable, "-m", "pdinfer.cli"]
    roles = (("prompt", args.prefill), ("completion", args.decode), ("normal", args.normal))
    num_engines = args.prefill + args.decode + args.normal
    # engines on one machine share its cores: each rank of a DP group is a process of its own
    num_ranks = sum(count * role_args(args, role).data_parallel_size for role, count in roles)
    threads = ["--num-threads", str(max(1, (os.cpu_count() or 1) // num_ranks))] if args.num_threads is None else []
    devices = engine_devices(args.device, num_engines)
    engine_key = secrets.token_hex(32)  # the engines' API key: only the router knows it
    kv_env = {"PDINFER_KV_SECRET": args.kv_secret or secrets.token_hex(32), "PDINFER_API_KEY": engine_key}
    children: list[Child] = []
    for role, count in roles:
        flags = engine_flags(role_args(args, role)) + threads
        for i in range(count):
            port = free_port()
            cmd = [*pdinfer, "serve", "--role", role, "--host", "127.0.0.1", "--port", str(port), *flags]
            cmd += ["--drain-timeout-s", "0"]  # launch stops the whole cluster: nowhere to migrate to
            device = devices[len(children)]
            if device is not None:
                cmd += ["--device", device]
            log_path = log_dir / f"{role}-{i}.log"
            children.append(Child(f"{role}-{i}", cmd, f"http://127.0.0.1:{port}", log_path, env=dict(kv_env)))
    router = [*pdinfer, "router", "--host", args.host, "--port", str(args.port)]
    for role, flag in (("prompt", "--prefill"), ("completion", "--decode"), ("normal", "--normal")):
        urls = [c.url for c in children if c.name.startswith(role)]
        if urls:
            router += [flag, *urls]
    for name in ("model", "tokenizer"):
        if getattr(args, name) is not None:
            router += ["--" + name.replace("_", "-"), getattr(args, name)]
    router += args.router_arg
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    client_key = args.api_key or env.get("PDINFER_API_KEY")  # the user's key, for the router alone
    router_env = {"PDINFER_ENGINE_API_KEY": engine_key, "PDINFER_API_KEY": client_key}
    children.append(Child("router", router, f"http://{host}:{args.port}", log_dir / "router.log", env=router_env))
    return children


def terminate_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGTERM when the process that started it dies."""
    env.set_parent_death_signal(signal.SIGTERM)


def start_child(child: Child) -> None:
    with open(child.log_path, "ab") as log:
        child.proc = subprocess.Popen(
            child.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=terminate_with_parent,
            env=env.child_environ(child.env),
        )


def _healthy(child: Child) -> bool:
    import httpx

    try:
        if httpx.get(f"{child.url}/health", timeout=2).status_code != 200:
            return False
        if child.name != "router":
            return True
        key = child.env.get("PDINFER_API_KEY")  # the router's /debug may require it
        headers = {"Authorization": f"Bearer {key}"} if key else None
        engines = httpx.get(f"{child.url}/debug/engines", timeout=2, headers=headers).json()
        return all(e["healthy"] for e in engines)
    except (httpx.HTTPError, ValueError):
        return False


def wait_healthy(children: list[Child], timeout_s: float) -> Child | None:
    """None once all are healthy; else the child that died (or the first still unhealthy)."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.process.poll() is not None:
                return child
            if _healthy(child):
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            return pending[0]
        time.sleep(_POLL_S)
    return None


def stop_all(children: list[Child], grace_s: float = _STOP_GRACE_S) -> None:
    started = [c for c in children if c.proc is not None]
    for child in started:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in started:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in started:  # whatever is left, the leaders' own children included
        _signal_group(child, signal.SIGKILL)
        child.process.wait()


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _on_signal(signum, frame) -> None:
    raise _Stop()


def run_launch(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 0 or args.normal < 0:
        print("pdinfer launch: engine counts must be >= 0", file=sys.stderr)
        return 2
    if (args.prefill == 0) != (args.decode == 0) or args.prefill + args.normal == 0:
        print("pdinfer launch: needs --prefill and --decode engines (both), or --normal ones", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdinfer-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    children = _children(args, log_dir)
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(children, args, log_dir)
    except _Stop:
        print("pdinfer launch: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig in previous:
            signal.signal(sig, lambda *_: None)  # a second Ctrl-C must not cut the cleanup short
        stop_all(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(children: list[Child], args: argparse.Namespace, log_dir: Path) -> int:
    engines, router = children[:-1], children[-1]
    for child in engines:
        start_child(child)
    failed = wait_healthy(engines, args.startup_timeout_s)
    if failed is None:
        start_child(router)
        failed = wait_healthy([router], args.startup_timeout_s)
    if failed is not None:
        state = (
            f"exited with {failed.process.returncode}"
            if failed.process.poll() is not None
            else "did not become healthy"
        )
        print(
            f"pdinfer launch: {failed.name} {state}; its log ({failed.log_path}):\n{failed.log_tail()}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(f"pdinfer launch: {router.url}/v1 is ready", flush=True)
    for child in children:
        print(f"  {child.name:<13} {child.url}  pid {child.process.pid}  log {child.log_path}", flush=True)
    print("Ctrl-C stops the cluster.", flush=True)
    return _watch(engines, router)


def _watch(engines: list[Child], router: Child) -> int:
    reported: set[str] = set()
    while True:
        if router.process.poll() is not None:
            print(
                f"pdinfer launch: the router exited with {router.process.returncode}:\n{router.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        for child in engines:
            if child.process.poll() is not None and child.name not in reported:
                reported.add(child.name)  # the router ejects it; the rest keeps serving
                print(
                    f"pdinfer launch: {child.name} exited with {child.process.returncode} (log {child.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
        time.sleep(_POLL_S)
