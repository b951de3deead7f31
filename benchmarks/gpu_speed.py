"""The GPU suite's ceilings and speed section: copy bandwidth and matmul rate measured on the
device, the floors derived from them (decode: weight + KV bytes / copy bandwidth; prefill:
FLOPs / matmul rate), and pdinfer's and transformers' decode and prefill timings against them.
Run through ``gpu_suite.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.gpu_correctness import random_prompts
from benchmarks.gpu_micro import FIG, NEW_TOKENS, PROMPT_LEN, device_clocks, free_memory, log, row, timed
from pdinfer import LLM, SamplingParams
from pdinfer.engine.heap import startup_objects_frozen
from pdinfer.layers.fp8 import Fp8Linear


# --- 1. ceilings -----------------------------------------------------------------------------
def ceilings() -> None:
    bufs = [torch.randint(0, 255, (4 << 30,), dtype=torch.uint8, device="cuda")]
    bufs.append(torch.empty_like(bufs[0]))
    FIG["copy_bw"] = 2 * bufs[0].numel() / timed(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with device_clocks("matmul probe"):
        t = timed(lambda: a @ b)
    FIG["matmul_rate"] = 2 * 8192**3 / t
    # The same product back to back for about as long as a 4 x 2048 prefill step (the probe
    # above times one 1.4 ms product at a time, between synchronizations): what the tensor
    # cores sustain once the power limit has set the clock. Reported beside the probe, not
    # instead of it: prefill fractions stay against the probe.
    c = torch.empty_like(a)
    with device_clocks("matmul sustained"):
        t = timed(lambda: [torch.mm(a, b, out=c) for _ in range(SUSTAINED_PRODUCTS)], repeats=3, warmup=1)
    FIG["matmul_rate_sustained"] = SUSTAINED_PRODUCTS * 2 * 8192**3 / t
    row("copy bandwidth (read+write)", f"{FIG['copy_bw'] / 1e12:.2f} TB/s")
    row("bf16 matmul 8192^3", f"{FIG['matmul_rate'] / 1e12:.0f} TFLOP/s")
    row(f"bf16 matmul 8192^3, {SUSTAINED_PRODUCTS} back to back", f"{FIG['matmul_rate_sustained'] / 1e12:.0f} TFLOP/s")
    free_memory()


SUSTAINED_PRODUCTS = 128  # about 0.18 s of products at 780 TFLOP/s


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes a decode step reads: all weights but an untied input embedding, linear params)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read = total - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)
    linears = (torch.nn.Linear, Fp8Linear)
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, linears))
    return read, linear


# --- 3. speed ------------------------------------------------------------------------------
def decode_floor(llm: LLM, batch: int) -> float:
    """tok/s if a decode step only read weights and the mean context's K/V at copy bandwidth."""
    read, _ = weight_bytes(llm.engine.model_runner.model)
    return batch / ((read + kv_bytes(llm, batch)) / FIG["copy_bw"])


def kv_bytes(llm: LLM, batch: int) -> float:
    """The K/V bytes a decode step of ``batch`` sequences reads at the workload's mean context."""
    spec = llm.engine.spec
    kv_item = llm.engine.model_runner.require_cache().kv.element_size()  # 1 for an FP8 cache
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_item
    return batch * (PROMPT_LEN + (NEW_TOKENS + 1) / 2) * kv_per_token


def decode_roofline_ms(llm: LLM, batch: int) -> float:
    """A decode step's time if each of its kernels ran at its own roofline, one after another:
    every linear (the logits projection too) at max(weight bytes / copy bandwidth, FLOPs / the
    matmul probe), attention at its K/V bytes / copy bandwidth; norms and the rest count nothing.

    The byte floor (``decode_floor``) is lower wherever a step's GEMMs are compute-bound: at
    M = 256 on an H200 their FLOPs take longer than their bytes, and only two micro-batches
    (every weight read twice) could overlap them with attention's reads. This is the floor of a
    step that runs its kernels in order."""
    model = llm.engine.model_runner.model
    seconds = kv_bytes(llm, batch) / FIG["copy_bw"]
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, Fp8Linear)):
            w = m.weight
            rate = FIG["matmul_rate"] * (2 if w.element_size() == 1 else 1)  # FP8 tensor cores: twice
            seconds += max(w.numel() * w.element_size() / FIG["copy_bw"], 2 * batch * w.numel() / rate)
    return 1e3 * seconds


def prefill_flops(llm: LLM, num_prompts: int, prompt_len: int) -> float:
    spec = llm.engine.spec
    _, linear = weight_bytes(llm.engine.model_runner.model)
    attn = 4 * spec.num_heads * spec.head_dim * spec.num_layers * num_prompts * prompt_len**2 / 2
    logits = 2 * spec.hidden_size * spec.vocab_size * num_prompts
    return 2 * linear * num_prompts * prompt_len + attn + logits


