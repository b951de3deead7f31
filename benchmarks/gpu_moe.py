"""The fused GPU MoE (``layers/triton_moe.py``) on one GPU: correctness, layer speed, whole model.

    python benchmarks/gpu_moe.py [--out DIR] [--skip correct,layer,model] [--model-layers N]
    python benchmarks/gpu_moe.py --tiny   # small shapes; on a CPU through TRITON_INTERPRET=1

(a) correctness, bf16, on the Qwen3-30B-A3B layer (hidden 2048, 128 experts, top-8, expert
    intermediate 768) and the DeepSeek-V2-Lite one (64 routed experts, top-6, 1408) at T = 1,
    64, 256, 4096 tokens: the fused experts and the torch path against a float32 reference on
    the same routing, by norm and by largest element.
(b) timing of those experts, fused (eager and replayed from a CUDA graph, which also checks that
    the path captures) and the torch path, against the floor: the touched experts' weight bytes
    / 4.3 TB/s or the FLOPs (2 T top_k 3 H I) / 790 TFLOP/s, whichever is longer.
(c) the whole ``preset:qwen3-30b-a3b`` with dummy weights: whether decode graphs were captured,
    decode tok/s at batch 1 and 64 and prefill tok/s against their floors, then the same eagerly
    with the fused path and with the torch path.

Every section runs in its own try block (a traceback, then on to the next); a table is printed
last and every figure written to ``--out``/gpu_moe.json (default $OUT).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not torch.cuda.is_available():  # --tiny on a CPU: the kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.layers import triton_moe  # noqa: E402
from pdinfer.layers.moe import SparseMoE, grouped_experts  # noqa: E402
from pdinfer.models.presets import PRESETS  # noqa: E402
from pdinfer.models.spec import MoESpec  # noqa: E402

HBM_BYTES_S, MATMUL_FLOP_S = 4.3e12, 7.9e14  # measured on an H200 (DESIGN.md, section 5)
REL_TOL, MAX_TOL = 1e-2, 3e-2  # bf16: norm error, largest element error / largest element

SHAPES = {  # hidden, experts, top_k, expert intermediate, renormalized top-k weights
    "qwen3-30b-a3b": (2048, 128, 8, 768, True),
    "deepseek-v2-lite": (2048, 64, 6, 1408, False),
}
TOKENS: tuple[int, ...] = (1, 64, 256, 4096)
TINY_SHAPES = {"tiny-8x2": (64, 8, 2, 48, True), "tiny-16x4": (40, 16, 4, 24, False)}
TINY_TOKENS: tuple[int, ...] = (1, 5, 17)
TINY_PRESET = dict(
    PRESETS["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=512, vocab_size=512, eos_token_id=1,
)  # fmt: skip

FIG: dict[str, object] = {}
ERRORS: list[str] = []  # the sections and cases that raised
ROWS: list[tuple[str, ...]] = []
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def log(msg: str) -> None:
    print(msg, flush=True)


def row(*cells: str) -> None:
    ROWS.append(cells)
    log("  " + " | ".join(cells))


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (host clock around a device sync)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_timed(fn) -> float | None:
    """Median seconds of ``fn`` replayed from a CUDA graph (it must capture); None on a CPU."""
    if DEVICE.type != "cuda":
        return None
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()  # its stream does not wait for the inputs (gpu_micro.graph_timed)
    return do_bench_cudagraph(fn, rep=30, return_mode="median") / 1e3


def make_layer(shape, dtype) -> SparseMoE:
    """A sparse layer of ``shape`` with weights at the scale of the engine's dummy weights."""
    hidden, experts, top_k, inter, norm = shape
    moe = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=inter, sparse_layers=(), norm_topk_prob=norm)
    with torch.device(DEVICE):
        layer = SparseMoE(moe, hidden).to(dtype)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return layer


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref).abs()
    return (diff.norm() / ref.norm()).item(), (diff.max() / ref.abs().max()).item()


