"""The ``pdinfer`` command.

    pdinfer generate "prompt" [--max-tokens N] [--temperature T] [--seed S] [--chat] [--model M]
    pdinfer serve [--role normal|prompt|completion] [--model M] [--host H] [--port P] ...
    pdinfer router --prefill URL... --decode URL... [--normal URL...] [--port P]
    pdinfer launch --prefill N --decode M [--normal K] [--port P] [engine flags]
    pdinfer bench serve --url URL [--rate R | --concurrency C] [--loads 1,2,4] [--plot out.png]

Each subcommand is an ``add_<name>_parser(subparsers)`` function in its own module that registers
its flags and ``set_defaults(func=run_<name>)``, and joins ``SUBCOMMANDS``. Engine flags are shared
through ``add_engine_args`` / ``engine_args_from`` (``pdinfer.cli_args``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdinfer.generate_cli import add_generate_parser
from pdinfer.serving.bench import add_bench_parser
from pdinfer.serving.launch import add_launch_parser
from pdinfer.serving.router_cli import add_router_parser
from pdinfer.serving.serve_cli import add_serve_parser

logger = logging.getLogger("pdinfer")

SUBCOMMANDS = (add_generate_parser, add_serve_parser, add_router_parser, add_launch_parser, add_bench_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdinfer",
        description="pdinfer: one LLM engine class for NORMAL, PROMPT (prefill) and COMPLETION (decode) roles.",
    )
    parser.add_argument(
        "--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (default: $PDINFER_LOG_LEVEL or INFO)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import pdinfer  # noqa: F401  (sets up the pdinfer logger)

    if args.log_level:
        logger.setLevel(args.log_level.upper())
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