def bench_decode(llm: LLM, batch: int, events: bool = False) -> dict:
    engine, gpu = llm.engine, llm.engine.model_runner
    prompts = random_prompts([PROMPT_LEN] * batch, engine.spec.vocab_size, seed=100 + batch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tag = f"bench-{batch}-{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    counts: dict[str, int] = {}
    t0 = tokens0 = steps = None
    preempted = engine.scheduler.num_preemptions
    with startup_objects_frozen():  # as LLM.generate runs the loop
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
    result = {
        "tok_s": (sum(counts.values()) - tokens0) / elapsed,
        "step_ms": 1e3 * elapsed / max(1, steps),
        "preemptions": engine.scheduler.num_preemptions - preempted,  # recomputes: the cache was too small
    }
    if events:
        result.update(_idle(gpu.step_events))
        gpu.step_events = None
    return result


def _idle(marks) -> dict:
    torch.cuda.synchronize()
    busy = sum(s.elapsed_time(e) for s, e in marks)
    gaps = [max(0.0, marks[i][1].elapsed_time(marks[i + 1][0])) for i in range(len(marks) - 1)]
    span = marks[0][0].elapsed_time(marks[-1][1])
    return {
        "gpu_busy_ms_per_step": busy / len(marks),
        "idle_fraction": sum(gaps) / span,
        "max_gap_ms": max(gaps) if gaps else 0.0,
    }


def graph_step_ms(llm: LLM, batch: int) -> float | None:
    """Device time of one decode step's graph replay (no host work in between)."""
    graphs = llm.engine.model_runner.graphs
    if graphs is None or batch not in graphs._graphs:
        return None
    graph, _ = graphs._graphs[batch]
    return 1e3 * timed(graph.replay, repeats=20)


def bench_prefill(llm: LLM, num_prompts: int, prompt_len: int, rounds: int = 3, seed: int | None = None) -> float:
    """Prefill tok/s, median of ``rounds``. ``seed``: the prompts'; by default one of the shape's
    own. Prompts drawn from one seed share their first tokens whatever their lengths (a 1 x 8191
    prompt began with the 4 x 2048 run's first prompt and met its 2,048 tokens in the prefix
    cache until 2026-12-06), so no two shapes, rounds or runs may share one."""
    seed = 10_000 * num_prompts + prompt_len if seed is None else seed
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        prompts = random_prompts([prompt_len] * num_prompts, engine.spec.vocab_size, seed=seed + r)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with startup_objects_frozen():
            for i, p in enumerate(prompts):
                engine.add_request(
                    f"prefill-{prompt_len}-{r}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params
                )
            while engine.has_unfinished_requests():
                engine.step()
        times.append(time.perf_counter() - start)
    return num_prompts * prompt_len / statistics.median(times[1:])


def hf_decode(hf, batch: int) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), device="cuda")

    def gen(n):
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
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
        row(
            f"8B decode batch {b} (ctx 640)",
            f"{res['tok_s']:.0f} tok/s{vs_hf}",
            f"floor {floor:.0f}",
            f"{res['tok_s'] / floor:.0%} of floor"
            + (f" ({res['preemptions']} preemptions)" if res["preemptions"] else ""),
        )
        roofline = decode_roofline_ms(llm, b)
        FIG[f"decode_{b}"]["roofline_step_ms"] = roofline
        if res["graph_step_ms"]:
            step_floor = 1e3 * b / floor
            row(
                f"8B decode batch {b} graph replay",
                f"{res['graph_step_ms']:.2f} ms/step",
                f"floor {step_floor:.2f} ms, kernel rooflines {roofline:.2f} ms",
                f"{step_floor / res['graph_step_ms']:.0%} of floor, {roofline / res['graph_step_ms']:.0%} of the rooflines",
            )
        if "idle_fraction" in res:
            row(
                "GPU idle between decode steps, batch 256",
                f"{res['idle_fraction']:.1%}",
                "< 5%",
                f"busy {res['gpu_busy_ms_per_step']:.2f} ms/step, wall {res['step_ms']:.2f}",
            )
    for n, length in ((4, 2048), (1, 8191)):  # 8191: room for the sampled token
        with device_clocks(f"prefill {n}x{length}"):
            tok_s = bench_prefill(llm, n, length)
        rate = prefill_flops(llm, n, length) * tok_s / (n * length)
        FIG[f"prefill_{n}x{length}"] = {"tok_s": tok_s, "flop_s": rate}
        vs_hf = f", {tok_s / hf_tok['prefill']:.1f}x transformers" if n == 4 and "prefill" in hf_tok else ""
        row(
            f"8B prefill {n}x{length} tokens/step",
            f"{tok_s:.0f} tok/s{vs_hf}",
            f"{rate / 1e12:.0f} TFLOP/s",
            f"{rate / FIG['matmul_rate']:.0%} of matmul, {rate / FIG['matmul_rate_sustained']:.0%} of the sustained rate",
        )
