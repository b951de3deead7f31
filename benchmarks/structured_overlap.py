"""Structured outputs under zero-overhead scheduling: tok/s with the grammar masks computed
while the forward runs (the default) against finishing the step in flight first (the fallback
that KV-store, EPLB, DP and PROMPT engines use), and against no grammar at all.

    python benchmarks/structured_overlap.py [--batches 1,8,32] [--new-tokens 96]

B prompts, each asking for a JSON object of a fixed schema (greedy, ``max_tokens`` new tokens,
on the default model); the first batch of each configuration warms up and is not timed. Output
tokens over the wall time of ``LLM.generate``, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import time

from pdinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "notes"],
}


def run(llm: LLM, batch: int, params: SamplingParams, repeats: int) -> float:
    prompts = [f"Person {i} as JSON:" for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    engine = llm.engine
    assert engine.zero_overhead
    grammar = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, structured_outputs={"json": SCHEMA})
    free = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    print("| batch | no grammar tok/s | grammar, masks overlapped | grammar, step in flight finished first |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        plain = run(llm, batch, free, args.repeats)
        overlapped = run(llm, batch, grammar, args.repeats)
        engine._can_defer_masks = lambda: False  # the fallback, on this engine
        drained = run(llm, batch, grammar, args.repeats)
        del engine._can_defer_masks
        print(
            f"| {batch} | {plain:.0f} | {overlapped:.0f} | {drained:.0f} ({overlapped / drained - 1:+.0%} for the overlap) |"
        )


if __name__ == "__main__":
    main()
