"""Offline CPU baselines: HF transformers `generate` and llama.cpp on the same workload.

Usage:
    python benchmarks/baselines.py [--only transformers|llamacpp] [--num-prompts N]

Every run forces exactly `max_new_tokens` greedy tokens per prompt (EOS is never
allowed to end a sequence early), so output token counts are identical across
backends and tok/s figures are directly comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

try:  # imported as `benchmarks.baselines` from the repo root
    from benchmarks import workload
except ImportError:  # run as `python benchmarks/baselines.py`
    import workload  # type: ignore[no-redef]

DECODE_CONTEXT_TOKENS = 128  # prompt length used for the batch-1 decode figure
PREFILL_TOKENS = 1024  # prompt length used for the prefill figure
REPEATS = 3  # single-sequence figures are the median of this many timed runs
OUT_DIR = Path(__file__).resolve().parent / "out"  # gitignored


def _median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall time of `fn`; the median shrugs off a noisy neighbour on a shared box."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _single_sequence_prompts(gguf_path: str) -> tuple[list[int], list[int]]:
    """The fixed prompts for the batch-1 decode and the prefill figures."""
    tok = workload.load_tokenizer(gguf_path)
    decode = workload.make_prompt(tok, DECODE_CONTEXT_TOKENS, seed=101)
    return decode, workload.make_prompt(tok, PREFILL_TOKENS, seed=102)


# --------------------------------------------------------------------------- transformers


def load_transformers_model(gguf_path: str | None = None):
    """fp32 HF model for the GGUF file.

    De-quantizing the GGUF takes over a minute on 2 cores (mostly metadata parsing),
    so the converted model is saved once as safetensors and reloaded from there.
    """
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path = gguf_path or workload.default_gguf_path()
    cache = workload.hf_cache_dir(gguf_path) / "model"
    if (cache / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval()
        except Exception as exc:  # a broken cache must never break a benchmark
            print(f"[transformers] ignoring unreadable model cache {cache}: {exc}")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    try:
        model = _plain_copy(model)
        model.save_pretrained(cache)
    except Exception as exc:  # caching is an optimisation; the loaded model is still usable
        print(f"[transformers] could not cache model in {cache}: {exc}")
    return model


def _plain_copy(model):
    """Same weights in a model without the GGUF quantizer marker.

    transformers refuses to save a model loaded from GGUF, although its weights are
    already plain fp32; a copy built from the config (minus quantization_config) saves fine.
    """
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.eval()


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int):
    """Greedy batched generate with left padding; returns only the new token ids."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # bans EOS until the end: the ignore_eos equivalent
            pad_token_id=pad_id,
        )
    return out[:, width:]


