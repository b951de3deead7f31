"""MLA on CUDA (DeepSeek-V2/V3): the Triton kernels checked and timed on a GPU, then DeepSeek-V2-Lite
(dummy weights) end to end.

    python benchmarks/gpu_mla.py [--out DIR] [--budget-s 220]
    TRITON_INTERPRET=1 python benchmarks/gpu_mla.py --tiny      # the script's code paths, on a CPU

1. check (bf16): ``mla_decode_attention`` against a float32 reference at DeepSeek-V2-Lite's shape
   (16 heads, latent 512, rope 64) for batch 1/64/256 and contexts 640 and 4096 (scrambled
   block tables, some contexts ending mid-block), with the eager and the CUDA-graph split
   counts; the whole Triton backend (W_UK, kernel, W_UV; the decompressing prefill over a cached
   prefix) against the torch backend in float32. Max relative error per sequence, PASS/FAIL.
2. kernel speed: the decode kernel's time (CUDA-graph replay) against its floor, the latent
   bytes it must read (batch x context x 576 x 2 per layer) at 4.3 TB/s; one layer's prefill
   attention (4k tokens) against its FLOPs at 790 TFLOP/s; a few launch configs of both.
3. model: ``LLM(model="preset:deepseek-v2-lite", load_format="dummy")``: decode tok/s at batch
   1 and 64 (576-token prompts), prefill tok/s of one 4k-token prompt. The MoE layers' torch
   path syncs on the host, so the engine runs without CUDA graphs (the row says which).

Each section runs in try/except (a traceback, then the next section); the model section stops
at ``--budget-s`` seconds since start. Prints a table last and writes every figure to
``$OUT/gpu_mla.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdinfer.layers.attention import triton_mla as tm  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402
from pdinfer.layers.attention.mla import MLAPagedAttention, build_mla_metadata  # noqa: E402
from pdinfer.worker.gpu_input import GpuInputBuilder  # noqa: E402
from pdinfer.worker.step_input import StepInput  # noqa: E402

HBM_BYTES_S, MATMUL_FLOP_S = 4.3e12, 790e12  # H200, measured (DESIGN.md section 5)
FIG: dict[str, object] = {}
ROWS: list[tuple[str, str, str, str]] = []
START = time.perf_counter()


class Shape:
    def __init__(self, tiny: bool):
        self.heads, self.latent, self.rope, self.nope, self.v = (
            (20, 48, 16, 16, 24) if tiny else (16, 512, 64, 128, 128)
        )
        self.batches = (1, 4) if tiny else (1, 64, 256)
        self.contexts = (17, 100) if tiny else (640, 4096)
        self.block_size = 16
        self.prefill = ([30, 20, 1], [30, 50, 40]) if tiny else ([300, 1000, 17], [300, 1500, 600])
        self.prefill_len = 64 if tiny else 4096
        self.scale = (self.nope + self.rope) ** -0.5
        # Triton's interpreter emulates bfloat16 dots incorrectly: float16 there
        self.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def log(msg: str) -> None:
    print(msg, flush=True)


def row(what: str, measured: str, reference: str = "", verdict: str = "") -> None:
    ROWS.append((what, measured, reference, verdict))
    log(f"  {what}: {measured} {reference} {verdict}")


def device_time(fn) -> float:
    """Seconds of one ``fn`` on the device: CUDA-graph replay (no launch gaps), or one timed call."""
    if torch.cuda.is_available():
        from triton.testing import do_bench_cudagraph

        torch.cuda.synchronize()  # its stream does not wait for the inputs (gpu_micro.graph_timed)
        return do_bench_cudagraph(fn, rep=30, return_mode="median") / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- 1 + 2: the decode kernel ----------------------------------------------------------------------
def latent_case(s: Shape, batch: int, ctx: int, dev: torch.device, seed: int = 0):
    """A random latent cache of one layer, scrambled block tables and bf16 queries."""
    g = torch.Generator(device=dev).manual_seed(seed)
    per_seq = -(-ctx // s.block_size)
    dim = s.latent + s.rope
    cache = torch.randn(batch * per_seq, 1, 1, s.block_size, 1, dim, device=dev, generator=g).to(s.dtype)
    tables = torch.randperm(batch * per_seq, device=dev, generator=g).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
    lens[1::3] -= 5  # some contexts end mid-block
    q_lat = torch.randn(batch, s.heads, s.latent, device=dev, generator=g).to(s.dtype)
    q_rope = torch.randn(batch, s.heads, s.rope, device=dev, generator=g).to(s.dtype)
    return cache[:, 0], tables, lens, q_lat, q_rope


def ref_decode(s: Shape, layer, tables, lens, q_lat, q_rope, chunk: int = 32) -> torch.Tensor:
    """The weighted latent sums [B, H, latent] in float32, a few sequences at a time."""
    outs = []
    for lo in range(0, tables.shape[0], chunk):
        bt, ln = tables[lo : lo + chunk], lens[lo : lo + chunk]
        vec = layer[:, 0, :, 0][bt].flatten(1, 2).float()  # [b, L, latent + rope]
        q = torch.cat([q_lat[lo : lo + chunk], q_rope[lo : lo + chunk]], dim=-1).float()
        scores = torch.bmm(q, vec.transpose(1, 2)) * s.scale
        scores.masked_fill_(torch.arange(vec.shape[1], device=vec.device)[None, None, :] >= ln[:, None, None], -1e30)
        outs.append(torch.bmm(scores.softmax(-1), vec[..., : s.latent]))
    return torch.cat(outs)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-sequence relative error (norm of the difference over the reference's)."""
    diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
    return float((diff / ref.float().flatten(1).norm(dim=1).clamp_min(1e-30)).max())


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def decode_check_and_speed(s: Shape, dev: torch.device) -> None:
    for batch in s.batches:
        for ctx in s.contexts:
            _decode_case(s, dev, batch, ctx)


