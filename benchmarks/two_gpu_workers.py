"""The workers of ``two_gpu.py`` (one process each, this module's ``part_*`` functions): NORMAL,
DP and the correctness check here, the P/D pair in ``two_gpu_pd.py``, the model and workload
they share in ``two_gpu_common.py``. Run through ``python benchmarks/two_gpu.py``.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also importable as a sibling module

from benchmarks.two_gpu_common import Setup, collect, greedy, run_engine, settle, summarize, write  # noqa: E402
from benchmarks.two_gpu_pd import part_ce, part_pe  # noqa: E402

# two_gpu.py starts every worker through this module.
__all__ = ["Setup", "part_ce", "part_correct", "part_dp", "part_normal", "part_pe"]


# --- workers: NORMAL -----------------------------------------------------------------------------
def part_normal(setup: Setup, out: Path) -> None:
    from pdinfer import LLMEngine

    engine = LLMEngine(setup.engine_args("normal", setup.devices[0]))
    result = {"correct": {}}
    for i, ids in enumerate(setup.correct):  # one at a time: the batch shapes P/D will have
        result["correct"][str(i)] = run_engine(engine, [(f"c{i}", ids)], greedy(setup.correct_tokens))[f"c{i}"][
            "tokens"
        ]
    run_engine(engine, [("warm", setup.warm)], greedy(4))
    items = [(f"w{i}", ids) for i, ids in enumerate(setup.workload)]
    work = run_engine(engine, items, greedy(setup.new_tokens))
    settle(engine)
    result["workload"] = summarize(work)
    result["workload_tokens"] = {rid: r["tokens"] for rid, r in work.items()}
    result["free_blocks"] = [engine.get_num_free_blocks(), engine.num_blocks]
    write(out, result)
    engine.shutdown()


# --- workers: DP ------------------------------------------------------------------------------------
def part_dp(setup: Setup, out: Path, rank: int, port: int) -> None:
    from pdinfer import LLMEngine
    from pdinfer.core.dp import SingleProcessDPGroup
    from pdinfer.distributed.dp_group import TorchDPGroup

    group = TorchDPGroup(rank, 2, "127.0.0.1", port, backend="gloo" if setup.dry else "nccl")
    engine = LLMEngine(setup.engine_args("normal", setup.devices[rank]), dp_group=group)
    items = [(f"dp{i}", ids) for i, ids in enumerate(setup.dp) if i % 2 == rank]
    params = greedy(setup.new_tokens)
    engine.scheduler.dp_group = SingleProcessDPGroup()  # DP-1: this rank's prompts alone
    run_engine(engine, [("warm", setup.warm)], greedy(4))
    settle(engine)
    start = time.perf_counter()
    alone = run_engine(engine, items, params)
    alone_s = time.perf_counter() - start
    settle(engine)
    engine.scheduler.dp_group = group
    group.join(device=engine.device)
    steps = [0]

    def lockstep():  # every rank steps while any rank has work (as dp_rank.py's loop)
        idle = group.all_reduce_min([0 if engine.has_unfinished_requests() else 1])[0]
        if idle:
            return []
        steps[0] += 1
        return engine.step()

    calls0, ns0 = group.num_calls, group.total_ns
    start = time.perf_counter()
    for rid, ids in items:
        engine.add_request(f"dp2-{rid}", {"prompt_token_ids": ids}, params)
    together = collect(engine, start, {f"dp2-{rid}" for rid, _ in items}, step=lockstep)
    together = {rid.removeprefix("dp2-"): r for rid, r in together.items()}
    while group.all_reduce_min([0 if engine.has_unfinished_requests() else 1])[0] == 0:
        steps[0] += 1
        engine.step()  # the other rank still has work: companion steps
    together_s = time.perf_counter() - start
    calls, ns = group.num_calls - calls0, group.total_ns - ns0
    # The vote alone: back-to-back all-reduces, no step between them to wait for.
    for _ in range(10):
        group.all_reduce_min([0, 1])
    calls1, ns1 = group.num_calls, group.total_ns
    for _ in range(200):
        group.all_reduce_min([rank, 1])
    vote_us = (group.total_ns - ns1) / 1e3 / (group.num_calls - calls1)
    write(
        out,
        {
            "rank": rank,
            "equal": sum(alone[r]["tokens"] == together[r]["tokens"] for r in alone),
            "of": len(alone),
            "dp1_s": alone_s,
            "dp2_s": together_s,
            "steps": steps[0],
            "allreduce_calls": calls,
            "allreduce_ms_total": ns / 1e6,
            "allreduce_us_per_call": ns / 1e3 / max(1, calls),
            "allreduce_us_per_step": ns / 1e3 / max(1, steps[0]),
            "vote_alone_us": vote_us,
            "tokens": sum(len(r["tokens"]) for r in together.values()),
            "free_blocks": [engine.get_num_free_blocks(), engine.num_blocks],
        },
    )
    engine.shutdown()
    group.close()


def part_correct(setup: Setup, out: Path, preset: str) -> None:
    from benchmarks.gpu_correctness import correctness
    from benchmarks.gpu_micro import FIG, ROWS

    name = {"llama-3.2-1b": "1B", "llama-3.1-8b": "8B"}[preset]
    kwargs = dict(max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=8192, num_kv_blocks=4096)
    try:
        _, llm = correctness(preset, name, preset == "llama-3.2-1b", kwargs, with_fp32=False)
        llm.engine.shutdown()
    except Exception:  # noqa: BLE001 - reported in the table
        FIG["error"] = traceback.format_exc()
        print(FIG["error"], flush=True)
    write(out, {"fig": FIG, "rows": ROWS})
