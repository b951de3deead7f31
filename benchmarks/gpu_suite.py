"""GPU suite for one device call: ceilings, correctness against transformers, speed against the floor.

    python benchmarks/gpu_suite.py [--out DIR] [--skip micro,hf,...]

1. ceilings: device-to-device copy bandwidth and bf16 matmul rate, measured here.
2. correctness (bf16): transformers models built from the presets with a seed; pdinfer loads
   the same weights (Llama-3.2-1B shape through save_pretrained + ``LLM(model=folder)``,
   Llama-3.1-8B shape through its state dict). Last-position prefill logits (whole prompt and
   in two chunks over the cached prefix) by relative error, and 32 greedy tokens per prompt.
3. speed on the 8B shape: decode tok/s at batch 1/64/256 (576-token prompts + 128 new: mean
   context 640), prefill tok/s at 8k tokens per step; transformers ``generate`` on the same
   workloads; each figure against its floor (decode: weight + KV bytes / copy bandwidth;
   prefill: FLOPs / matmul rate); GPU idle between decode steps at batch 256.
4. micro: attention kernel variants, and a per-kernel profile of one eager decode step.

Prints a table last; writes the log and a JSON of every figure to ``--out`` (default $OUT).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.models.presets import PRESETS  # noqa: E402
from pdinfer.worker.cache_engine import CacheEngine  # noqa: E402
from pdinfer.worker.step_input import SampleSpec, StepInput  # noqa: E402

FIG: dict[str, object] = {}  # every figure, for the JSON
ROWS: list[tuple[str, str, str, str]] = []  # the table: what, measured, reference, fraction
SEED = 1234
PROMPT_LEN, NEW_TOKENS = 576, 128  # mean decode context 640


def log(msg: str) -> None:
    print(msg, flush=True)


def row(what: str, measured: str, reference: str = "", fraction: str = "") -> None:
    ROWS.append((what, measured, reference, fraction))
    log(f"  {what}: {measured} {reference} {fraction}")


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the device (events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --- 1. ceilings -----------------------------------------------------------------------------
def ceilings() -> None:
    bufs = [torch.randint(0, 255, (4 << 30,), dtype=torch.uint8, device="cuda")]
    bufs.append(torch.empty_like(bufs[0]))
    FIG["copy_bw"] = 2 * bufs[0].numel() / timed(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ b)
    FIG["matmul_rate"] = 2 * 8192**3 / t
    row("copy bandwidth (read+write)", f"{FIG['copy_bw'] / 1e12:.2f} TB/s")
    row("bf16 matmul 8192^3", f"{FIG['matmul_rate'] / 1e12:.0f} TFLOP/s")
    free_memory()


# --- models --------------------------------------------------------------------------------
def hf_model(preset: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS[preset]), dtype=torch.bfloat16)
    return model.eval()


def pdinfer_like(hf, preset: str, via_folder: bool, **kwargs) -> LLM:
    if via_folder:
        folder = tempfile.mkdtemp(prefix="pdinfer-gpu-")
        hf.save_pretrained(folder)
        return LLM(model=folder, **kwargs)
    llm = LLM(model=f"preset:{preset}", load_format="dummy", **kwargs)
    llm.engine.model_runner.model.load_weights(hf.state_dict().items())
    return llm


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# --- 2. correctness ------------------------------------------------------------------------
def pdinfer_last_logits(llm: LLM, ids: list[int], chunks: int = 1) -> torch.Tensor:
    """Last-position logits through pdinfer's CUDA step path, on a scratch KV cache; with
    ``chunks`` > 1 the prompt is prefilled in pieces, each attending to the cached ones."""
    runner = llm.engine.model_runner
    bs = runner.cache.block_size
    num_blocks = -(-len(ids) // bs)
    scratch = CacheEngine(runner.spec, num_blocks, bs, runner.dtype, runner.device)
    table = list(range(num_blocks))[::-1]  # scrambled: blocks in reverse order
    bounds = [len(ids) * i // chunks for i in range(chunks + 1)]
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            inp = StepInput(step_id=-1, is_prompt=True, input_ids=ids[lo:hi], positions=list(range(lo, hi)),
                            query_lens=[hi - lo], context_lens=[hi], block_tables=[table],
                            samples=[SampleSpec(hi - lo - 1, 0.0, 0, 1.0, 0.0, 0, hi)])
            step = runner.gpu.builder.build(inp)
            hidden = runner.model(step.input_ids, step.positions, scratch.kv, step.meta)
        return runner.model.compute_logits(hidden[-1:])[0].float()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out, past = [], None
    x = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        for _ in range(n):
            o = hf(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            token = int(o.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]], device="cuda")
    return out


def correctness(name: str, hf, llm: LLM) -> None:
    vocab = hf.config.vocab_size
    errs = []
    for ids in random_prompts([17, 129, 300, 1000], vocab, seed=7):
        with torch.inference_mode():
            ref = hf(input_ids=torch.tensor([ids], device="cuda"), logits_to_keep=1).logits[0, -1].float()
        for chunks in (1, 2):
            ours = pdinfer_last_logits(llm, ids, chunks)
            errs.append(((ours - ref).norm() / ref.norm()).item())
    FIG[f"{name}_logit_rel_err"] = errs
    row(f"{name} prefill logits rel. err (max of 8)", f"{max(errs):.2e}", "< 2e-2",
        "PASS" if max(errs) < 2e-2 else "FAIL")
    lengths = [5, 17, 64, 100, 129, 200, 255, 300, 31, 47, 500, 777, 1000, 12, 1500, 90]
    prompts = random_prompts(lengths, vocab, seed=8)
    for i in (1, 5, 9):  # share a 128-token prefix with prompt 7 (prefix-cache hits)
        prompts[i] = prompts[7][:128] + prompts[i]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                          params, use_tqdm=False)]
    theirs = [hf_greedy(hf, p, 32) for p in prompts]
    agree = sum(a == b for a, b in zip(ours, theirs))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, theirs)]
    FIG[f"{name}_greedy"] = {"agree": agree, "of": len(prompts), "first_diff": first_diff,
                             "distinct_tokens": [len(set(t)) for t in theirs]}
    row(f"{name} greedy 32 tokens, prompts fully agreeing", f"{agree}/{len(prompts)}", ">= 90%",
        "PASS" if agree >= 0.9 * len(prompts) else "FAIL")
    log(f"  first differing position per prompt: {first_diff}")


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes a decode step reads: all weights but an untied input embedding, linear params)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read = total - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    return read, linear


# --- 3. speed ------------------------------------------------------------------------------
def decode_floor(llm: LLM, batch: int) -> float:
    """tok/s if a decode step only read weights and the mean context's K/V at copy bandwidth."""
    spec = llm.engine.spec
    read, _ = weight_bytes(llm.engine.model_runner.model)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    mean_ctx = PROMPT_LEN + (NEW_TOKENS + 1) / 2
    step_bytes = read + batch * mean_ctx * kv_per_token
    return batch / (step_bytes / FIG["copy_bw"])