def _decode_case(s: Shape, dev: torch.device, batch: int, ctx: int) -> None:
    layer, tables, lens, q_lat, q_rope = latent_case(s, batch, ctx, dev, seed=batch + ctx)
    ref = ref_decode(s, layer, tables, lens, q_lat, q_rope)
    programs = tm.mla_decode_programs(s.heads)
    eager = tp.decode_num_splits(batch, programs, ctx, num_sms())
    graph = tp.decode_num_splits(batch, programs, None, num_sms())

    def run(splits: int) -> torch.Tensor:
        return tm.mla_decode_attention(q_lat, q_rope, layer, tables, lens, s.scale, splits)

    for splits in sorted({eager, graph}):
        err = max_rel_err(run(splits), ref)
        FIG[f"decode_err_b{batch}_ctx{ctx}_s{splits}"] = err
        row(
            f"decode kernel B={batch} ctx={ctx} splits={splits}",
            f"max rel err {err:.1e}",
            "< 1e-2",
            _verdict(err < 1e-2),
        )
    t = device_time(lambda: run(eager))
    floor = batch * ctx * (s.latent + s.rope) * 2 / HBM_BYTES_S
    FIG[f"decode_us_b{batch}_ctx{ctx}"] = {"us": t * 1e6, "floor_us": floor * 1e6, "splits": eager}
    row(
        f"decode kernel B={batch} ctx={ctx} time",
        f"{t * 1e6:.1f} us",
        f"floor {floor * 1e6:.1f} us",
        f"{floor / t:.0%} of floor",
    )