def run_transformers(
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    batch_size: int = 16,
    gguf_path: str | None = None,
    dtype: str = "float32",
) -> dict:
    """Static-batch HF `generate` throughput, plus batch-1 decode and 1024-token prefill."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(2)
    gguf_path = gguf_path or workload.default_gguf_path()
    start = time.perf_counter()
    model = load_transformers_model(gguf_path).to(getattr(torch, dtype))
    load_s = time.perf_counter() - start
    pad_id = model.generation_config.pad_token_id
    pad_id = model.config.eos_token_id if pad_id is None else pad_id
    print(f"[transformers] model loaded in {load_s:.1f}s; warming up")
    _hf_generate(model, prompts[:2], 4, pad_id)  # first call pays one-off kernel/allocator setup

    out_tokens, token_ids = 0, []
    start = time.perf_counter()
    with tqdm(total=len(prompts) * max_new_tokens, desc="transformers", unit="tok") as bar:
        for i in range(0, len(prompts), batch_size):
            new = _hf_generate(model, prompts[i : i + batch_size], max_new_tokens, pad_id)
            assert new.shape[1] == max_new_tokens, f"generated {new.shape[1]} tokens"
            out_tokens += new.numel()
            token_ids += new.tolist()
            bar.update(new.numel())
    total_s = time.perf_counter() - start

    print("[transformers] measuring batch-1 decode and prefill")
    decode_prompt, prefill_prompt = _single_sequence_prompts(gguf_path)
    # Decode time = time(128 tokens) - time(1 token): removes prefill and setup costs.
    t_first = _median_seconds(lambda: _hf_generate(model, [decode_prompt], 1, pad_id))
    t_all = _median_seconds(lambda: _hf_generate(model, [decode_prompt], max_new_tokens, pad_id))
    t_prefill = _median_seconds(lambda: _hf_generate(model, [prefill_prompt], 1, pad_id))
    return {
        "backend": "transformers" if dtype == "float32" else f"transformers ({dtype})",
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": out_tokens,
        "load_s": load_s,
        "total_s": total_s,
        "output_tok_s": out_tokens / total_s,
        "bs1_decode_tok_s": (max_new_tokens - 1) / (t_all - t_first),
        "prefill_tok_s": len(prefill_prompt) / t_prefill,
        "token_ids": token_ids,
    }


# ------------------------------------------------------------------------------ llama.cpp


def _llama_greedy(llm, prompt: list[int], max_new_tokens: int, eos_id: int):
    """Greedy generation with EOS banned; returns (prefill_s, decode_s, new_tokens).

    The low-level eval loop is used instead of create_completion so that EOS can be
    masked out (forcing exactly `max_new_tokens`) and no detokenization is timed.
    """
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()
    llm.reset()  # n_tokens = 0, so the next eval drops the whole KV cache
    start = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - start
    tokens: list[int] = []
    start = time.perf_counter()
    while True:
        # With logits_all=False `llm.scores` is left unfilled, so read the last row's
        # logits straight from the context (a zero-copy view we are free to edit).
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        logits[eos_id] = -np.inf
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == max_new_tokens:
            break
        llm.eval(tokens[-1:])
    return prefill_s, time.perf_counter() - start, tokens


def load_llamacpp(gguf_path: str | None = None, n_threads: int = 2):
    from llama_cpp import Llama

    return Llama(
        model_path=gguf_path or workload.default_gguf_path(),
        n_ctx=2048,
        n_threads=n_threads,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )


def run_llamacpp(
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    gguf_path: str | None = None,
    n_threads: int = 2,
) -> dict:
    """Sequential (one prompt at a time) llama.cpp throughput, plus batch-1 decode and prefill."""
    from tqdm import tqdm

    gguf_path = gguf_path or workload.default_gguf_path()
    start = time.perf_counter()
    llm = load_llamacpp(gguf_path, n_threads)
    load_s = time.perf_counter() - start
    eos_id = llm.token_eos()
    print(f"[llama.cpp] model loaded in {load_s:.1f}s; warming up")
    _llama_greedy(llm, prompts[0], 4, eos_id)

    out_tokens, prefill_total, token_ids = 0, 0.0, []
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc="llama.cpp", unit="prompt"):
        prefill_s, _, new = _llama_greedy(llm, prompt, max_new_tokens, eos_id)
        assert len(new) == max_new_tokens
        out_tokens += len(new)
        token_ids.append(new)
        prefill_total += prefill_s
    total_s = time.perf_counter() - start

    print("[llama.cpp] measuring batch-1 decode and prefill")
    decode_prompt, prefill_prompt = _single_sequence_prompts(gguf_path)
    runs = [_llama_greedy(llm, decode_prompt, max_new_tokens, eos_id) for _ in range(REPEATS)]
    decode_s = statistics.median(r[1] for r in runs)
    t_prefill = statistics.median(_llama_greedy(llm, prefill_prompt, 1, eos_id)[0] for _ in range(REPEATS))
    return {
        "backend": "llama.cpp",
        "num_prompts": len(prompts),
        "batch_size": 1,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": out_tokens,
        "load_s": load_s,
        "total_s": total_s,
        "prefill_share": prefill_total / total_s,
        "output_tok_s": out_tokens / total_s,
        "bs1_decode_tok_s": (max_new_tokens - 1) / decode_s,
        "prefill_tok_s": len(prefill_prompt) / t_prefill,
        "token_ids": token_ids,
    }


# ----------------------------------------------------------------------------------- CLI

TABLE_HEADERS = ["backend", "num_prompts", "batch_size", "output_tokens", "total_s"]
TABLE_HEADERS += ["output_tok_s", "bs1_decode_tok_s", "prefill_tok_s", "other_cpu_frac"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["transformers", "llamacpp"], default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers only")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--wait-idle", type=float, default=0, help="minutes to wait for idle CPU")
    args = parser.parse_args(argv)

    gguf_path = args.gguf or workload.default_gguf_path()
    prompts = workload.make_prompts(workload.load_tokenizer(gguf_path), n=args.num_prompts)
    runners = {
        "transformers": lambda: run_transformers(prompts, args.max_new_tokens, args.batch_size, gguf_path=gguf_path),
        "llamacpp": lambda: run_llamacpp(prompts, args.max_new_tokens, gguf_path=gguf_path),
    }
    results = []
    for name, run in runners.items():
        if args.only not in (None, name):
            continue
        if args.wait_idle > 0 and not workload.wait_for_idle_cpu(args.wait_idle * 60):
            print("[baselines] machine never went idle; figures below are contended")
        with workload.OtherCpuLoad() as load:
            res = run()
        results.append({**res, "other_cpu_frac": load.fraction, "date": time.ctime()})

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for res in results:  # raw figures, for docs/performance.md and later comparison
        name = res["backend"].replace(".", "")
        (OUT_DIR / f"baseline-{name}.json").write_text(json.dumps(res) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "token_ids"}))
    workload.print_table(results, TABLE_HEADERS)
    return results


if __name__ == "__main__":
    main()
