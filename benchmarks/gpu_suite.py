"""GPU suite for one device call: ceilings, correctness against transformers, speed against the floor.

    python benchmarks/gpu_suite.py [--out DIR] [--skip micro,hf,...]

1. ceilings: device-to-device copy bandwidth and bf16 matmul rate, measured here.
2. correctness (bf16): transformers models built from the presets with a seed; pdinfer loads
   the same weights (Llama-3.2-1B shape through save_pretrained + ``LLM(model=folder)``,
   Llama-3.1-8B shape through its state dict). Last-position prefill logits (whole prompt and
   in two chunks over the cached prefix) by relative error, and 32 greedy tokens per prompt.
3. speed on the 8B shape: decode tok/s at batch 1/64/256 (576-token prompts + 128 new: mean
   context 640), prefill tok/s at 8k tokens per step; transformers ``generate`` on the same
   workloads; each figure against its floor (decode: weight + KV bytes / copy bandwidth;
   prefill: FLOPs / matmul rate); GPU idle between decode steps at batch 256.
4. micro: attention kernel variants, and a per-kernel profile of one eager decode step.

Prints a table last; writes the log and a JSON of every figure to ``--out`` (default $OUT).
Sections 1 and 3 are in ``gpu_speed.py``, 2 in ``gpu_correctness.py``, 4 in ``gpu_micro.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_correctness import correctness  # noqa: E402
from benchmarks.gpu_micro import FIG, ROWS, free_memory, kv_staging, log, micro, role_profiles, row  # noqa: E402
from benchmarks.gpu_speed import ceilings, speed  # noqa: E402
from pdinfer import LLM  # noqa: E402


# --- main ----------------------------------------------------------------------------------
def run_section(name: str, fn, *args):
    log(f"\n== {name} ==")
    start = time.perf_counter()
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - one failed section must not lose the others' figures
        log(traceback.format_exc())
        FIG.setdefault("errors", []).append(name)
        row(name, "ERROR (see log)")
        return None
    finally:
        log(f"   ({name}: {time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: 1b, correct, fp32, hf, micro, speed, roles")
    # By default 0.5 where the transformers models share the card, 0.85 for speed alone (with
    # ``--skip correct``): at 0.5 an 80 GB card holds 164k KV tokens, fewer than decode at batch 256
    # needs (256 x 705), and its last sequences were preempted and recomputed.
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.85 if "correct" in skip else 0.5
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    engine_kwargs = dict(max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192)
    run_section("ceilings", ceilings)
    if "1b" not in skip:
        models = run_section(
            "correctness 1B", correctness, "llama-3.2-1b", "1B", True, engine_kwargs, "fp32" not in skip
        )
        if models:
            models[1].engine.shutdown()
        del models
        free_memory()
    if "roles" not in skip:
        run_section("role profiles", role_profiles)
    if "correct" in skip:  # speed only: dummy weights, no transformers model
        hf, llm = (
            None,
            LLM(
                model="preset:llama-3.1-8b",
                load_format="dummy",
                gpu_memory_utilization=args.gpu_memory_utilization,
                **engine_kwargs,
            ),
        )
    else:
        hf, llm = run_section(
            "correctness 8B",
            correctness,
            "llama-3.1-8b",
            "8B",
            False,
            dict(engine_kwargs, gpu_memory_utilization=args.gpu_memory_utilization),
            "fp32" not in skip,
        ) or (None, None)
    if llm is not None and "speed" not in skip:
        run_section("speed 8B", speed, llm, None if "hf" in skip or hf is None else hf)
    del hf
    free_memory()
    if llm is not None and "micro" not in skip:
        run_section("micro", micro, llm)
    if llm is not None:
        run_section("KV staging", kv_staging, llm)
    (out / "gpu_suite.json").write_text(json.dumps(FIG, indent=1, default=str))
    log("\n" + format_table())


def format_table() -> str:
    widths = [max(len(r[i]) for r in ROWS) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in ROWS]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