def sweep(name: str, config: dict, variants: list[tuple[int, int, int]], fn, floor_s: float) -> None:
    """Time ``fn`` under each (block_n, num_warps, num_stages) of ``config``; the default comes back after."""
    default = dict(config)
    try:
        for block_n, warps, stages in variants[: 2 if not torch.cuda.is_available() else None]:
            config.update(block_n=block_n, num_warps=warps, num_stages=stages)
            tag = f"{name} n={block_n} w={warps} st={stages}"
            try:
                t = device_time(fn)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: the other variants still count
                log(f"  {tag}: {type(exc).__name__}: {exc}"[:300])
                continue
            FIG[f"cfg_{name}_{block_n}_{warps}_{stages}"] = t * 1e6
            log(f"  {tag}: {t * 1e6:.1f} us, {floor_s / t:.0%} of floor")
    finally:
        config.update(default)


def launch_configs(s: Shape, dev: torch.device) -> None:
    """A few launch configs of both kernels (``MLA_DECODE_CONFIG``, ``MLA_PREFILL_CONFIG``: the defaults)."""
    _decode_configs(s, dev)
    n = s.prefill_len
    _, _, run_prefill = backend_case(s, _step([n], [n], s.block_size, True), dev)
    log(f"  prefill, one layer, {n} tokens:")
    variants = [(64, 8, 2), (32, 4, 2), (32, 8, 2), (64, 4, 2), (128, 8, 2), (64, 8, 3)]
    sweep("prefill", tm.MLA_PREFILL_CONFIG, variants, run_prefill, _prefill_flops(s, n) / MATMUL_FLOP_S)