# --- (a) correctness and (b) timing of one layer's experts ----------------------------------
def layer_case(name: str, shape, tokens: int, dtype, check: bool, time_it: bool) -> None:
    layer = make_layer(shape, dtype)
    hidden, experts, top_k, inter, _ = shape
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
    weights, ids = layer.gate(x)  # one routing for every path
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj

    def fused():
        return triton_moe.fused_experts(x, gate_up, down, weights, ids)

    def torch_path():
        return grouped_experts(x, gate_up, down, weights, ids)

    key = f"{name}_T{tokens}"
    if check:
        ref = grouped_experts(x.float(), gate_up.float(), down.float(), weights, ids)
        for what, out in (("fused", fused()), ("torch", torch_path())):
            rel, big = errors(out, ref)
            ok = rel < REL_TOL and big < MAX_TOL and bool(torch.isfinite(out).all())
            FIG[f"err_{what}_{key}"] = {"rel": rel, "max_rel": big, "pass": ok}
            row(f"(a) {name} T={tokens} {what} vs fp32", f"rel {rel:.2e}", f"max {big:.2e}", "PASS" if ok else "FAIL")
        del ref
    if time_it:
        touched = int(ids.unique().numel())
        floor_bw = touched * 3 * hidden * inter * gate_up.element_size() / HBM_BYTES_S
        floor_fl = 2 * tokens * top_k * 3 * hidden * inter / MATMUL_FLOP_S
        floor = max(floor_bw, floor_fl)
        t_fused, t_torch = timed(fused), timed(torch_path, repeats=5)
        try:
            t_graph = graph_timed(fused)
        except Exception:  # noqa: BLE001 - a path that does not capture is a finding, not the end
            log(traceback.format_exc())
            row(f"(b) {name} T={tokens} CUDA graph capture", "FAILED (see log)")
            t_graph = None
        best = t_graph if t_graph is not None else t_fused
        FIG[f"time_{key}"] = {
            "fused_eager_s": t_fused,
            "fused_graph_s": t_graph,
            "torch_s": t_torch,
            "floor_s": floor,
            "floor_kind": "bytes" if floor_bw >= floor_fl else "flops",
            "experts_touched": touched,
        }
        graph = f"graph {t_graph * 1e6:.0f} us" if t_graph is not None else "graph n/a"
        row(
            f"(b) {name} T={tokens} ({touched}/{experts} experts)",
            f"fused {t_fused * 1e6:.0f} us, {graph}",
            f"torch {t_torch * 1e6:.0f} us ({t_torch / best:.1f}x)",
            f"floor {floor * 1e6:.1f} us ({'bytes' if floor_bw >= floor_fl else 'flops'}): {floor / best:.0%}",
        )


def layers(shapes, tokens, dtype, check: bool, time_it: bool) -> None:
    for name, shape in shapes.items():
        for t in tokens:
            try:
                layer_case(name, shape, t, dtype, check, time_it)
            except Exception:  # noqa: BLE001 - one failed case must not lose the others
                log(traceback.format_exc())
                ERRORS.append(f"layer {name} T={t}")
                row(f"{name} T={t}", "ERROR (see log)")
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()


