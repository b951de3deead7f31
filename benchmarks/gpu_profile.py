"""Where the GPU's decode and prefill steps go (docs/performance.md, "Where the steps go").

One call on the device: a per-kernel table of one eager decode step at batch 64 and 256
(context 640) and of a 4 x 2048 and a 1 x 8191 prefill through the engine; the host's Python
time a batch-256 decode step (cProfile); and the prefill attention kernel timed alone with the
tiles in launch order and heaviest first. Llama-3.1-8B shape, dummy bf16 weights.

    python benchmarks/gpu_profile.py [kernels] [host] [prefill] [trace]   (default: the first three)

``trace`` writes Chrome traces (CPU and device timelines) of one 4 x 2048 prefill and of three
batch-64 decode steps through the engine to ``$OUT`` (or the working directory), for the gaps
between kernels that a per-kernel table does not show.
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import graph_timed, llama_8b  # noqa: E402
from pdinfer import SamplingParams  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp
from pdinfer.worker.cache_engine import CacheEngine
from pdinfer.worker.step_input import SampleSpec, StepInput


def log(*parts) -> None:
    print(*parts, flush=True)


def graph_us(fn) -> float:
    return graph_timed(fn) * 1e6


def kernel_table(prof, label, steps=1):
    agg = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t <= 0:
                continue
            agg[e.key][0] += t / steps
            agg[e.key][1] += e.count // steps
    total = sum(v[0] for v in agg.values())
    log(f"== {label}: {total / 1e3:.2f} ms of kernels, {sum(v[1] for v in agg.values())} launches")
    for k, (t, c) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:18]:
        log(f"  {t / 1e3:7.3f} ms {c:5d}x {t / max(c, 1):8.1f} us  {k[:90]}")


def decode_profile(llm, batch, ctx=640):
    runner = llm.engine.model_runner
    spec, bs = runner.spec, runner.cache.block_size
    per = -(-ctx // bs)
    cache = CacheEngine(spec, batch * per, bs, runner.dtype, runner.device)
    cache.kv.normal_()
    rows = torch.randperm(batch * per).view(batch, per).tolist()
    inp = StepInput(
        step_id=-1,
        is_prompt=False,
        input_ids=[1] * batch,
        positions=[ctx - 1] * batch,
        query_lens=[1] * batch,
        context_lens=[ctx] * batch,
        block_tables=rows,
        samples=[SampleSpec(i, 0.0, 0, 1.0, 0.0, 0, ctx) for i in range(batch)],
    )
    graphs = runner.graphs
    splits = graphs.num_splits(batch) if graphs is not None else None
    step = runner.builder.build(inp, pad_to=batch, num_splits=splits)

    def fwd():
        with torch.inference_mode():
            h = runner.model(step.input_ids, step.positions, cache.kv, step.meta)
            runner.model.compute_logits(h)

    t = graph_us(fwd)
    log(f"decode B={batch} eager-in-graph step {t / 1e3:.2f} ms (splits {splits})")
    fwd()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
    kernel_table(prof, f"decode{batch}", 3)


def prefill_profile(llm, n, length):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def once(tag):
        for i in range(n):
            p = torch.randint(0, engine.spec.vocab_size, (length,)).tolist()
            engine.add_request(f"p{tag}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps

    once("w")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    s = once("t")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    log(f"prefill {n}x{length}: wall {wall * 1e3:.1f} ms in {s} steps")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        once("p")
        torch.cuda.synchronize()
    kernel_table(prof, f"prefill{n}x{length}")


def host_profile(llm, batch=256):
    engine = llm.engine
    gpu = engine.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        engine.add_request(
            f"h{i}", {"prompt_token_ids": torch.randint(0, 128000, (576,), generator=g).tolist()}, params
        )
    seen = {}
    while len(seen) < batch:
        for o in engine.step():
            seen[o.request_id] = 1
    for _ in range(5):
        engine.step()
    gpu.step_events = []
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(60):
        engine.step()
    prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 60
    ev = gpu.step_events
    gpu.step_events = None
    busy = sum(s.elapsed_time(e) for s, e in ev) / len(ev)
    log(f"B={batch}: wall {wall * 1e3:.2f} ms/step (under cProfile), device busy {busy:.2f} ms/step")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
        log(s.getvalue()[-6000:])
    while engine.has_unfinished_requests():
        engine.step()
    # the same without the profiler
    for i in range(batch):
        engine.add_request(
            f"k{i}", {"prompt_token_ids": torch.randint(0, 128000, (576,), generator=g).tolist()}, params
        )
    seen = {}
    while len(seen) < batch:
        for o in engine.step():
            seen[o.request_id] = 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(60):
        engine.step()
    torch.cuda.synchronize()
    log(f"B={batch}: wall {(time.perf_counter() - t0) / 60 * 1e3:.2f} ms/step without the profiler")
    while engine.has_unfinished_requests():
        engine.step()


def prefill_variants(llm):
    runner = llm.engine.model_runner
    spec = runner.spec
    bs = 16
    cache = CacheEngine(spec, 8192 // bs + 8, bs, runner.dtype, runner.device)
    cache.kv.normal_()
    layer, scale = cache.kv[:, 0], spec.head_dim**-0.5

    for n, length in ((4, 2048), (1, 8191)):
        nb = -(-length // bs)
        tiles = -(-length // tp.PREFILL_BLOCK_M)
        ws = np.repeat(np.arange(n), tiles)
        wt = np.tile(np.arange(tiles), n)
        heavy = np.argsort(-wt, kind="stable")  # the engine's order (gpu_input)
        q = torch.randn(n * length, spec.num_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
        flops = 4 * spec.num_heads * spec.head_dim * n * length**2 / 2
        for order_name, order in (("natural", np.arange(ws.size)), ("heavy-first", heavy)):
            meta = tp.GpuAttentionMetadata(
                False,
                torch.zeros(0, dtype=torch.int64, device="cuda"),
                torch.arange(n * nb, device="cuda").view(n, nb),
                torch.full((n,), length, device="cuda"),
                query_start=torch.arange(0, n * length + 1, length, device="cuda"),
                work_seq=torch.tensor(ws[order], device="cuda"),
                work_tile=torch.tensor(wt[order], device="cuda"),
                num_work=int(ws.size),
            )
            for cfg in ({"num_stages": 2}, {"num_stages": 3}, {"block_n": 64, "num_stages": 3}):
                saved = dict(tp.PREFILL_CONFIG)
                tp.PREFILL_CONFIG.update(cfg)
                try:
                    t = graph_us(lambda q=q, meta=meta: tp.prefill_attention(q, layer, meta, scale)) / 1e6
                    log(
                        f"prefill attn {n}x{length} {order_name} {cfg}: {t * 1e6:.0f} us {flops / t / 1e12:.0f} TFLOP/s"
                    )
                except Exception as e:
                    log(f"prefill attn {n}x{length} {order_name} {cfg}: FAIL {type(e).__name__} {str(e)[:120]}")
                    torch.cuda.synchronize()
                tp.PREFILL_CONFIG.clear()
                tp.PREFILL_CONFIG.update(saved)


def traces(llm) -> None:
    import os

    out = os.environ.get("OUT", ".")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name, n, length in (("prefill_4x2048", 4, 2048), ("decode_64", 64, 576)):
        for tag in ("warm", "trace"):
            for i in range(n):
                p = torch.randint(0, engine.spec.vocab_size, (length,)).tolist()
                engine.add_request(f"{name}-{tag}-{i}", {"prompt_token_ids": p}, params)
            while name.startswith("decode") and sum(s.num_output_tokens > 0 for s in engine.scheduler.running) < n:
                engine.step()  # the decode trace starts once every prompt is prefilled
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(1 if name.startswith("prefill") else 3):
                    engine.step()
                torch.cuda.synchronize()
            while engine.has_unfinished_requests():
                engine.step()
        prof.export_chrome_trace(f"{out}/{name}.json")
        log(f"trace {name}: {out}/{name}.json")


def main() -> None:
    which = set(sys.argv[1:]) or {"kernels", "host", "prefill"}
    log(torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d %H:%M"))
    llm = llama_8b()
    if "kernels" in which:
        for batch in (64, 256):
            decode_profile(llm, batch)
        for n, length in ((4, 2048), (1, 8191)):
            prefill_profile(llm, n, length)
    if "host" in which:
        host_profile(llm)
    if "prefill" in which:
        prefill_variants(llm)
    if "trace" in which:
        traces(llm)


if __name__ == "__main__":
    main()