def prefill_flops(llm: LLM, num_prompts: int, prompt_len: int) -> float:
    spec = llm.engine.spec
    _, linear = weight_bytes(llm.engine.model_runner.model)
    attn = 4 * spec.num_heads * spec.head_dim * spec.num_layers * num_prompts * prompt_len**2 / 2
    logits = 2 * spec.hidden_size * spec.vocab_size * num_prompts
    return 2 * linear * num_prompts * prompt_len + attn + logits


def bench_decode(llm: LLM, batch: int, events: bool = False) -> dict:
    engine, gpu = llm.engine, llm.engine.model_runner.gpu
    prompts = random_prompts([PROMPT_LEN] * batch, engine.spec.vocab_size, seed=100 + batch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tag = f"bench-{batch}-{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    counts: dict[str, int] = {}
    t0 = tokens0 = steps = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t0 is not None:
            steps += 1
        elif len(counts) == batch and min(counts.values()) >= 1:  # every prompt prefilled
            t0, tokens0, steps = time.perf_counter(), sum(counts.values()), 0
            if events:
                gpu.step_events = []
    elapsed = time.perf_counter() - t0
    result = {"tok_s": (sum(counts.values()) - tokens0) / elapsed, "step_ms": 1e3 * elapsed / max(1, steps)}
    if events:
        result.update(_idle(gpu.step_events))
        gpu.step_events = None
    return result


def _idle(marks) -> dict:
    torch.cuda.synchronize()
    busy = sum(s.elapsed_time(e) for s, e in marks)
    gaps = [max(0.0, marks[i][1].elapsed_time(marks[i + 1][0])) for i in range(len(marks) - 1)]
    span = marks[0][0].elapsed_time(marks[-1][1])
    return {"gpu_busy_ms_per_step": busy / len(marks), "idle_fraction": sum(gaps) / span,
            "max_gap_ms": max(gaps) if gaps else 0.0}


def graph_step_ms(llm: LLM, batch: int) -> float | None:
    """Device time of one decode step's graph replay (no host work in between)."""
    graphs = llm.engine.model_runner.gpu.graphs
    if graphs is None or batch not in graphs._graphs:
        return None
    graph, _ = graphs._graphs[batch]
    return 1e3 * timed(graph.replay, repeats=20)


def bench_prefill(llm: LLM, num_prompts: int, prompt_len: int, rounds: int = 3) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        prompts = random_prompts([prompt_len] * num_prompts, engine.spec.vocab_size, seed=500 + r)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill-{prompt_len}-{r}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return num_prompts * prompt_len / statistics.median(times[1:])


def hf_decode(hf, batch: int) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), device="cuda")

    def gen(n):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    gen(2)
    start = time.perf_counter()
    gen(1)
    t1 = time.perf_counter() - start
    start = time.perf_counter()
    gen(NEW_TOKENS)
    tn = time.perf_counter() - start
    return batch * (NEW_TOKENS - 1) / (tn - t1)


