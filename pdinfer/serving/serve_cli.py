"""``pdinfer serve``'s flags and entry point: one engine of a role (or a DP group) behind the
OpenAI-compatible HTTP API. The web stack and the engine are imported only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdinfer.cli_args import add_engine_args, engine_args_from, positive_int, served_model_name
from pdinfer.distributed.cli_args import add_dp_args
from pdinfer.engine_type import EngineType
from pdinfer.kv_transfer.cli_args import add_kv_transfer_args, kv_transfer_from

logger = logging.getLogger("pdinfer")


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
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model file's or folder's name)",
    )
    p.add_argument(
        "--max-waiting", type=positive_int, default=1024, help="answer 503 while this many requests wait for prefill"
    )
    p.add_argument(
        "--prefill-attempt-interval",
        type=positive_int,
        default=None,
        help="NORMAL engine: while requests decode, waiting prompts are prefilled only every N "
        "decode steps (at once when nothing runs). Lower N cuts the time to first token of "
        "requests that arrive under load, but interrupts running decodes with prefill steps "
        "more often (higher time per output token); higher N does the opposite. Sets "
        "PDINFER_PREFILL_ATTEMPT_INTERVAL (default: that variable, else 70)",
    )
    add_engine_args(p)
    add_kv_transfer_args(p)
    add_dp_args(p)
    p.set_defaults(func=run_serve)


def build_engine(args: argparse.Namespace):
    """The engine class of the role: a PE or CE takes part in the P/D hand-off."""
    from pdinfer.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args, role=args.role)
    if engine_args.role is EngineType.PROMPT:
        from pdinfer.engine.prefill_engine import PrefillEngine

        engine_args.kv_transfer = kv_transfer_from(args)
        return PrefillEngine(engine_args)
    if engine_args.role is EngineType.COMPLETION:
        from pdinfer.engine.completion_engine import CompletionEngine

        engine_args.kv_transfer = kv_transfer_from(args)
        return CompletionEngine(engine_args)
    return LLMEngine(engine_args)


def run_serve(args: argparse.Namespace) -> int:
    from pdinfer import env
    from pdinfer.serving import AsyncEngine, build_app
    from pdinfer.serving.frontend import http_server

    if args.prefill_attempt_interval is not None:
        # The scheduler config reads the env snapshot when the engine is built: set it first.
        os.environ["PDINFER_PREFILL_ATTEMPT_INTERVAL"] = str(args.prefill_attempt_interval)
        env.rearm("PDINFER_PREFILL_ATTEMPT_INTERVAL")
    if args.headless or args.data_parallel_size > 1:  # a DP group: rank processes + a front
        from pdinfer.distributed.cli_args import front_from_args, run_headless

        if args.headless:
            return run_headless(args)
        async_engine = engine = front_from_args(args, engine_args_from(args, role=args.role))
    else:
        engine = build_engine(args)
        async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
    name = args.served_model_name or served_model_name(args.model)
    app = build_app(async_engine, name, api_key=args.api_key)
    if async_engine.role is EngineType.COMPLETION:
        logger.info("completion engine: K/V hand-offs arrive at %s", engine.kv_address)
    async_engine.start()
    server = http_server(app, args.host, args.port)
    print(
        f"pdinfer serve: {name} ({async_engine.role.name}) on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0
