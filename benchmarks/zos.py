"""Zero-overhead scheduling: decode steps per second with it on and off, and where host time goes.

    python benchmarks/zos.py [--batches 1,16,64] [--new-tokens 64]

For each batch size, B prompts of 64 tokens decode 64 tokens each (greedy, ignore_eos) on the
default model; we time the decode steps only. Host time per step is measured with timers around
the scheduler (``schedule``) and output processing (``OutputProcessor.process``), the two pieces
ZOS overlaps with the forward of the next step; a cProfile run of one configuration is printed
at the end (top entries by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import print_table  # noqa: E402


class Timed:
    """Wraps a bound method and accumulates its wall time."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(batch: int, zos: bool, new_tokens: int, profile: bool = False):
    os.environ["PDINFER_ZERO_OVERHEAD_SCHEDULING"] = "1" if zos else "0"
    from pdinfer import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(EngineArgs(kv_cache_memory=1 << 30, enable_prefix_caching=False))
    assert engine.zero_overhead is zos
    schedule = engine.scheduler.schedule = Timed(engine.scheduler.schedule)
    process = engine.output_processor.process = Timed(engine.output_processor.process)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 7919 + j) % 40000 + 100 for j in range(64)]}, params)
    while engine.scheduler.waiting:  # prefill first, then time pure decode
        engine.step()
    # With ZOS the last prefill is still running when the waiting queue empties: one more step
    # waits for it (and launches the first decode), so both modes start timing at the same
    # point. (Timing from here before 2026-11-29 22:40 charged ZOS runs with a whole prefill.)
    engine.step()
    schedule.seconds = process.seconds = 0.0
    schedule.calls = process.calls = 0
    launches = engine.executor.launch = Timed(engine.executor.launch)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    # Forwards that ran in the timed span: with ZOS also the decode launched before it.
    steps = launches.calls + (1 if zos else 0)
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    engine.shutdown()
    return steps / elapsed, schedule.seconds / max(schedule.calls, 1), process.seconds / max(process.calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="cProfile the batch-64 ZOS run")
    args = parser.parse_args()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        result = {}
        for zos in (False, True):
            result[zos] = run(batch, zos, args.new_tokens)
        off, on = result[False], result[True]
        rows.append(
            [
                batch,
                f"{off[0]:.1f}",
                f"{on[0]:.1f}",
                f"{(on[0] / off[0] - 1) * 100:+.1f}%",
                f"{off[1] * 1e3:.2f}",
                f"{off[2] * 1e3:.2f}",
            ]
        )
    print_table(
        rows, ["batch", "steps/s ZOS off", "steps/s ZOS on", "gain", "schedule ms/step", "output processing ms/step"]
    )
    if args.profile:
        run(64, True, args.new_tokens, profile=True)


if __name__ == "__main__":
    main()
