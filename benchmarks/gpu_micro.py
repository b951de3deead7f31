"""Helpers of the GPU suite (figures, table rows, device timers) and its kernel-level parts:
attention kernel variants timed inside CUDA graphs (no launch overhead), a per-kernel profile of
one eager decode step, and the KV blocks each engine role gets. Run through ``gpu_suite.py``.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import statistics
import subprocess
import time

import torch

from pdinfer.layers.attention import triton_paged as tp
from pdinfer.worker.cache_engine import CacheEngine
from pdinfer.worker.step_input import SampleSpec, StepInput


def llama_8b(gpu_memory_utilization: float = 0.5):
    """The speed benchmarks' engine: the Llama-3.1-8B shape with dummy bf16 weights, steps of up
    to 256 sequences or 8,192 tokens."""
    from pdinfer import LLM

    return LLM(
        model="preset:llama-3.1-8b",
        load_format="dummy",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=8192,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )


FIG: dict[str, object] = {}  # every figure, for the JSON
ROWS: list[tuple[str, str, str, str]] = []  # the table: what, measured, reference, fraction
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


@contextlib.contextmanager
def device_clocks(label: str, period_ms: int = 20):
    """The GPU's SM clock, power and temperature while the block runs, sampled by ``nvidia-smi``
    every ``period_ms`` (its first sample comes about 0.1 s in); their means are logged and kept
    in ``FIG["clocks"][label]``. A rate probe of a few milliseconds runs at the boost clock; a
    190 ms prefill step may not, and this says which clock each figure had. Does nothing
    without ``nvidia-smi``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        yield
        return
    query = "--query-gpu=clocks.sm,power.draw,temperature.gpu"
    cmd = [smi, query, "--format=csv,noheader,nounits", "-lms", str(period_ms), "-i", str(torch.cuda.current_device())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    start = time.perf_counter()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        proc.terminate()
        out, _ = proc.communicate()
        samples = []
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                samples.append([float(x) for x in line.split(",")])
        if samples:
            clock, power, temp = (statistics.mean(col) for col in zip(*samples))
            low = min(s[0] for s in samples)
            FIG.setdefault("clocks", {})[label] = {  # type: ignore[union-attr]
                "sm_mhz": clock,
                "sm_mhz_min": low,
                "power_w": power,
                "temp_c": temp,
                "samples": len(samples),
            }
            log(
                f"  clocks [{label}]: SM {clock:.0f} MHz (min {low:.0f}), {power:.0f} W, {temp:.0f} C, "
                f"{len(samples)} samples over {seconds:.2f} s"
            )


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def graph_timed(fn) -> float:
    """Median seconds of ``fn`` replayed from a CUDA graph (kernel time, no launch gaps).

    Triton runs ``fn`` on a stream of its own, which does not wait for the default stream: the
    inputs made there (a step's metadata, copied without blocking; ``randperm`` block tables)
    must be complete first. Without the synchronize, the first call read them half-written
    (an out-of-range embedding index and an illegal address, H100, 2026-12-06)."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3


# --- 4. micro: kernel variants and a per-kernel profile ------------------------------------------
def micro(llm) -> None:
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
            t = graph_timed(lambda s=splits: tp.decode_attention(q, layer, perm, ctx_t, spec.head_dim**-0.5, s))
            FIG[f"micro_decode_{block_n}_{warps}_{stages}_{splits}"] = kv_bytes / t
            log(
                f"  decode attn B={batch} ctx={ctx} n={block_n} w={warps} st={stages} splits={splits}: "
                f"{t * 1e6:.1f} us, {kv_bytes / t / 1e12:.2f} TB/s"
            )
    tp.DECODE_CONFIG.update(default)
    _micro_prefill(runner, cache)
    _profile_decode_step(llm, cache, perm, ctx)


def _micro_prefill(runner, cache: CacheEngine) -> None:
    spec, bs = runner.spec, cache.block_size
    n, length = 4, 2048
    nb = length // bs
    meta = tp.GpuAttentionMetadata(
        False,
        torch.zeros(0, dtype=torch.int64, device="cuda"),
        torch.arange(n * nb, device="cuda").view(n, nb),
        torch.full((n,), length, device="cuda"),
        query_start=torch.arange(0, n * length + 1, length, device="cuda"),
        work_seq=torch.arange(n, device="cuda").repeat_interleave(length // tp.PREFILL_BLOCK_M),
        work_tile=torch.arange(length // tp.PREFILL_BLOCK_M, device="cuda").repeat(n),
        num_work=n * length // tp.PREFILL_BLOCK_M,
    )
    q = torch.randn(n * length, spec.num_heads, spec.head_dim, device="cuda", dtype=runner.dtype)
    flops = 4 * spec.num_heads * spec.head_dim * n * length**2 / 2
    default = dict(tp.PREFILL_CONFIG)
    for block_n, warps, stages in [(64, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 2), (32, 4, 3)]:
        tp.PREFILL_CONFIG.update(block_n=block_n, num_warps=warps, num_stages=stages)
        t = graph_timed(lambda: tp.prefill_attention(q, cache.kv[:, 0], meta, spec.head_dim**-0.5))
        FIG[f"micro_prefill_{block_n}_{warps}_{stages}"] = flops / t
        log(
            f"  prefill attn {n}x{length} n={block_n} w={warps} st={stages}: {t * 1e3:.2f} ms, "
            f"{flops / t / 1e12:.0f} TFLOP/s"
        )
    tp.PREFILL_CONFIG.update(default)
    qs = q.view(n, length, spec.num_heads, spec.head_dim).transpose(1, 2)
    ks = torch.randn(n, spec.num_kv_heads, length, spec.head_dim, device="cuda", dtype=runner.dtype)
    t = graph_timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True)
    )
    FIG["micro_prefill_sdpa"] = flops / t
    log(f"  torch sdpa (contiguous, causal) {n}x{length}: {t * 1e3:.2f} ms, {flops / t / 1e12:.0f} TFLOP/s")


def _profile_decode_step(llm, cache: CacheEngine, tables: torch.Tensor, ctx: int) -> None:
    runner = llm.engine.model_runner
    batch = tables.shape[0]
    rows = tables.tolist()
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
    step = runner.builder.build(inp)

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
    """KV blocks a PROMPT engine (prefill budget 16k tokens) and a COMPLETION engine (256
    sequences) get on the same device, from their measured peaks, on the 1B and 8B shapes.
    Checks that the difference is what their peaks and graph reserves make (net of the free
    memory each saw), and reports whether the CE gets more."""
    for preset, label in (("llama-3.2-1b", "1B"), ("llama-3.1-8b", "8B")):
        prof = {role: _role_profile(preset, role) for role in ("prompt", "completion")}
        FIG[f"profiles_{label}"] = prof
        pe, ce = prof["prompt"], prof["completion"]
        for role, p in prof.items():
            row(
                f"{label} KV blocks, {role} role (util 0.5)",
                str(p["num_blocks"]),
                f"peak {p['peak'] / 2**20:.0f} MiB, graph room {p['reserve'] / 2**20:.0f} MiB",
            )
        # blocks = (free - kept - peak - reserve) // per_block
        need = {r: (p["peak"] + p["reserve"]) / p["per_block"] for r, p in prof.items()}
        expected = need["prompt"] - need["completion"] + (ce["free"] - pe["free"]) / pe["per_block"]
        got = ce["num_blocks"] - pe["num_blocks"]
        consistent = abs(got - expected) <= 1
        row(
            f"{label} KV blocks, CE minus PE",
            f"{got} (at equal free memory {need['prompt'] - need['completion']:.0f})",
            f"from the peaks {expected:.0f}",
            ("PASS" if consistent else "FAIL") + (", CE more" if got > 0 else ", CE fewer"),
        )
        if not consistent:
            FIG.setdefault("errors", []).append(f"role profiles {label}")


def _role_profile(preset: str, role: str) -> dict:
    from pdinfer import EngineArgs, LLMEngine

    engine = LLMEngine(
        EngineArgs(
            model=f"preset:{preset}",
            load_format="dummy",
            engine_type=role,
            gpu_memory_utilization=0.5,
            max_model_len=16384,
            max_num_batched_tokens=16384,
            max_num_seqs=256,
        )
    )
    profile = dict(engine.model_runner.kv_profile)
    engine.shutdown()
    del engine
    free_memory()
    return profile


def kv_staging(llm) -> None:
    """The hand-off helpers: pinned-host writes and reads of blocks give back what went in,
    and how fast (host link). Uses the highest block ids; run it last (it overwrites them)."""
    import time

    cache = llm.engine.model_runner.cache
    n = 256
    ids = list(range(cache.num_blocks - n, cache.num_blocks))
    order = ids[1::2] + ids[::2]  # two interleaved sets: many one-block runs
    data = torch.randn((n, *cache.block_shape)).to(cache.dtype).pin_memory()
    cache.write_blocks_async(ids, data).synchronize()
    host, event = cache.read_blocks_async(order)
    event.synchronize()
    expect = torch.cat([data[1::2], data[::2]])
    same = torch.equal(host, expect) and torch.equal(cache.read_blocks(ids[:4]).cpu(), data[:4])
    nbytes = data.numel() * data.element_size()
    start = time.perf_counter()
    _, event = cache.read_blocks_async(ids, out=host)  # a reused pinned buffer, as a sender keeps
    event.synchronize()
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    cache.write_blocks_async(ids, data).synchronize()
    write_s = time.perf_counter() - start
    FIG["kv_staging"] = {"roundtrip_equal": same, "d2h_GBps": nbytes / read_s / 1e9, "h2d_GBps": nbytes / write_s / 1e9}
    row(
        "KV staging (pinned) read/write 256 blocks",
        "equal" if same else "MISMATCH",
        f"D2H {nbytes / read_s / 1e9:.0f} GB/s, H2D {nbytes / write_s / 1e9:.0f} GB/s",
    )
