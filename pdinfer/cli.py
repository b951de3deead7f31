"""The ``pdinfer`` command.

    pdinfer generate "prompt" [--max-tokens N] [--temperature T] [--seed S] [--chat] [--model M]
    pdinfer serve [--role normal|prompt|completion] [--model M] [--host H] [--port P] ...
    pdinfer router --prefill URL... --decode URL... [--normal URL...] [--port P]
    pdinfer launch --prefill N --decode M [--normal K] [--port P] [engine flags]
    pdinfer bench serve --url URL [--rate R | --concurrency C] [--loads 1,2,4] [--plot out.png]

Each subcommand is an ``add_<name>_parser(subparsers)`` function that registers its flags and
``set_defaults(func=run_<name>)``; ``router``, ``launch`` and ``bench`` join ``SUBCOMMANDS``.
Engine flags are shared through ``add_engine_args`` / ``engine_args_from``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from pdinfer.config import EngineArgs
from pdinfer.engine_type import EngineType
from pdinfer.serving.bench import add_bench_parser
from pdinfer.serving.launch import add_launch_parser
from pdinfer.serving.router_cli import add_router_parser

logger = logging.getLogger("pdinfer")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """Bytes from "536870912", "512MiB", "2GiB", "1.5G" (K/M/G and KiB/MiB/GiB are binary,
    KB/MB/GB decimal)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1073741824)")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# argparse dest -> EngineArgs field (the same name); collected by engine_args_from
_ENGINE_FIELDS = (
    "model",
    "tokenizer",
    "load_format",
    "dtype",
    "device",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "chunked_prefill",
    "enable_prefix_caching",
    "stop_preempted_request",
    "data_parallel_size",
    "seed",
    "num_threads",
    "enforce_eager",
    "kv_store",
    "kv_store_bytes",
    "kv_store_memory_bytes",
    "kv_store_save_interval_tokens",
)


