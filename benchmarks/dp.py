"""DP-1 vs DP-2 on this machine, and what the NORMAL vote costs per step.

    python benchmarks/dp.py [--num-prompts 32] [--new-tokens 64] [--wait-idle 0]

Same prompts (``workload.make_prompts``), greedy, EOS ignored, default model:

- ``dp1``: one ``LLMEngine`` in this process (``LLM()``, all cores);
- ``dp1-front``: one rank process behind the DP front: the front, ZeroMQ and the rank loop,
  with the vote's all-reduce on a one-rank gloo group;
- ``dp2``: ``LLM(data_parallel_size=2)``: two rank processes, one torch thread each.

Vote cost, two ways:
- in the runs: each rank times every ``all_reduce_min`` it makes (the loop's idle/stop check and
  the scheduler's votes); per step and per call, in microseconds. That time includes waiting for
  the slower rank, so it is an upper bound on the vote's own cost;
- ``allreduce floor``: two processes doing ``all_reduce_min`` of two ints back to back (no model):
  the latency of one gloo all-reduce on this host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import _machine_cpu_seconds, make_prompts, print_table, wait_for_idle_cpu  # noqa: E402

# One prefill step takes every prompt in all configurations (the default budget of 4096 tokens
# would split DP-1's prefill over two ALL points, 70 decode steps apart, and flatter DP-2).
BUDGET_TOKENS = 16384

_FLOOR_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    from pdinfer.distributed.dp_group import TorchDPGroup
    rank, port, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    group = TorchDPGroup(rank, 2, "127.0.0.1", port, timeout_s=60)
    group.join(120)
    for _ in range(100):
        group.all_reduce_min([rank, 1])
    samples = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        group.all_reduce_min([rank, 1])
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    print(samples[len(samples) // 2] / 1e3, sum(samples) / len(samples) / 1e3, flush=True)
""")