def hf_prefill(hf, num_prompts: int, prompt_len: int) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (num_prompts, prompt_len), device="cuda")

    def run():
        with torch.inference_mode():
            hf(input_ids=ids, logits_to_keep=1)

    return num_prompts * prompt_len / timed(run, repeats=3, warmup=1)


def speed(llm: LLM, hf) -> None:
    hf_tok = {}
    if hf is not None:
        for b in (1, 64, 256):
            hf_tok[b] = hf_decode(hf, b)
            log(f"  transformers decode batch {b}: {hf_tok[b]:.0f} tok/s")
        hf_tok["prefill"] = hf_prefill(hf, 4, 2048)
        FIG["hf"] = hf_tok
    for b in (1, 64, 256):
        res = bench_decode(llm, b, events=(b == 256))
        res["graph_step_ms"] = graph_step_ms(llm, b)
        floor = decode_floor(llm, b)
        FIG[f"decode_{b}"] = {**res, "floor_tok_s": floor}
        vs_hf = f", {res['tok_s'] / hf_tok[b]:.1f}x transformers ({hf_tok[b]:.0f})" if b in hf_tok else ""
        row(f"8B decode batch {b} (ctx 640)", f"{res['tok_s']:.0f} tok/s{vs_hf}",
            f"floor {floor:.0f}", f"{res['tok_s'] / floor:.0%} of floor")
        if res["graph_step_ms"]:
            step_floor = 1e3 * b / floor
            row(f"8B decode batch {b} graph replay", f"{res['graph_step_ms']:.2f} ms/step",
                f"floor {step_floor:.2f} ms", f"{step_floor / res['graph_step_ms']:.0%} of floor")
        if "idle_fraction" in res:
            row("GPU idle between decode steps, batch 256", f"{res['idle_fraction']:.1%}", "< 5%",
                f"busy {res['gpu_busy_ms_per_step']:.2f} ms/step, wall {res['step_ms']:.2f}")
    for n, length in ((4, 2048), (1, 8191)):  # 8191: room for the sampled token
        tok_s = bench_prefill(llm, n, length)
        rate = prefill_flops(llm, n, length) * tok_s / (n * length)
        FIG[f"prefill_{n}x{length}"] = {"tok_s": tok_s, "flop_s": rate}
        vs_hf = f", {tok_s / hf_tok['prefill']:.1f}x transformers" if n == 4 and "prefill" in hf_tok else ""
        row(f"8B prefill {n}x{length} tokens/step", f"{tok_s:.0f} tok/s{vs_hf}",
            f"{rate / 1e12:.0f} TFLOP/s", f"{rate / FIG['matmul_rate']:.0%} of matmul")