SWEEP = [  # block_m, block_n, block_k, group_m, warps, stages
    (16, 64, 128, 1, 4, 3),
    (16, 128, 128, 1, 4, 2),
    (32, 64, 128, 1, 4, 3),
    (32, 128, 64, 8, 4, 3),
    (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 3),
    (64, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
]


def sweep(shapes, tokens, dtype) -> None:
    """Graph-replayed time of each kernel config in SWEEP: a start for tuning ``CONFIGS``."""
    for name, shape in shapes.items():
        layer = make_layer(shape, dtype)
        gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
        for t in tokens:
            x = torch.randn(t, shape[0], device=DEVICE, dtype=dtype)
            weights, ids = layer.gate(x)
            default = triton_moe.pick_config(t, shape[2], shape[1])
            times = {}
            for c in SWEEP:
                cfg = triton_moe.MoEKernelConfig(*c)
                try:
                    run = functools.partial(triton_moe.fused_experts, x, gate_up, down, weights, ids, cfg)
                    times[c] = graph_timed(run)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    log(f"  {name} T={t} {c}: {type(e).__name__}")
            done = {c: v for c, v in times.items() if v is not None}
            if not done:
                continue
            best = min(done, key=done.__getitem__)
            mine = tuple(
                getattr(default, f) for f in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
            )
            FIG[f"sweep_{name}_T{t}"] = {str(c): v for c, v in done.items()}
            row(
                f"sweep {name} T={t}",
                f"best {best}: {done[best] * 1e6:.0f} us",
                f"default {mine}: {done[mine] * 1e6:.0f} us" if mine in done else f"default {mine}",
            )


# --- (c) the whole model -------------------------------------------------------------------------
def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(num)]


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Output tok/s of a batch decoding together, timed from the step after all prefilled."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = f"dec-{batch}-{time.monotonic_ns()}"
    for i, p in enumerate(random_prompts(batch, prompt_len, engine.spec.vocab_size, batch)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    counts: dict[str, int] = {}
    t0, tokens0 = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t0 is None and len(counts) == batch and min(counts.values()) >= 1:
            t0, tokens0 = time.perf_counter(), sum(counts.values())
    if t0 is None:
        raise RuntimeError("the batch never finished prefilling")
    return (sum(counts.values()) - tokens0) / (time.perf_counter() - t0)


def prefill_tok_s(llm: LLM, num: int, length: int, rounds: int = 2) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        prompts = random_prompts(num, length, engine.spec.vocab_size, 500 + r)
        sync()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"pre-{r}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return num * length / statistics.median(times[1:])


def model_floors(llm: LLM, batch: int, ctx: float, prefill_tokens: int, prompt_len: int) -> tuple[float, float]:
    """(decode tok/s floor at ``batch`` and mean context ``ctx``, prefill tok/s floor).

    Decode reads every weight but the input embedding and, per sparse layer, the experts the
    batch touches: E (1 - (1 - k/E)^B) of them with uniform routing. Prefill: 2 FLOPs per active
    weight per token plus causal attention."""
    spec, model = llm.engine.spec, llm.engine.model_runner.model
    moe = spec.moe
    assert moe is not None
    expert_params = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel() for m in sparse(model))
    item = next(model.parameters()).element_size()
    dense = sum(p.numel() for p in model.parameters()) - expert_params - model.embed_tokens.weight.numel()
    per_expert = 3 * spec.hidden_size * moe.intermediate_size
    layers_sparse = len(sparse(model))
    touched = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * item
    step_bytes = (dense + layers_sparse * touched * per_expert) * item + batch * ctx * kv_per_token
    decode = batch / (step_bytes / HBM_BYTES_S)
    active = dense - spec.vocab_size * spec.hidden_size + layers_sparse * moe.top_k * per_expert
    attn = 4 * spec.num_heads * spec.head_dim * spec.num_layers * prompt_len / 2  # per token
    flops = prefill_tokens * (2 * active + attn)
    return decode, prefill_tokens / (flops / MATMUL_FLOP_S)