def add_engine_args(parser: argparse.ArgumentParser, *, include_seed: bool = True) -> None:
    """The flags of ``EngineArgs``. ``include_seed=False`` leaves ``--seed`` to the caller
    (``generate`` uses it for sampling; the engine seed only seeds dummy weights)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file, Hugging Face folder or preset:<name> (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer source (default: the model)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="fixed KV block count (default: sized from the memory budget)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="CPU memory for the KV cache and activations, e.g. 512MiB, 2GiB (default: a quarter of RAM, at most 4GiB)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=positive_int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=positive_int, default=128)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument(
        "--stop-preempted-request",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="finish a preempted request with an error instead of "
        "recomputing it (default: on for completion, off otherwise)",
    )
    g.add_argument("--data-parallel-size", type=positive_int, default=1)
    g.add_argument("--num-threads", type=positive_int, default=None, help="torch threads on CPU (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--kv-store",
        default=None,
        help="KV cache store: a directory (may be shared across hosts) or 'memory'; "
        "engines save finished full blocks there and load stored prefixes",
    )
    g.add_argument(
        "--kv-store-bytes",
        type=parse_size,
        default=None,
        help="bound of the KV store, e.g. 64GiB (default: 16GiB, or 1GiB in memory)",
    )
    g.add_argument(
        "--kv-store-memory-bytes",
        type=parse_size,
        default=0,
        help="an in-memory tier of this size in front of a directory KV store",
    )
    g.add_argument(
        "--kv-store-save-interval-tokens",
        type=positive_int,
        default=0,
        help="also save running sequences' full blocks every N tokens (default: off)",
    )
    if include_seed:
        g.add_argument("--seed", type=int, default=0, help="engine seed (dummy weights)")


def engine_args_from(args: argparse.Namespace, role: EngineType | str | None = None) -> EngineArgs:
    values = {name: getattr(args, name) for name in _ENGINE_FIELDS if hasattr(args, name)}
    if role is not None:
        values["engine_type"] = role
    return EngineArgs(**values)


def served_model_name(model: str | None) -> str:
    """The name clients send in ``model``: the file's stem or the folder's name."""
    if model is None:
        from pdinfer.models.loader import DEFAULT_MODEL_FILE

        return DEFAULT_MODEL_FILE.split(".")[0]
    path = Path(model)
    return path.stem.split(".")[0] if path.suffix == ".gguf" else path.name or model


# --- generate ----------------------------------------------------------------------------------------
def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Plain completion of the prompt by default; --chat wraps it in the model's "
        "chat template as one user message (what an instruct model expects).",
    )
    p.add_argument("prompt", help='the prompt; "-" reads it from stdin')
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1: off")
    p.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="seed of the sampling stream (same seed, same text)",
    )
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    add_engine_args(p, include_seed=False)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pdinfer.engine.llm_engine import LLMEngine
    from pdinfer.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        print(f"pdinfer generate: {exc}", file=sys.stderr)
        return 2
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = LLMEngine(engine_args_from(args))
    try:
        prompt = _chat_prompt(engine, text) if args.chat else text
        engine.add_request("generate-0", prompt, params)
        return _stream_to_stdout(engine, "generate-0")
    except ValueError as exc:
        print(f"pdinfer generate: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()


def _chat_prompt(engine, text: str) -> dict:
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        raise ValueError("--chat: this model has no chat template")
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    ids = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    return {"prompt": rendered, "prompt_token_ids": ids}


def _stream_to_stdout(engine, request_id: str) -> int:
    printed, status = 0, 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text if output.outputs else ""
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = max(printed, len(text))
                if output.finished and output.error:
                    print(f"\npdinfer generate: {output.error}", file=sys.stderr)
                    status = 1
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        status = 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    return status


# --- serve -------------------------------------------------------------------------------------------
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
    from pdinfer.distributed.cli_args import add_dp_args

    add_dp_args(p)
    p.set_defaults(func=run_serve)


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("P/D hand-off (prompt and completion roles)")
    g.add_argument(
        "--kv-connector",
        default="tcp",
        choices=["tcp", "mooncake", "cuda_ipc", "nccl"],
        help="how K/V moves from a prefill to a completion engine: ZeroMQ over TCP; "
        "Mooncake's Transfer Engine writing into the CE's cache (optional: apt-get "
        "install libibverbs1 && pip install mooncake-transfer-engine-non-cuda); or "
        "cuda_ipc, device to device between processes of one host (shared memory "
        "for CPU engines); or nccl, GPU to GPU by NCCL send/recv (gloo for CPU engines; "
        "also across hosts); the device ones keep ZeroMQ for the control messages",
    )
    g.add_argument(
        "--kv-host", default="127.0.0.1", help="completion engine: the address PEs push K/V to (bind address)"
    )
    g.add_argument("--kv-port", type=int, default=0, help="completion engine: K/V port (0: any free)")
    g.add_argument(
        "--kv-secret", default=None, help="shared secret: K/V pushes not signed with it are refused (set on PE and CE)"
    )
    g.add_argument(
        "--kv-lease-s",
        type=float,
        default=None,
        help="prefill engine: free a handed-over request's blocks if the CE has not "
        "confirmed within this many seconds (default 30)",
    )
    g.add_argument(
        "--kv-reservation-timeout-s",
        type=float,
        default=None,
        help="completion engine: drop a reservation whose K/V never came (default 60)",
    )


def kv_transfer_from(args: argparse.Namespace) -> dict:
    values = {
        "connector": args.kv_connector,
        "host": args.kv_host,
        "port": args.kv_port,
        "secret": args.kv_secret,
        "lease_s": args.kv_lease_s,
        "reservation_timeout_s": args.kv_reservation_timeout_s,
    }
    return {k: v for k, v in values.items() if v is not None}


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
    import uvicorn

    from pdinfer import env
    from pdinfer.serving import AsyncEngine, build_app

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
    level = logger.getEffectiveLevel()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=5,
        log_level="info" if level <= logging.DEBUG else "warning",
    )
    print(
        f"pdinfer serve: {name} ({async_engine.role.name}) on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()
    return 0


# --- main --------------------------------------------------------------------------------------------
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