def _decode_configs(s: Shape, dev: torch.device) -> None:
    batch, ctx = s.batches[len(s.batches) // 2], s.contexts[-1]
    layer, tables, lens, q_lat, q_rope = latent_case(s, batch, ctx, dev)
    splits = tp.decode_num_splits(batch, tm.mla_decode_programs(s.heads), ctx, num_sms())
    log(f"  decode B={batch} ctx={ctx}, {splits} splits:")
    variants = [(32, 4, 2), (16, 4, 2), (64, 4, 2), (32, 8, 2), (64, 8, 2), (32, 4, 3)]

    def run() -> torch.Tensor:
        return tm.mla_decode_attention(q_lat, q_rope, layer, tables, lens, s.scale, splits)

    sweep("decode", tm.MLA_DECODE_CONFIG, variants, run, batch * ctx * (s.latent + s.rope) * 2 / HBM_BYTES_S)


def _prefill_flops(s: Shape, n: int) -> float:
    """Causal attention over n tokens plus ``kv_b_proj`` of their latents, one layer."""
    return 2 * s.heads * (n * n / 2) * (s.nope + s.rope + s.v) + 2 * n * s.latent * s.heads * (s.nope + s.v)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# --- 1 + 2: the whole backend, against the torch backend ---------------------------------------------
def _step(query_lens: list[int], context_lens: list[int], block_size: int, is_prompt: bool) -> StepInput:
    tables, next_block = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # scrambled: reversed
        next_block += n
    positions = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
    return StepInput(0, is_prompt, [0] * len(positions), positions, query_lens, context_lens, tables)


def backend_case(s: Shape, inp: StepInput, dev: torch.device):
    """(Triton output in bf16, torch backend's in float32, the Triton call) for one step."""
    g = torch.Generator(device=dev).manual_seed(7)
    t, h, dim = inp.num_tokens, s.heads, s.latent + s.rope
    num_blocks = sum(len(b) for b in inp.block_tables)
    cache = torch.randn(num_blocks, 1, 1, s.block_size, 1, dim, device=dev, generator=g).to(s.dtype)
    weight = (torch.randn(h * (s.nope + s.v), s.latent, device=dev, generator=g) * s.latent**-0.5).to(s.dtype)
    q_nope = torch.randn(t, h, s.nope, device=dev, generator=g).to(s.dtype)
    q_rope = torch.randn(t, h, s.rope, device=dev, generator=g).to(s.dtype)
    entries = torch.randn(t, dim, device=dev, generator=g).to(s.dtype)
    args = (h, s.latent, s.nope, s.v, s.scale)
    ref_cache = cache.float()
    ref = MLAPagedAttention(*args).forward(
        q_nope.float(),
        q_rope.float(),
        entries.float(),
        weight.float(),
        ref_cache[:, 0],
        build_mla_metadata(inp, ref_cache),
    )
    builder = GpuInputBuilder(s.block_size, 64, tm.mla_decode_programs(h), dev, num_sms(), latent_cache=True)
    meta = builder.build(inp).meta
    backend = tm.TritonMLAttention(*args)

    def run() -> torch.Tensor:
        return backend.forward(q_nope, q_rope, entries, weight, cache[:, 0], meta)

    return run(), ref, run


def backend_checks(s: Shape, dev: torch.device) -> None:
    qlens, ctxs = s.prefill
    out, ref, _ = backend_case(s, _step(qlens, ctxs, s.block_size, True), dev)
    err = max_rel_err(out, ref)
    FIG["backend_prefill_err"] = err
    row(f"backend prefill q={qlens} ctx={ctxs}", f"max rel err {err:.1e}", "< 2e-2", _verdict(err < 2e-2))
    ctxs = [s.contexts[0], s.contexts[-1], 1]
    out, ref, run_decode = backend_case(s, _step([1] * 3, ctxs, s.block_size, False), dev)
    err = max_rel_err(out, ref)
    FIG["backend_decode_err"] = err
    row(f"backend decode ctx={ctxs}", f"max rel err {err:.1e}", "< 2e-2", _verdict(err < 2e-2))
    try:  # timed as a CUDA-graph replay: the capture itself shows the decode layer never syncs
        t = device_time(run_decode)
        captured = torch.cuda.is_available()  # on a CPU ``device_time`` runs one plain call
        row(
            "backend decode layer in a CUDA graph",
            f"{t * 1e6:.1f} us",
            "captured" if captured else "(CPU: not captured)",
        )
    except Exception:  # noqa: BLE001 - the prefill timing below still counts
        log(traceback.format_exc())
        row("backend decode layer in a CUDA graph", "capture failed", "", "FAIL")
    n = s.prefill_len
    _, _, run = backend_case(s, _step([n], [n], s.block_size, True), dev)
    t = device_time(run)
    flops = _prefill_flops(s, n)
    FIG["prefill_layer_us"] = {"tokens": n, "us": t * 1e6, "floor_us": flops / MATMUL_FLOP_S * 1e6}
    row(
        f"prefill attention, one layer, {n} tokens",
        f"{t * 1e3:.2f} ms",
        f"floor {flops / MATMUL_FLOP_S * 1e3:.2f} ms",
        f"{flops / MATMUL_FLOP_S / t:.0%} of floor",
    )


# --- 3: the model ------------------------------------------------------------------------------------
class Deadline(Exception):
    pass


def _tiny_model_folder() -> str:
    folder = tempfile.mkdtemp(prefix="gpu-mla-tiny-")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    Path(folder, "config.json").write_text(json.dumps(config))
    return folder


def _decode_tok_s(llm, batch: int, prompt_len: int, new_tokens: int, deadline: float) -> dict:
    from pdinfer import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"mla-{batch}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": ids}, params)
    counts: dict[str, int] = {}
    t0 = tokens0 = None
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            raise Deadline(f"decode batch {batch} past the time budget")
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t0 is None and len(counts) == batch and min(counts.values()) >= 1:  # every prompt prefilled
            t0, tokens0 = time.perf_counter(), sum(counts.values())
    if t0 is None or tokens0 is None:
        raise RuntimeError("the decode never started")
    elapsed = time.perf_counter() - t0
    tokens = sum(counts.values()) - tokens0
    return {"tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed * batch / max(1, tokens)}


def _prefill_tok_s(llm, prompt_len: int, deadline: float, rounds: int = 2) -> float:
    from pdinfer import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        ids = torch.randint(
            0, engine.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(r)
        ).tolist()
        _sync()
        start = time.perf_counter()
        engine.add_request(f"mla-prefill-{r}-{time.monotonic_ns()}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            if time.perf_counter() > deadline:
                raise Deadline("prefill past the time budget")
            engine.step()
        times.append(time.perf_counter() - start)
    return prompt_len / sorted(times[1:])[len(times[1:]) // 2]


def model_speed(tiny: bool, budget_s: float) -> None:
    from pdinfer import LLM

    deadline = START + budget_s
    if tiny:
        llm = LLM(model=_tiny_model_folder(), load_format="dummy", device="cpu", num_kv_blocks=128)
        prompt_len, new_tokens, prefill_len, batches = 32, 4, 64, (1, 4)
    else:
        llm = LLM(
            model="preset:deepseek-v2-lite",
            load_format="dummy",
            max_model_len=8192,
            max_num_seqs=64,
            max_num_batched_tokens=8192,  # the longest prompt fits in one step (no chunking)
            gpu_memory_utilization=0.6,
        )
        prompt_len, new_tokens, prefill_len, batches = 576, 32, 4095, (1, 64)  # 4095: room for the sampled token
    mode = "graphs" if getattr(llm.engine.model_runner, "graphs", None) is not None else "eager"
    label = "tiny V3" if tiny else "V2-Lite"
    FIG["model_mode"] = mode
    try:
        for batch in batches:
            res = _decode_tok_s(llm, batch, prompt_len, new_tokens, deadline)
            FIG[f"model_decode_{batch}"] = res
            row(f"{label} decode batch {batch} ({mode})", f"{res['tok_s']:.0f} tok/s", f"{res['step_ms']:.1f} ms/step")
        tok_s = _prefill_tok_s(llm, prefill_len, deadline)
        FIG["model_prefill"] = {"tokens": prefill_len, "tok_s": tok_s}
        row(f"{label} prefill {prefill_len} tokens ({mode})", f"{tok_s:.0f} tok/s")
    finally:
        llm.engine.shutdown()


# --- main ------------------------------------------------------------------------------------------
def _timed_out(signum, frame) -> None:
    raise Deadline("the model section ran past its time budget")


def run_section(name: str, fn, *args) -> None:
    log(f"\n== {name} ==")
    start = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - one failed section must not lose the others' figures
        log(traceback.format_exc())
        FIG.setdefault("errors", []).append(name)  # type: ignore[union-attr]
        row(name, "ERROR (see log)")
    finally:
        log(f"   ({name}: {time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu_mla"))
    parser.add_argument("--tiny", action="store_true", help="small shapes, any device (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--budget-s", type=float, default=220.0, help="the model section stops past this")
    parser.add_argument("--skip", default="", help="comma list of: decode, configs, backend, model")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter)"
    log(f"{name} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    shape = Shape(args.tiny)
    if "decode" not in skip:
        run_section("decode kernel: check and speed", decode_check_and_speed, shape, dev)
    if "backend" not in skip:
        run_section("backend against torch", backend_checks, shape, dev)
    if "configs" not in skip:
        run_section("launch configs", launch_configs, shape, dev)
    if "model" not in skip:
        # a hard stop too, in case one step hangs: the table and the JSON still get written
        signal.signal(signal.SIGALRM, _timed_out)
        signal.alarm(max(1, int(args.budget_s - (time.perf_counter() - START)) + 20))
        run_section("DeepSeek-V2-Lite (dummy weights)", model_speed, args.tiny, args.budget_s)
        signal.alarm(0)
    FIG["total_s"] = time.perf_counter() - START
    (out / "gpu_mla.json").write_text(json.dumps(FIG, indent=1, default=str))
    widths = [max(len(r[i]) for r in ROWS) for i in range(4)] if ROWS else [0] * 4
    log("\n" + "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in ROWS))
    log(f"total {FIG['total_s']:.0f} s; JSON in {out / 'gpu_mla.json'}")


if __name__ == "__main__":
    main()
