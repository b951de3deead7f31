"""The host's work in a decode step, with a device that takes no time (CPU only).

    python benchmarks/host_step.py [--batch 256] [--prompt-len 576] [--skip-tokens 1500] [--steps 60]
    python benchmarks/host_step.py --prefill 4x2048

``--prefill NxL`` instead times what the host does for a prefill step of N fresh prompts of L
tokens (gpu_speed.bench_prefill's workload): adding the requests (their token check) and the
steps until they end (prefix lookup with its block hashes, scheduling, the step's input, output
processing), median of 10 rounds.

A tiny random Llama (one layer of width 64, the 8B model's vocabulary) runs ``--batch``
sequences; once every prompt is prefilled and ``--skip-tokens`` decode steps have run, the
runner is replaced by one that returns its sampled tokens at once, so the timed steps measure
only what the host does: scheduling, the step's input, output processing and the client-side
tracking of ``LLMEngine.step`` (zero-overhead scheduling off, so that one thread does all of
it). Each round times the steps as ``LLM.generate`` runs them (the engine loop's collector
settings, ``engine/heap.py``; outputs of ended requests only), building every request's output
each step, and that with the interpreter's collector defaults, alternating, in one process.
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
from pathlib import Path

os.environ.setdefault("PDINFER_ZERO_OVERHEAD_SCHEDULING", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdinfer import LLM, SamplingParams  # noqa: E402
from pdinfer.engine import heap  # noqa: E402
from pdinfer.worker.step_input import StepResult  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "bos_token_id": 0,
}


# (label, the engine loop's collector settings, step(finished_only=...))
VARIANTS = (
    ("as LLM.generate runs", True, True),
    ("every request's output each step", True, False),
    ("and the interpreter's collector defaults (before 2026-12-06)", False, False),
)


def timed_steps(engine, steps: int, loop_settings: bool, finished_only: bool) -> float:
    """Seconds a step over ``steps`` steps, under the engine loop's collector settings or the
    interpreter's defaults."""
    saved = heap.LOOP_GC_THRESHOLD
    if not loop_settings:
        heap.LOOP_GC_THRESHOLD = gc.get_threshold()[0]
    try:
        with heap.startup_objects_frozen():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step(finished_only=finished_only)
            return (time.perf_counter() - start) / steps
    finally:
        heap.LOOP_GC_THRESHOLD = saved


def prefill_host(llm, n: int, length: int, rounds: int = 10) -> None:
    engine = llm.engine
    engine.model_runner.execute = lambda inp: StepResult(step_id=inp.step_id, token_ids=[5] * len(inp.samples))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    adds, steps = [], []
    for r in range(rounds + 3):  # three warm-up rounds
        prompts = [torch.randint(2, 128000, (length,), generator=g).tolist() for _ in range(n)]
        with heap.startup_objects_frozen():
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"prefill-{r}-{i}", {"prompt_token_ids": prompt}, params)
            added = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            done = time.perf_counter()
        if r >= 3:
            adds.append(added - start)
            steps.append(done - added)
    print(
        f"prefill {n} x {length}: adding the requests {1e3 * statistics.median(adds):.2f} ms, "
        f"the steps {1e3 * statistics.median(steps):.2f} ms (median of {rounds})"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=576)
    p.add_argument("--skip-tokens", type=int, default=1500)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", default="", help="NxL: the host's work for a prefill of N prompts of L tokens")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="pdinfer-host-step-")
    Path(folder, "config.json").write_text(json.dumps(TINY))
    if args.prefill:
        n, length = (int(x) for x in args.prefill.split("x"))
        llm = LLM(model=folder, load_format="dummy", max_model_len=8192, max_num_batched_tokens=n * length)
        prefill_host(llm, n, length)
        return
    llm = LLM(model=folder, load_format="dummy", max_model_len=8192, max_num_seqs=args.batch)
    engine = llm.engine
    runner = engine.model_runner
    new_tokens = args.skip_tokens + len(VARIANTS) * args.rounds * args.steps + 8
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(2, 128000, (args.prompt_len,), generator=g).tolist()
        engine.add_request(f"host-{i}", {"prompt_token_ids": prompt}, params)
    while min((s.num_output_tokens for s in engine.scheduler.running), default=0) < 1 or engine.scheduler.waiting:
        engine.step()
    runner.execute = lambda inp: StepResult(step_id=inp.step_id, token_ids=[5] * len(inp.samples))
    for _ in range(args.skip_tokens):
        engine.step()
    times: dict[str, list[float]] = {label: [] for label, _, _ in VARIANTS}
    for _ in range(args.rounds):
        for label, loop_settings, finished_only in VARIANTS:
            times[label].append(timed_steps(engine, args.steps, loop_settings, finished_only))
    for label, _, _ in VARIANTS:
        t = statistics.median(times[label])
        print(
            f"batch {args.batch}, {args.skip_tokens} tokens into the output, {label}: "
            f"{1e3 * t:.2f} ms a step ({1e6 * t / args.batch:.1f} us a sequence); "
            f"rounds {', '.join(f'{1e3 * x:.2f}' for x in times[label])}"
        )


if __name__ == "__main__":
    main()
