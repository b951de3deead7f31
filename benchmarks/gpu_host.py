"""Where the host's time goes in a large decode step on the GPU, and what the GIL costs.

    python benchmarks/gpu_host.py [--batch 256]

On the Llama-3.1-8B shape (dummy bf16 weights): decode tok/s at the batch against the graph
replay's device time, with the interpreter's switch interval at its default (5 ms) and shorter
(a thread that waits for the GIL waits up to that long for a busy one to let go), and the
wall time each part of the host work takes per step (scheduling, the step's input, the
runner's launch, the result's wait, output processing, the client side), timed in place.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import llama_8b, log  # noqa: E402
from benchmarks.gpu_speed import bench_decode, graph_step_ms  # noqa: E402
from pdinfer.worker.gpu_runner import PendingStepResult  # noqa: E402

TIMES: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)


def timed_method(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` to add its wall time (per calling thread) to TIMES[label]."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[f"{label} [{threading.current_thread().name[:12]}]"] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    llm = llama_8b()
    b = args.batch
    bench_decode(llm, b)  # warm-up
    log(f"graph replay B={b}: {graph_step_ms(llm, b):.2f} ms")
    for interval in (0.005, 0.0005, 0.005):
        sys.setswitchinterval(interval)
        res = bench_decode(llm, b)
        log(f"switch interval {interval * 1e3:.1f} ms: {res['tok_s']:.0f} tok/s, {res['step_ms']:.2f} ms/step")
    sys.setswitchinterval(0.005)
    engine = llm.engine
    runner = engine.model_runner
    timed_method(engine.scheduler, "schedule", "schedule")
    timed_method(engine.step_builder, "build", "step_builder.build")
    timed_method(runner, "execute", "runner.execute")
    timed_method(runner.builder, "build", "gpu_input.build")
    timed_method(runner.graphs, "run", "graphs.run")
    timed_method(PendingStepResult, "wait", "PendingStepResult.wait")
    timed_method(engine.output_processor, "process", "output_processor.process")
    timed_method(engine, "_post_process_step", "_post_process_step (incl. wait)")
    timed_method(engine, "step_deltas", "step_deltas")
    timed_method(engine, "step", "step (all)")
    res = bench_decode(llm, b)
    steps = CALLS["schedule"]
    log(f"timed run: {res['tok_s']:.0f} tok/s, {res['step_ms']:.2f} ms/step; per step over {steps} steps:")
    for label, total in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        log(f"  {1e3 * total / steps:7.2f} ms  {label}")


if __name__ == "__main__":
    main()
