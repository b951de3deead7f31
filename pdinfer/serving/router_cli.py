"""``pdinfer router``'s flags and entry point (kept apart from ``router`` so that the ``pdinfer``
command starts without importing the web stack)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from pdinfer.cli_args import parse_size, positive_int, served_model_name
from pdinfer.serving.serve_cli import DEFAULT_MAX_BODY_BYTES


def add_router_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "router",
        help="the P/D front door: an OpenAI API that picks a PE and a CE per request",
        description="Tokenizes requests and drives the prefill -> decode hand-off over the "
        "engines' /pd endpoints; short prompts may go to NORMAL engines.",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="prefill engines (pdinfer serve --role prompt)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="completion engines (pdinfer serve --role completion)",
    )
    p.add_argument(
        "--normal",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="NORMAL engines (pdinfer serve) for short prompts",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        default=None,
        help="the engines' model, for its tokenizer and name (default: the embedded "
        "SmolLM2-135M-Instruct); no weights are loaded",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer source (default: the model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/* (default: PDINFER_API_KEY, else none); "
        "the key the router sends its engines is PDINFER_ENGINE_API_KEY",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require the API key on /metrics and /debug/* too (/health stays open)",
    )
    p.add_argument(
        "--normal-max-prompt-tokens",
        type=int,
        default=256,
        help="with --normal: requests whose prompts total at most this many tokens go to a NORMAL engine",
    )
    p.add_argument(
        "--prefix-tolerance-tokens",
        type=int,
        default=2048,
        help="prefer the PE holding the longest cached prefix while its queued prompt "
        "tokens exceed the least loaded PE's by at most this many",
    )
    p.add_argument(
        "--max-attempts",
        type=positive_int,
        default=3,
        help="attempts per request on different engines, before its client saw a token (a whole answer: before it finished)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=60.0,
        help="a request waiting for room (every CE full, or its PE's queue) gets a 503 once it waited this long and, this long, no CE took a request or ran a step",
    )
    p.add_argument(
        "--engine-timeout-s", type=float, default=600.0, help="read timeout of the router's calls to an engine"
    )
    p.add_argument("--health-interval-s", type=float, default=1.0)
    p.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 (default 8MiB)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="router processes sharing the port (each balances its own share of the requests, "
        "with its own health checks); more than one when one core cannot relay every token",
    )
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # a worker's inherited socket
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # the router that started it
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from pdinfer import env
    from pdinfer.models.loader import load_tokenizer, resolve_model
    from pdinfer.serving.api_process import listening_socket, serve_on, stop_api_servers
    from pdinfer.serving.router import Router, RouterConfig, build_router_app

    # A worker ends with the router that started it, also one that died while it started.
    if args.listen_fd is not None and not env.die_with_parent(signal.SIGTERM, args.parent_pid):
        return 0
    try:
        config = RouterConfig(
            prefill_urls=[u.rstrip("/") for u in args.prefill],
            decode_urls=[u.rstrip("/") for u in args.decode],
            normal_urls=[u.rstrip("/") for u in args.normal],
            api_key=args.api_key or env.get("PDINFER_API_KEY") or None,
            engine_api_key=env.get("PDINFER_ENGINE_API_KEY") or None,
            protect_metrics=args.protect_metrics,
            normal_max_prompt_tokens=args.normal_max_prompt_tokens,
            prefix_tolerance_tokens=args.prefix_tolerance_tokens,
            max_attempts=args.max_attempts,
            queue_timeout_s=args.queue_timeout_s,
            engine_timeout_s=args.engine_timeout_s,
            health_interval_s=args.health_interval_s,
        )
        folder, hf_config = resolve_model(args.model, env.get("PDINFER_CACHE_DIR"))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdinfer router: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(folder, args.tokenizer)
    name = args.served_model_name or served_model_name(args.model)
    router = Router(config, name, tokenizer, hf_config.get("vocab_size"), hf_config.get("max_position_embeddings"))
    app = build_router_app(router, args.max_body_bytes)
    if args.listen_fd is not None:  # a worker: its parent bound the socket and announced it
        serve_on(app, socket.socket(fileno=args.listen_fd))
        return 0
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        print(f"pdinfer router: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    workers = _start_workers(sock, args.workers)
    print(
        f"pdinfer router: {name} on http://{args.host}:{args.port} ({len(config.prefill_urls)} "
        f"prefill, {len(config.decode_urls)} decode, {len(config.normal_urls)} normal"
        + (f"; {args.workers} workers" if args.workers > 1 else "")
        + ")",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve_on(app, sock)
    finally:
        stop_api_servers(workers)
    return 0


def _start_workers(sock: socket.socket, count: int) -> list[subprocess.Popen]:
    """Workers 1 .. count-1 (this process is worker 0): the same command on the shared socket."""
    from pdinfer import env

    argv = [a for a in sys.argv[1:]]
    return [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "pdinfer.cli", *argv),
                *("--workers", "1", "--listen-fd", str(sock.fileno()), "--parent-pid", str(os.getpid())),
            ],
            pass_fds=(sock.fileno(),),
            env=env.child_environ(),
        )
        for _ in range(1, count)
    ]