def allreduce_floor(iters: int) -> dict:
    from pdinfer.distributed.dp_group import host_store

    store = host_store("127.0.0.1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FLOOR_SCRIPT, str(r), str(store.port), str(iters)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].split() for p in procs]
    p50 = statistics.mean(float(o[0]) for o in outs)
    mean = statistics.mean(float(o[1]) for o in outs)
    return {"config": "allreduce floor", "ranks": 2, "us_per_allreduce": mean, "allreduce_p50_us": p50}


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process and of ``pids`` (the rank processes)."""
    total = time.process_time()
    hz = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / hz  # utime, stime
    return total


def _run(llm, prompts, params, pids: list[int]) -> tuple[float, int, float]:
    """Wall time, output tokens, and the share of machine CPU that *other* processes took."""
    busy0, total0 = _machine_cpu_seconds()
    own0 = _cpu_seconds(pids)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    busy1, total1 = _machine_cpu_seconds()
    others = (busy1 - busy0) - (_cpu_seconds(pids) - own0)
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs), max(0.0, others / (total1 - total0))


def run_dp1(prompts, params, threads: int) -> dict:
    from pdinfer import LLM

    llm = LLM(max_model_len=1024, max_num_batched_tokens=BUDGET_TOKENS, kv_cache_memory=2 << 30, num_threads=threads)
    steps = {"n": 0}
    step = llm.engine.step

    def counted():
        steps["n"] += 1
        return step()

    llm.engine.step = counted
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], params, use_tqdm=False)  # warm-up
    steps["n"] = 0
    wall, tokens, other = _run(llm, prompts, params, [])
    llm.engine.shutdown()
    return {
        "config": "dp1",
        "ranks": 1,
        "threads_per_rank": threads,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "steps": steps["n"],
        "ms_per_step": 1e3 * wall / steps["n"],
        "other_cpu_frac": other,
    }


def run_front(prompts, params, size: int, threads: int) -> dict:
    from pdinfer import EngineArgs
    from pdinfer.distributed.dp_client import DPEngineClient
    from pdinfer.engine.llm import LLM

    args = EngineArgs(
        data_parallel_size=size,
        max_model_len=1024,
        kv_cache_memory=2 << 30,
        max_num_batched_tokens=BUDGET_TOKENS,
        num_threads=threads,
    )
    llm = LLM.__new__(LLM)  # LLM's generate over a client of any size (LLM() picks one for size > 1)
    llm.engine = DPEngineClient(args)
    llm.tokenizer = llm.engine.tokenizer
    front = llm.engine.front
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], params, use_tqdm=False)  # warm-up
        time.sleep(1.2)  # a fresh heartbeat: the stats below are the state before the run
        before = front.rank_stats()
        wall, tokens, other = _run(llm, prompts, params, front.rank_pids())
        time.sleep(1.2)
        after = front.rank_stats()
    finally:
        llm.engine.shutdown()
    steps = max(a.num_steps - b.num_steps for a, b in zip(after, before))
    calls = [a.num_allreduce - b.num_allreduce for a, b in zip(after, before)]
    ns = [a.allreduce_ns - b.allreduce_ns for a, b in zip(after, before)]
    us_per_step = statistics.mean(n / 1e3 / steps for n in ns)
    return {
        "config": "dp2" if size == 2 else f"dp{size}-front",
        "ranks": size,
        "threads_per_rank": threads,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
        "allreduce_per_step": statistics.mean(c / steps for c in calls),
        "us_per_allreduce": statistics.mean(n / 1e3 / c for n, c in zip(ns, calls)),
        "us_allreduce_per_step": us_per_step,
        "vote_share_pct": 100 * us_per_step / (1e6 * wall / steps),
        "other_cpu_frac": other,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--allreduce-iters", type=int, default=2000)
    parser.add_argument(
        "--wait-idle", type=float, default=0.0, help="wait up to this many seconds for an idle machine first"
    )
    parser.add_argument("--only", default="floor,dp1,dp1-front,dp2")
    args = parser.parse_args()

    from pdinfer import SamplingParams
    from pdinfer.engine.llm_engine import LLMEngine  # noqa: F401  (import cost outside timings)
    from pdinfer.models.loader import load_tokenizer, resolve_model

    if args.wait_idle:
        wait_for_idle_cpu(args.wait_idle)
    folder, _ = resolve_model(None, os.environ.get("PDINFER_CACHE_DIR") or str(Path.home() / ".cache" / "pdinfer"))
    prompts = make_prompts(load_tokenizer(folder, None), args.num_prompts, args.min_tokens, args.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    cores = os.cpu_count() or 1
    only = args.only.split(",")
    rows = []
    if "floor" in only:
        rows.append(allreduce_floor(args.allreduce_iters))
    if "dp1" in only:
        rows.append(run_dp1(prompts, params, cores))
    if "dp1-front" in only:
        rows.append(run_front(prompts, params, 1, cores))
    if "dp2" in only:
        rows.append(run_front(prompts, params, 2, max(1, cores // 2)))
    print(
        f"\n{args.num_prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens, "
        f"{args.new_tokens} new tokens each, {cores} cores\n"
    )
    print_table(
        rows,
        [
            "config",
            "ranks",
            "threads_per_rank",
            "wall_s",
            "output_tok_s",
            "steps",
            "ms_per_step",
            "allreduce_per_step",
            "us_per_allreduce",
            "allreduce_p50_us",
            "us_allreduce_per_step",
            "vote_share_pct",
            "other_cpu_frac",
        ],
    )
    floor = next((r for r in rows if r["config"] == "allreduce floor"), None)
    for row in rows:
        if floor and "allreduce_per_step" in row and row["ranks"] > 1:
            own = row["allreduce_per_step"] * floor["allreduce_p50_us"]
            print(
                f"\n{row['config']}: the vote's own cost is about {own:,.0f} us per step "
                f"({row['allreduce_per_step']:.1f} all-reduces x {floor['allreduce_p50_us']:,.0f} us "
                f"floor, {100 * own / (1e3 * row['ms_per_step']):.2f}% of a step); the "
                f"{row['us_allreduce_per_step']:,.0f} us measured inside the step also holds "
                "the wait for the slower rank"
            )


if __name__ == "__main__":
    main()