# --- 4. micro: kernel variants and a per-kernel profile ------------------------------------------
def micro(llm: LLM) -> None:
    runner = llm.engine.model_runner
    spec, bs = runner.spec, runner.cache.block_size
    batch, ctx = 64, PROMPT_LEN + 64
    per_seq = -(-ctx // bs)
    cache = CacheEngine(spec, batch * per_seq, bs, runner.dtype, runner.device)
    cache.kv.normal_()
    perm = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq)
    layer = cache.kv[:, 0]
    q = torch.randn(batch, spec.num_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
    ctx_t = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
    kv_bytes = batch * ctx * spec.num_kv_heads * spec.head_dim * 2 * 2
    default = dict(tp.DECODE_CONFIG)
    variants = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 3)]
    for block_n, warps, stages in variants:
        tp.DECODE_CONFIG.update(block_n=block_n, num_warps=warps, num_stages=stages)
        for splits in (1, 2, 4):
            t = timed(lambda s=splits: tp.decode_attention(q, layer, perm, ctx_t, spec.head_dim**-0.5, s))
            FIG[f"micro_decode_{block_n}_{warps}_{stages}_{splits}"] = kv_bytes / t
            log(f"  decode attn B={batch} ctx={ctx} n={block_n} w={warps} st={stages} splits={splits}: "
                f"{t * 1e6:.1f} us, {kv_bytes / t / 1e12:.2f} TB/s")
    tp.DECODE_CONFIG.update(default)
    _micro_prefill(runner, cache)
    _profile_decode_step(llm, cache, perm, ctx)


