"""Argument types and the engine flags shared by the ``pdinfer`` subcommands (``generate``,
``serve``, ``launch``, ``router``); no heavy imports, so the command starts fast.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from pdinfer.config import EngineArgs
from pdinfer.engine_type import EngineType

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


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


# argparse dest -> EngineArgs field (the same name); collected by engine_args_from
_ENGINE_FIELDS = (
    "prefill_attempt_interval",  # serve only
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
    "expert_parallel_size",
    "num_redundant_experts",
    "eplb_interval",
    "seed",
    "num_threads",
    "enforce_eager",
    "batch_invariant",
    "kv_cache_dtype",
    "quantization",
    "speculative_method",
    "num_draft_tokens",
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
    g.add_argument(
        "--expert-parallel-size",
        type=positive_int,
        default=1,
        help="MoE models: split the routed experts over this many ranks of the DP group (it must divide "
        "--data-parallel-size); attention stays per rank",
    )
    g.add_argument(
        "--num-redundant-experts",
        type=non_negative_int,
        default=0,
        help="MoE models: extra expert replicas per layer, placed by EPLB on the most loaded experts",
    )
    g.add_argument(
        "--eplb-interval",
        type=non_negative_int,
        default=None,
        help="MoE models: rearrange experts every N counted steps, 0: never "
        "(default: 1000 on --role prompt, 10000 otherwise)",
    )
    g.add_argument("--num-threads", type=positive_int, default=None, help="torch threads on CPU (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's logits, tokens and log-probs bit-identical whatever else shares its batch "
        "and however its prefill is chunked (CPU float32, or CUDA; slower small steps, see docs/performance.md)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="fp8: K/V stored as float8 e4m3 (half the bytes, twice the blocks; static scale 1.0). "
        "CUDA GPUs with FP8 (compute capability 8.9+, e.g. Hopper) only (default: the model dtype)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: the decoder's linear weights quantized to float8 e4m3 at load (per output channel), "
        "activations per token; Llama family, CUDA GPUs with FP8 only (default: none)",
    )
    g.add_argument(
        "--speculative-method",
        default=None,
        choices=["ngram", "mtp"],
        help="speculative decoding: 'ngram' drafts from earlier text of each request (prompt lookup) and "
        "verifies the drafts in one decode step; 'mtp' drafts with a DeepSeek-V3 checkpoint's multi-token-"
        "prediction layer. "
        "A prompt engine never drafts (default: off)",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=non_negative_int,
        default=0,
        help="draft tokens verified per decode step (default: 3 with --speculative-method)",
    )
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
