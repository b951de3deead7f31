"""What the workers of ``two_gpu.py`` share: the model and workload (``Setup``), and the helpers
that drive an engine through a list of requests, time each one and summarize the timings.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path


class Setup:
    """Model and workload; ``dry`` shrinks both for a CPU run."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.model = "preset:smollm2-135m" if dry else "preset:llama-3.1-8b"
        self.devices = ("cpu", "cpu") if dry else ("cuda:0", "cuda:1")
        self.vocab = 49152 if dry else 128256
        rng = random.Random(5)
        n, lo, hi = (4, 24, 80) if dry else (64, 256, 2048)
        self.workload = [[rng.randrange(self.vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        self.new_tokens = 8 if dry else 128
        self.warm = [rng.randrange(self.vocab) for _ in range(hi // 2)]  # no prefix of any prompt
        lengths = [17, 40, 64] if dry else [17, 100, 300, 555, 1000, 64, 1500, 2000]
        self.correct = [[rng.randrange(self.vocab) for _ in range(k)] for k in lengths]
        self.correct_tokens = 6 if dry else 32
        per_rank = [30 + 7 * i for i in range(4)] if dry else [120 + 25 * i for i in range(16)]
        self.dp = [[rng.randrange(self.vocab) for _ in range(k)] for k in per_rank * 2]
        self.micro_blocks = [2, 8] if dry else [8, 64, 128]  # 16 MiB, 128 MiB, 256 MiB on the 8B shape
        self.micro_reps = 3 if dry else 8

    def engine_args(self, role: str, device: str, kv: dict | None = None):
        from pdinfer import EngineArgs

        extra = (
            {"num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 1024}
            if self.dry
            else {"num_kv_blocks": 12288, "max_num_seqs": 64, "max_model_len": 4096, "max_num_batched_tokens": 8192}
        )
        return EngineArgs(
            model=self.model,
            load_format="dummy",
            engine_type=role,
            device=device,
            kv_transfer=kv or {},
            seed=0,
            **extra,
        )


def greedy(n: int):
    from pdinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def write(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, default=str))


def run_engine(engine, items: list[tuple[str, list[int]]], params) -> dict:
    """Add all, step until done; per request: tokens, time of first token and of the last."""
    start = time.perf_counter()
    for rid, ids in items:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    return collect(engine, start, {rid for rid, _ in items})


def collect(engine, start: float, wanted: set[str], step=None) -> dict:
    step = step or engine.step
    done: dict[str, dict] = {}
    first: dict[str, float] = {}
    while len(done) < len(wanted):
        for out in step():
            if out.request_id not in wanted:
                continue
            now = time.perf_counter() - start
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = {
                    "tokens": list(out.outputs[0].token_ids),
                    "ttft": first.get(out.request_id, now),
                    "done": now,
                    "error": out.error,
                }
    return done


def settle(engine) -> None:
    """Finish the step still in flight (zero-overhead scheduling runs one ahead)."""
    while engine.has_unfinished_requests():
        engine.step()


def summarize(results: dict, elapsed: float | None = None) -> dict:
    ttft = sorted(r["ttft"] for r in results.values())
    tpot = sorted((r["done"] - r["ttft"]) / max(1, len(r["tokens"]) - 1) for r in results.values())
    tokens = sum(len(r["tokens"]) for r in results.values())
    span = elapsed or max(r["done"] for r in results.values())
    return {
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot),
        "tpot_p50_ms": 1e3 * tpot[len(tpot) // 2],
        "out_tok_s": tokens / span,
        "span_s": span,
        "errors": sum(r["error"] is not None for r in results.values()),
    }
