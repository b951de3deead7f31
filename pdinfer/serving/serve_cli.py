"""``pdinfer serve``'s flags and entry point: one engine of a role (or a DP group) behind the
OpenAI-compatible HTTP API. The web stack and the engine are imported only when it runs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

from pdinfer.cli_args import (
    add_engine_args,
    engine_args_from,
    non_negative_seconds,
    parse_size,
    positive_int,
    served_model_name,
)
from pdinfer.distributed.cli_args import add_dp_args
from pdinfer.engine_type import EngineType
from pdinfer.kv_transfer.cli_args import add_kv_transfer_args, kv_transfer_from

logger = logging.getLogger("pdinfer")

# A served engine's requests arrive one at a time; 70 decode steps between prefill attempts (the
# DP vote's default, made for groups) kept each new arrival waiting up to 70 steps, and `serve`
# fell far behind the offline rate; a short interval closes most of the gap
# (docs/performance.md#measurements-behind-design-choices).
SERVE_PREFILL_ATTEMPT_INTERVAL = 4
DEFAULT_MAX_BODY_BYTES = 8 << 20  # the same as serving.frontend's (not imported: it pulls in the web stack)


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="one engine behind an OpenAI-compatible HTTP API")
    p.add_argument(
        "--role",
        default="normal",
        type=str.lower,
        choices=["normal", "prompt", "completion"],
        help="prompt/completion engines take part in P/D serving behind the router",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/*, /pd/* and /admin/* (default: PDINFER_API_KEY, else none)",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require the API key on /metrics and /debug/* too (/health stays open)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model file's or folder's name)",
    )
    p.add_argument(
        "--max-waiting", type=positive_int, default=1024, help="answer 503 while this many requests wait for prefill"
    )
    p.add_argument(
        "--api-server-count",
        type=positive_int,
        default=1,
        help="API-server processes in front of the engine core (they share the port); more of them "
        "when one cannot keep up with the JSON and SSE work of many streams",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 (default 8MiB)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=non_negative_seconds,
        default=30.0,
        help="on SIGTERM, first drain the engine as POST /admin/drain does (no new requests; a "
        "completion engine's requests move to other engines through the router), waiting at most "
        "this long for its requests to end, then stop (0: stop at once; Ctrl-C always does)",
    )
    p.add_argument(
        "--prefill-attempt-interval",
        type=positive_int,
        default=None,
        help="NORMAL engine: while requests decode, waiting prompts are prefilled only every N "
        "decode steps (at once when nothing runs). Lower N cuts the time to first token of "
        "requests that arrive under load, but interrupts running decodes with prefill steps "
        "more often (higher time per output token); higher N does the opposite. Wins over "
        f"PDINFER_PREFILL_ATTEMPT_INTERVAL (default: that variable; else {SERVE_PREFILL_ATTEMPT_INTERVAL} "
        "for one engine, whose requests arrive one by one, and the variable's 70 for a DP group)",
    )
    add_engine_args(p)
    add_kv_transfer_args(p)
    add_dp_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pdinfer import env

    if (
        args.prefill_attempt_interval is None
        and "PDINFER_PREFILL_ATTEMPT_INTERVAL" not in os.environ
        and args.data_parallel_size == 1
        and not args.headless
    ):
        args.prefill_attempt_interval = SERVE_PREFILL_ATTEMPT_INTERVAL  # EngineArgs' field
    args.api_key = args.api_key or env.get("PDINFER_API_KEY") or None
    if args.protect_metrics and not args.api_key:
        raise SystemExit("--protect-metrics needs an API key (--api-key or PDINFER_API_KEY)")
    if args.headless or args.data_parallel_size > 1:  # a DP group: rank processes + a front
        from pdinfer.distributed.cli_args import front_from_args, run_headless

        if args.headless:
            return run_headless(args)
        if args.api_server_count > 1:
            raise SystemExit("--api-server-count > 1 serves one engine core; a DP group has its own front")
        front = front_from_args(args, _engine_args(args))
        return _serve_in_process(args, front)
    return _serve_core(args)


def _engine_args(args: argparse.Namespace):
    engine_args = engine_args_from(args, role=args.role)
    if engine_args.role.handoff_side is not None:  # a PE or CE (each CE rank: a K/V port of its own)
        engine_args.kv_transfer = kv_transfer_from(args)
    return engine_args


def _serve_core(args: argparse.Namespace) -> int:
    """The engine core in a process of its own, ``--api-server-count`` API servers in front.

    On SIGTERM this process, which runs API server 0 and owns the core, is the one that drains
    it (``--drain-timeout-s``): the other API servers never send a drain, so a SIGTERM to the
    whole group drains the core once. They stop accepting and keep their open responses until
    the drain has ended them; then this process stops them and the core."""
    from pdinfer.engine.client import EngineDeadError
    from pdinfer.engine.mp_client import MPEngineClient, start_engine_core
    from pdinfer.serving.api_process import (
        APIServerConfig,
        listening_socket,
        serve_on,
        start_api_servers,
        stop_api_servers,
    )
    from pdinfer.serving.api_server import build_app

    engine_args = _engine_args(args)
    sock = listening_socket(args.host, args.port)  # first: a taken port fails before the model loads
    try:
        core = start_engine_core(engine_args)
    except EngineDeadError as exc:  # its own error is printed above
        print(f"pdinfer serve: {exc}", file=sys.stderr, flush=True)
        return 1
    servers = []
    try:
        name = args.served_model_name or served_model_name(args.model)
        client = MPEngineClient(core.address, core.ready, max_waiting=args.max_waiting)
        cfg = APIServerConfig(
            core.address,
            core.ready,
            name,
            args.api_key,
            args.max_waiting,
            args.max_body_bytes,
            args.protect_metrics,
            sock.fileno(),
            os.getpid(),
            0,
            args.drain_timeout_s,
        )
        servers = start_api_servers(cfg, args.api_server_count)
        app = build_app(client, name, args.api_key, args.max_body_bytes, args.protect_metrics)
        _announce(args, name, client.role, core.ready.kv_address)
        serve_on(app, sock, before_stop=_drain_on_sigterm(args, client))
    finally:
        stop_api_servers(servers)
        core.stop()
    return 0


def _serve_in_process(args: argparse.Namespace, engine) -> int:
    from pdinfer.serving.api_process import listening_socket, serve_on
    from pdinfer.serving.api_server import build_app

    name = args.served_model_name or served_model_name(args.model)
    app = build_app(engine, name, args.api_key, args.max_body_bytes, args.protect_metrics)
    engine.start()
    _announce(args, name, engine.role, None)
    try:
        serve_on(app, listening_socket(args.host, args.port), before_stop=_drain_on_sigterm(args, engine))
    finally:
        engine.shutdown()
    return 0


def _drain_on_sigterm(args: argparse.Namespace, engine):
    """What SIGTERM runs before serve stops (``api_process.serve_on``), unless --drain-timeout-s 0."""
    if not args.drain_timeout_s:
        return None
    from pdinfer.serving.admin import drain_before_stop

    return functools.partial(drain_before_stop, engine, args.drain_timeout_s)


def _announce(args, name: str, role: EngineType, kv_address: str | None) -> None:
    if kv_address is not None:
        logger.info("completion engine: K/V hand-offs arrive at %s", kv_address)
    print(f"pdinfer serve: {name} ({role.name}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
