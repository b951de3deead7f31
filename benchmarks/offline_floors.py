"""The floors of ``offline_throughput.py``: probes of this machine's matmul rate and memory
bandwidth, the model's FLOPs and weight bytes, and the tables that set the measured figures
against the floors and against the other backends.
"""

from __future__ import annotations

import time

PREFILL_TOKENS = 1024


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