def _micro_prefill(runner, cache: CacheEngine) -> None:
    spec, bs = runner.spec, cache.block_size
    n, length = 4, 2048
    nb = length // bs
    meta = tp.GpuAttentionMetadata(
        False, torch.zeros(0, dtype=torch.int64, device="cuda"),
        torch.arange(n * nb, device="cuda").view(n, nb), torch.full((n,), length, device="cuda"),
        query_start=torch.arange(0, n * length + 1, length, device="cuda"),
        work_seq=torch.arange(n, device="cuda").repeat_interleave(length // tp.PREFILL_BLOCK_M),
        work_tile=torch.arange(length // tp.PREFILL_BLOCK_M, device="cuda").repeat(n),
        num_work=n * length // tp.PREFILL_BLOCK_M)
    q = torch.randn(n * length, spec.num_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
    flops = 4 * spec.num_heads * spec.head_dim * n * length**2 / 2
    default = dict(tp.PREFILL_CONFIG)
    for block_n, warps, stages in [(64, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 2), (32, 4, 3)]:
        tp.PREFILL_CONFIG.update(block_n=block_n, num_warps=warps, num_stages=stages)
        t = timed(lambda: tp.prefill_attention(q, cache.kv[:, 0], meta, spec.head_dim**-0.5), repeats=5)
        FIG[f"micro_prefill_{block_n}_{warps}_{stages}"] = flops / t
        log(f"  prefill attn {n}x{length} n={block_n} w={warps} st={stages}: {t * 1e3:.2f} ms, "
            f"{flops / t / 1e12:.0f} TFLOP/s")
    tp.PREFILL_CONFIG.update(default)
    qs = q.view(n, length, spec.num_heads, spec.head_dim).transpose(1, 2)
    ks = torch.randn(n, spec.num_kv_heads, length, spec.head_dim, device="cuda", dtype=runner.dtype)
    t = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True,
                                                                      enable_gqa=True), repeats=5)
    FIG["micro_prefill_sdpa"] = flops / t
    log(f"  torch sdpa (contiguous, causal) {n}x{length}: {t * 1e3:.2f} ms, {flops / t / 1e12:.0f} TFLOP/s")


def _profile_decode_step(llm: LLM, cache: CacheEngine, tables: torch.Tensor, ctx: int) -> None:
    runner = llm.engine.model_runner
    batch = tables.shape[0]
    rows = tables.tolist()
    inp = StepInput(step_id=-1, is_prompt=False, input_ids=[1] * batch, positions=[ctx - 1] * batch,
                    query_lens=[1] * batch, context_lens=[ctx] * batch, block_tables=rows,
                    samples=[SampleSpec(i, 0.0, 0, 1.0, 0.0, 0, ctx) for i in range(batch)])
    step = runner.gpu.builder.build(inp)

    def forward():
        with torch.inference_mode():
            hidden = runner.model(step.input_ids, step.positions, cache.kv, step.meta)
            runner.model.compute_logits(hidden)

    eager_ms = 1e3 * timed(forward, repeats=5)
    log(f"  eager decode step B={batch} ctx={ctx}: {eager_ms:.2f} ms")
    FIG["eager_decode_64_ms"] = eager_ms
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def role_profiles() -> None:
    """KV blocks a PROMPT and a COMPLETION engine get on the same device (measured peaks)."""
    from pdinfer import EngineArgs, LLMEngine

    for role in ("prompt", "completion"):
        engine = LLMEngine(EngineArgs(model="preset:llama-3.2-1b", load_format="dummy", engine_type=role,
                                      gpu_memory_utilization=0.5, max_model_len=8192,
                                      max_num_batched_tokens=8192, max_num_seqs=256))
        FIG[f"blocks_{role}"] = engine.num_blocks
        row(f"1B KV blocks, {role} role (util 0.5)", str(engine.num_blocks))
        engine.shutdown()
        del engine
        free_memory()


# --- main ----------------------------------------------------------------------------------
def run_section(name: str, fn, *args) -> None:
    log(f"\n== {name} ==")
    start = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - one failed section must not lose the others' figures
        log(traceback.format_exc())
        FIG.setdefault("errors", []).append(name)
        row(name, "ERROR (see log)")
    log(f"   ({name}: {time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: 1b, hf, micro, speed")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    engine_kwargs = dict(max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192)
    run_section("ceilings", ceilings)
    if "1b" not in skip:
        hf = hf_model("llama-3.2-1b")
        llm = pdinfer_like(hf, "llama-3.2-1b", via_folder=True, **engine_kwargs)
        FIG["1B_num_blocks"] = llm.engine.num_blocks
        run_section("correctness 1B", correctness, "1B", hf, llm)
        llm.engine.shutdown()
        del hf, llm
        free_memory()
        run_section("role profiles", role_profiles)
    hf = hf_model("llama-3.1-8b")
    llm = pdinfer_like(hf, "llama-3.1-8b", via_folder=False, gpu_memory_utilization=0.5, **engine_kwargs)
    run_section("correctness 8B", correctness, "8B", hf, llm)
    if "speed" not in skip:
        run_section("speed 8B", speed, llm, None if "hf" in skip else hf)
    if "micro" not in skip:
        del hf
        free_memory()
        run_section("micro", micro, llm)
    (out / "gpu_suite.json").write_text(json.dumps(FIG, indent=1, default=str))
    log("\n" + format_table())


def format_table() -> str:
    widths = [max(len(r[i]) for r in ROWS) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in ROWS]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