def sparse(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def whole_model(preset: str, engine_kwargs: dict, sizes: dict) -> None:
    start = time.perf_counter()
    try:
        llm = LLM(model=f"preset:{preset}", load_format="dummy", **engine_kwargs)
    except Exception:  # noqa: BLE001 - e.g. a failed graph capture: measure eagerly still
        log(traceback.format_exc())
        row("(c) engine start with CUDA graphs", "FAILED (see log); eager instead")
        FIG["graph_start_failed"] = True
        llm = LLM(model=f"preset:{preset}", load_format="dummy", enforce_eager=True, **engine_kwargs)
    FIG["model_load_s"] = time.perf_counter() - start
    runner = llm.engine.model_runner
    layers_ = sparse(runner.model)
    if DEVICE.type == "cpu":  # the engine's CPU path takes the torch experts; run the fused ones
        for layer in layers_:
            layer.experts.use_fused = True
    graphs = getattr(runner, "graphs", None)  # GpuRunner's (a CpuRunner has none)
    FIG["graphs_captured"] = sorted(graphs._graphs) if graphs is not None else []
    row("(c) decode CUDA graphs", f"captured for batches {FIG['graphs_captured'] or 'none'}")
    prompt_len, new_tokens = sizes["prompt_len"], sizes["new_tokens"]
    ctx = prompt_len + new_tokens / 2
    num, length = sizes["prefill"]
    modes: list[tuple[str, str | None, bool]] = [("fused+graphs" if graphs is not None else "fused", None, True)]
    if graphs is not None:
        modes.append(("fused eager", "eager", True))
    modes.append(("torch eager", "eager", False))
    for label, eager, fused in modes:
        if graphs is not None and eager:
            runner.graphs = None
        for layer in layers_:
            layer.experts.use_fused = fused
        for batch in sizes["batches"]:
            tokens = new_tokens if fused else max(4, new_tokens // 4)  # the torch path is slow
            tok_s = decode_tok_s(llm, batch, prompt_len, tokens)
            floor, _ = model_floors(llm, batch, ctx, num * length, length)
            FIG[f"model_decode_{label}_B{batch}"] = {"tok_s": tok_s, "floor_tok_s": floor}
            row(f"(c) decode B={batch} {label}", f"{tok_s:.0f} tok/s", f"floor {floor:.0f}", f"{tok_s / floor:.0%}")
        tok_s = prefill_tok_s(llm, num, length)
        _, floor = model_floors(llm, 1, ctx, num * length, length)
        FIG[f"model_prefill_{label}"] = {"tok_s": tok_s, "floor_tok_s": floor}
        row(f"(c) prefill {num}x{length} {label}", f"{tok_s:.0f} tok/s", f"floor {floor:.0f}", f"{tok_s / floor:.0%}")
    llm.engine.shutdown()


# --- main ------------------------------------------------------------------------------------
def run_section(name: str, fn, *args) -> None:
    log(f"\n== {name} ==")
    start = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - one failed section must not lose the others' figures
        log(traceback.format_exc())
        ERRORS.append(name)
        row(name, "ERROR (see log)")
    finally:
        log(f"   ({name}: {time.perf_counter() - start:.1f} s)")
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: correct, layer, model")
    parser.add_argument("--tiny", action="store_true", help="small shapes (runs on a CPU, in the interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time each kernel config in SWEEP")
    parser.add_argument("--model-layers", type=int, default=0, help="a qwen3-30b-a3b with fewer layers (0: all 48)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (Triton interpreter)"
    log(f"{name} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    FIG["device"] = name
    if args.tiny:
        shapes, tokens = TINY_SHAPES, TINY_TOKENS
        dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # interpreter: no bf16 dots
        PRESETS["qwen3-moe-tiny"] = TINY_PRESET
        preset = "qwen3-moe-tiny"
        kwargs = dict(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8, device=str(DEVICE))
        if DEVICE.type == "cpu":
            kwargs.update(kv_cache_memory=64 * 2**20, dtype="float32")
        sizes = {"prompt_len": 8, "new_tokens": 4, "batches": (1, 4), "prefill": (2, 32)}
    else:
        shapes, tokens, dtype = SHAPES, TOKENS, torch.bfloat16
        preset = "qwen3-30b-a3b"
        if args.model_layers:
            preset = f"qwen3-30b-a3b-{args.model_layers}l"
            PRESETS[preset] = dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=args.model_layers)
        kwargs = dict(max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=64, gpu_memory_utilization=0.85)
        sizes = {"prompt_len": 512, "new_tokens": 64, "batches": (1, 64), "prefill": (8, 1024)}
    if "correct" not in skip or "layer" not in skip:
        run_section("(a)(b) one MoE layer", layers, shapes, tokens, dtype, "correct" not in skip, "layer" not in skip)
    if args.sweep:
        run_section("kernel config sweep", sweep, shapes, tokens, dtype)
    if "model" not in skip:
        run_section(f"(c) whole model {preset}", whole_model, preset, kwargs, sizes)
    FIG["errors"] = ERRORS
    (out / "gpu_moe.json").write_text(json.dumps({"figures": FIG, "table": ROWS}, indent=1, default=str))
    log("\n" + format_table())
    failed = [k for k, v in FIG.items() if isinstance(v, dict) and v.get("pass") is False]
    log(f"\ncorrectness: {'FAIL ' + ', '.join(failed) if failed else 'all PASS'}; errors: {ERRORS}")


def format_table() -> str:
    width = max(len(r) for r in ROWS) if ROWS else 0
    rows = [tuple(r) + ("",) * (width - len(r)) for r in ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows)


if __name__ == "__main__":
    main()
