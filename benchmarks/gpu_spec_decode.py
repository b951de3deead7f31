"""Speculative decoding on one GPU, in one call (under 8 minutes on an H200): correctness, speed,
and whether CUDA graphs run the verifying steps.

    python benchmarks/gpu_spec_decode.py [--out DIR] [--skip correct,speed,mtp] [--budget-s 420]
    python benchmarks/gpu_spec_decode.py --smoke   # the same flow with tiny random models (CPU: ~1 min)

n-gram speculation (k = 3) against an engine of the same settings without it, on the
Llama-3.1-8B shape with dummy bf16 weights, CUDA graphs and zero-overhead scheduling on
(NORMAL's defaults). One engine at a time.
1. correct: greedy tokens with speculation equal those without, token for token, at batch 1
   and 8 (prompts P + C + P: 100 random tokens, the model's own 96 greedy tokens after them,
   the 100 again; 96 new tokens). Both engines have max_num_seqs=8, so the
   verifying steps (up to 8 x 4 = 32 rows) replay graphs captured past max_num_seqs. Reports
   acceptance, identical sequences, the first difference.
2. speed: decode tok/s at batch 1, 8, 16 and 64 (576-token prompts + 128 new tokens:
   ``gpu_speed.bench_decode``), max_num_seqs=64; acceptance; the device time of the
   verifying steps and of the plain ones (CUDA events around each step's launch); the graph
   replay of bucket B against bucket B x (1 + k) (``gpu_speed.graph_step_ms``). Batch 64
   drafts nothing (``DraftPool.max_batch`` = 16): its row shows what speculation costs there.
3. graphs: every decode step of 1 and 2 by kind (plain, verifying) and by how it ran (graph
   replay or eager).
4. mtp: a tiny DeepSeek-V3 with one MTP layer (``spec_decode.TINY_V3``, dummy float32
   weights): greedy with MTP drafts equals greedy without, with the MTP layer and the hidden
   states on the device (random weights accept few drafts: this checks, it does not measure).

Writes ``gpu_spec_decode.json`` and ``gpu_spec_decode.md`` to ``--out`` (default $OUT); exits
1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_speed  # noqa: E402
from benchmarks.gpu_correctness import random_prompts  # noqa: E402
from benchmarks.gpu_micro import FIG, ROWS, free_memory, log, row  # noqa: E402
from benchmarks.gpu_suite import format_table, run_section  # noqa: E402
from benchmarks.spec_decode import TINY_V3  # noqa: E402
from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.models.presets import PRESETS  # noqa: E402
from pdinfer.worker.step_input import StepInput  # noqa: E402

K = 3
START = time.perf_counter()
GPU = dict(
    label="8B",
    vocab=PRESETS["llama-3.1-8b"]["vocab_size"],
    model="preset:llama-3.1-8b",
    load_format="dummy",
    gpu_memory_utilization=0.5,
    max_model_len=2048,
    max_num_batched_tokens=8192,
    batches=(1, 8, 16, 64),
    correct_len=200,
    correct_tokens=96,
    mtp_prompts=[30, 77, 150, 200],
    mtp_tokens=48,
)
# The CPU: a tiny random Llama, short prompts (``bench_decode`` reads gpu_speed's lengths).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 128,  # its dummy greedy output soon meets tokens of its prompt: n-gram drafts
    "max_position_embeddings": 2048,
}
SMOKE = dict(
    label="tiny Llama",
    vocab=TINY_LLAMA["vocab_size"],
    load_format="dummy",
    kv_cache_memory=256 << 20,
    max_model_len=512,
    max_num_batched_tokens=2048,
    batches=(1, 8, 16, 64),
    correct_len=40,
    correct_tokens=48,
    mtp_prompts=[30, 77],
    mtp_tokens=16,
)


# not engine arguments
WORKLOAD = ("label", "vocab", "batches", "correct_len", "correct_tokens", "mtp_prompts", "mtp_tokens")


class StepLog:
    """Every step an engine's runner executes: its kind (prefill, decode, verify: some rows
    share a sequence), rows, whether a CUDA graph replayed it, and its span (CUDA events
    around its launch, on the worker thread's stream; wall time on the CPU)."""

    def __init__(self, llm: LLM):
        runner = llm.engine.model_runner
        self.steps: list[dict] = []
        execute = runner.execute

        def logged(inp: StepInput):
            graphs = getattr(runner, "graphs", None)  # a GpuRunner's (None on the CPU)
            replays = graphs.num_replays if graphs is not None else 0
            start = _mark()
            result = execute(inp)
            replayed = graphs is not None and graphs.num_replays > replays
            self.steps.append(
                {"kind": step_kind(inp), "rows": inp.num_tokens, "graph": replayed, "span": (start, _mark())}
            )
            return result

        runner.execute = logged

    def summary(self, first: int = 0) -> dict:
        """Counts and mean device time by kind of the steps from index ``first`` on."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out: dict = {}
        for kind in ("decode", "verify"):
            steps = [s for s in self.steps[first:] if s["kind"] == kind]
            ms = [_elapsed_ms(*s["span"]) for s in steps]
            out[kind] = {
                "steps": len(steps),
                "graph_replays": sum(s["graph"] for s in steps),
                "eager": sum(not s["graph"] for s in steps),
                "mean_rows": sum(s["rows"] for s in steps) / len(steps) if steps else 0.0,
                "mean_ms": sum(ms) / len(ms) if ms else None,
            }
        return out


def step_kind(inp: StepInput) -> str:
    if inp.is_prompt:
        return "prefill"
    tables = inp.block_tables  # a verifying sequence's rows share its block table
    seqs = 1 + sum(tables[i] != tables[i - 1] for i in range(1, len(tables)))
    return "verify" if inp.num_tokens > seqs else "decode"


def _mark():
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start, end) -> float:
    return 1e3 * (end - start) if isinstance(start, float) else start.elapsed_time(end)


def with_engine(shape: dict, max_num_seqs: int, method: str | None, work):
    """``work(llm, steps)`` on a fresh engine speculating with ``method`` (None: off); the engine
    is freed before the next one is built (two 8B engines do not fit at utilization 0.5), so
    ``work`` returns plain data only."""
    kwargs = {k: v for k, v in shape.items() if k not in WORKLOAD}
    if method is not None:
        kwargs.update(speculative_method=method, num_draft_tokens=K)
    start = time.perf_counter()
    llm = LLM(max_num_seqs=max_num_seqs, **kwargs)
    graphs = getattr(llm.engine.model_runner, "graphs", None)
    buckets = graphs.buckets if graphs is not None else "none (CPU or eager)"
    log(f"  built the engine ({method or 'no speculation'}) in {time.perf_counter() - start:.0f} s; graphs {buckets}")
    steps = StepLog(llm)
    try:
        return work(llm, steps)
    finally:
        llm.engine.shutdown()
        del llm, graphs, steps
        free_memory()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def counters(llm: LLM) -> tuple[int, int]:
    pool = llm.engine.draft_pool
    return (pool.num_drafted_tokens, pool.num_accepted_tokens) if pool is not None else (0, 0)


def compare(name: str, expected: list[list[int]], got: list[list[int]], drafted: int, accepted: int) -> None:
    same = sum(a == b for a, b in zip(expected, got))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(expected, got)]
    FIG[name] = {"identical": same, "of": len(expected), "first_difference": first, "drafted": drafted}
    FIG[name]["acceptance"] = accepted / drafted if drafted else None
    ok = same == len(expected) and drafted > 0  # no drafts: nothing was checked
    if not ok:
        FIG.setdefault("errors", []).append(name)
    accept = f"{accepted / drafted:.0%} of {drafted} drafts accepted" if drafted else "no drafts"
    row(name, f"{same}/{len(expected)} sequences identical", accept, "PASS" if ok else "FAIL")


def graph_rows(name: str, summary: dict) -> None:
    """3: how the decode steps ran; on CUDA every verifying step must replay a graph."""
    FIG[f"{name} steps"] = summary
    cuda = torch.cuda.is_available()
    for kind in ("decode", "verify"):
        s = summary[kind]
        verdict = ("PASS" if s["eager"] == 0 else "FAIL") if cuda and kind == "verify" and s["steps"] else ""
        if verdict == "FAIL":
            FIG.setdefault("errors", []).append(f"{name}: eager verifying steps")
        row(
            f"{name}: {kind} steps",
            f"{s['graph_replays']} graph replays, {s['eager']} eager",
            f"of {s['steps']}, {s['mean_rows']:.1f} rows",
            verdict,
        )


def check_greedy(label: str, shape: dict, method: str, batches: dict[int, list[list[int]]], max_tokens: int) -> None:
    """Greedy tokens of each batch of prompts without speculation, then with ``method``."""
    expected = with_engine(shape, 8, None, lambda llm, _: {b: greedy(llm, p, max_tokens) for b, p in batches.items()})

    def speculating(llm: LLM, steps: StepLog) -> None:
        for b, prompts in batches.items():
            before, first = counters(llm), len(steps.steps)
            got = greedy(llm, prompts, max_tokens)
            drafted, accepted = (after - was for after, was in zip(counters(llm), before))
            compare(f"{label} greedy batch {b}, {method} vs off", expected[b], got, drafted, accepted)
            graph_rows(f"{label} batch {b}", steps.summary(first))

    with_engine(shape, 8, method, speculating)


# --- 1. correctness ---------------------------------------------------------------------------
def correctness(shape: dict) -> None:
    """1 (and 3): greedy with n-gram speculation against greedy without, max_num_seqs=8."""
    # P + C + P, where C is the model's own greedy continuation of P: where the model continues
    # the second P as it did the first, the n-gram drafter proposes C and the drafts are
    # accepted (random prompts alone draft nothing: dummy 8B weights repeat no tokens).
    tokens = shape["correct_tokens"]
    starts = {b: random_prompts([shape["correct_len"] // 2] * b, shape["vocab"], seed=40 + b) for b in (1, 8)}
    continued = with_engine(shape, 8, None, lambda llm, _: {b: greedy(llm, p, tokens) for b, p in starts.items()})
    batches = {b: [p + c + p for p, c in zip(starts[b], continued[b])] for b in starts}
    check_greedy(shape["label"], shape, "ngram", batches, tokens)


# --- 2. speed ---------------------------------------------------------------------------------
def speed_runs(llm: LLM, steps: StepLog, batches: tuple[int, ...]) -> dict[int, dict]:
    gpu_speed.bench_decode(llm, 1)  # warm-up
    results = {}
    for b in batches:
        before, first = counters(llm), len(steps.steps)
        res = gpu_speed.bench_decode(llm, b)
        res["steps"] = steps.summary(first)
        drafted, accepted = (after - was for after, was in zip(counters(llm), before))
        res.update(drafted=drafted, acceptance=accepted / drafted if drafted else None)
        if torch.cuda.is_available():  # the replay alone of B rows and of B x (1 + k)
            res["graph_ms"] = {r: gpu_speed.graph_step_ms(llm, r) for r in (b, b * (1 + K))}
        results[b] = res
        log(f"  batch {b}: {res}")
    return results


def speed(shape: dict) -> None:
    """2 (and 3): decode with and without n-gram speculation, one engine after the other."""
    batches = shape["batches"]
    off = with_engine(shape, max(batches), None, lambda llm, steps: speed_runs(llm, steps, batches))
    on = with_engine(shape, max(batches), "ngram", lambda llm, steps: speed_runs(llm, steps, batches))
    FIG["speed"] = {"off": off, "ngram": on}
    for b in batches:
        acc = on[b]["acceptance"]
        row(
            f"decode batch {b}, tok/s (k = {K})",
            f"off {off[b]['tok_s']:.0f}, ngram {on[b]['tok_s']:.0f}: {on[b]['tok_s'] / off[b]['tok_s']:.2f}x",
            f"{acc:.0%} accepted" if acc is not None else "no drafts",
        )
        plain, verify = off[b]["steps"]["decode"], on[b]["steps"]["verify"]
        if verify["steps"] and plain["mean_ms"] and verify["mean_ms"]:
            row(
                f"decode batch {b}, device time a step",
                f"verifying {verify['mean_ms']:.2f} ms ({verify['mean_rows']:.0f} rows), "
                f"plain {plain['mean_ms']:.2f} ms ({plain['mean_rows']:.0f} rows)",
                f"{verify['mean_ms'] / plain['mean_ms']:.2f}x",
            )
        graph_ms = on[b].get("graph_ms", {})
        if graph_ms.get(b) and graph_ms.get(b * (1 + K)):
            row(
                f"decode batch {b}, graph replay alone",
                f"{b * (1 + K)} rows {graph_ms[b * (1 + K)]:.2f} ms, {b} rows {graph_ms[b]:.2f} ms",
                f"{graph_ms[b * (1 + K)] / graph_ms[b]:.2f}x",
            )
        graph_rows(f"speed batch {b}", on[b]["steps"])


# --- 4. MTP -----------------------------------------------------------------------------------
def mtp(workload: dict) -> None:
    """4: the tiny DeepSeek-V3 with MTP drafts against itself without."""
    folder = tempfile.mkdtemp(prefix="pdinfer-tiny-v3-")
    (Path(folder) / "config.json").write_text(json.dumps(TINY_V3))
    shape = dict(model=folder, load_format="dummy", dtype="float32", max_model_len=1024)
    cpu = not torch.cuda.is_available()
    shape.update(dict(kv_cache_memory=256 << 20) if cpu else dict(gpu_memory_utilization=0.2))
    prompts = random_prompts(workload["mtp_prompts"], TINY_V3["vocab_size"], seed=9)
    check_greedy("MTP (random weights)", shape, "mtp", {len(prompts): prompts}, workload["mtp_tokens"])


def markdown() -> str:
    header = "| what | measured | reference | verdict |\n|---|---|---|---|\n"
    return header + format_table() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: correct, speed, mtp")
    parser.add_argument("--smoke", action="store_true", help="the CPU, tiny random models, short prompts")
    parser.add_argument("--budget-s", type=float, default=420, help="no new section after this many seconds")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = GPU
    if args.smoke:
        folder = tempfile.mkdtemp(prefix="pdinfer-tiny-llama-")
        (Path(folder) / "config.json").write_text(json.dumps(TINY_LLAMA))
        shape = dict(SMOKE, model=folder)
        gpu_speed.PROMPT_LEN, gpu_speed.NEW_TOKENS = 32, 24
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    log(f"{device} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    sections = [("correct", correctness, shape), ("speed", speed, shape), ("mtp", mtp, shape)]
    for name, fn, arg in sections:
        if name in skip:
            continue
        if time.perf_counter() - START > args.budget_s:
            log(f"== {name}: skipped, past the {args.budget_s:.0f} s budget")
            continue
        run_section(name, fn, arg)
    FIG["rows"] = ROWS
    (out / "gpu_spec_decode.json").write_text(json.dumps(FIG, indent=1, default=str))
    (out / "gpu_spec_decode.md").write_text(markdown())
    log("\n" + format_table())
    log(f"total {time.perf_counter() - START:.0f} s")
    if FIG.get("errors"):
        log(f"FAILED: {FIG['errors']}")
        sys.exit(1)


if __name__ == "__main__":
    main()
