"""The batch-invariant mode on the GPU, in one call: is it invariant, and what does it cost.

    python benchmarks/gpu_batch_invariant.py [--out DIR] [--skip 8b,1b,default,speed]
    python benchmarks/gpu_batch_invariant.py --smoke   # the same flow on the CPU, default model

1. invariance (``EngineArgs(batch_invariant=True)``, bfloat16, dummy weights; the Llama-3.1-8B
   shape, then the Llama-3.2-1B shape, whose logits go through the tied embedding): one target
   request (a 3000-token prompt, 24 greedy tokens, prompt log-probs) alone, then inside batches
   of 2, 8, 64 and 256 requests (random prompts of 16-1024 tokens, 1-48 new tokens each). The
   requests queued ahead of it cut its prompt into chunks: 2999 + 1 token (the last chunk a
   one-token prefill step), 100 + 2900, and wherever the random ones end. Its decode steps run
   in batches of every size its neighbours leave. Reported per batch: max |logit difference|
   against alone over its 24 sampled rows (must be 0), and whether its tokens, log-probs and
   prompt log-probs are equal. The default mode runs the same requests on the 8B shape as a
   control (its differences show that the workload would find a reduction that depends on
   the batch).
2. cost on the 8B shape: decode tok/s at batch 1, 64 and 256 (576-token prompts, 128 new
   tokens: ``gpu_speed.bench_decode``) and prefill tok/s at 4 x 2048 tokens a step
   (``gpu_speed.bench_prefill``), the mode against the default mode.

Prints a table; writes ``gpu_batch_invariant.json`` and ``gpu_batch_invariant.md`` to ``--out``
(default $OUT). Exits 1 if any batch-invariant logit differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import free_memory, log  # noqa: E402
from benchmarks.gpu_speed import bench_decode, bench_prefill  # noqa: E402
from pdinfer import LLM, SamplingParams  # noqa: E402

TARGET_SEED = 7_777  # no other request has this seed: it finds the target's rows
GPU_SHAPE = dict(target_len=3000, new_tokens=24, budget=8192, other_len=(16, 1024), batches=(2, 8, 64, 256))
SMOKE_SHAPE = dict(target_len=50, new_tokens=4, budget=64, other_len=(1, 20), batches=(2, 8, 17))


class TargetLogits:
    """The logits rows the sampler gets for the target request, by input position (on the
    device); hooks the runner's ``execute`` and ``sampler``, CPU and CUDA alike."""

    def __init__(self, llm: LLM):
        runner = llm.engine.model_runner
        self.rows: dict[int, torch.Tensor] = {}
        self._logits: torch.Tensor | None = None
        execute, sampler = runner.execute, runner.sampler

        def recording_sampler(logits, tensors):
            self._logits = logits
            return sampler(logits, tensors)

        def recording_execute(inp):
            self._logits = None
            result = execute(inp)
            for i, spec in enumerate(inp.samples):
                if spec.seed == TARGET_SEED and self._logits is not None:
                    position = inp.positions[spec.row]
                    if position in self.rows:
                        raise RuntimeError(f"position {position} sampled twice")
                    self.rows[position] = self._logits[i].clone()
            return result

        runner.execute = recording_execute
        runner.sampler = recording_sampler

    def take(self) -> dict[int, torch.Tensor]:
        rows, self.rows = self.rows, {}
        return rows


def scenarios(shape: dict) -> list[tuple[str, list[int], int]]:
    """(name, prompt lengths queued ahead of the target, requests after it)."""
    budget, target = shape["budget"], shape["target_len"]
    out = [("alone", [], 0)]
    for batch in shape["batches"]:
        if batch == 2:  # the target's prompt in two chunks, the last one token
            out.append((f"batch {batch}, prompt cut {target - 1} + 1", [budget - target + 1], 0))
        elif batch == 8:
            cut = min(100, target // 3)
            out.append((f"batch {batch}, prompt cut {cut} + rest", [budget - cut], batch - 2))
        else:
            ahead = [shape["other_len"][1]] * 3
            out.append((f"batch {batch}", ahead, batch - 1 - len(ahead)))
    return out


def run_scenario(llm: LLM, rec: TargetLogits, shape: dict, ahead: list[int], num_after: int, seed: int) -> dict:
    vocab = llm.engine.spec.vocab_size
    rng = random.Random(seed)
    target_ids = random.Random(1).choices(range(100, vocab - 1), k=shape["target_len"])

    def other(length: int) -> tuple[dict, SamplingParams]:
        ids = rng.choices(range(100, vocab - 1), k=length)
        params = SamplingParams(
            temperature=0.0, max_tokens=rng.randint(1, 48), ignore_eos=True, seed=rng.randrange(999)
        )
        return {"prompt_token_ids": ids}, params

    requests = [other(n) for n in ahead]
    target_params = SamplingParams(
        temperature=0.0,
        max_tokens=shape["new_tokens"],
        ignore_eos=True,
        seed=TARGET_SEED,
        logprobs=5,
        prompt_logprobs=1,
    )
    requests.append(({"prompt_token_ids": target_ids}, target_params))
    requests += [other(rng.randint(*shape["other_len"])) for _ in range(num_after)]
    outputs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    out = outputs[len(ahead)]
    return {
        "rows": rec.take(),
        "tokens": out.outputs[0].token_ids,
        "logprobs": out.outputs[0].logprobs,
        "prompt_logprobs": out.prompt_logprobs,
    }


def compare(ref: dict, got: dict) -> dict:
    common = sorted(set(ref["rows"]) & set(got["rows"]))
    diff = max((float((ref["rows"][p].float() - got["rows"][p].float()).abs().max()) for p in common), default=0.0)
    return {
        "rows": len(common),
        "same_positions": sorted(ref["rows"]) == sorted(got["rows"]),
        "max_abs_diff": diff,
        "identical": all(torch.equal(ref["rows"][p], got["rows"][p]) for p in common),
        "tokens_equal": ref["tokens"] == got["tokens"],
        "logprobs_equal": ref["logprobs"] == got["logprobs"],
        "prompt_logprobs_equal": ref["prompt_logprobs"] == got["prompt_logprobs"],
    }


def invariance(llm: LLM, shape: dict) -> list[dict]:
    rec = TargetLogits(llm)
    results, ref = [], None
    for i, (name, ahead, num_after) in enumerate(scenarios(shape)):
        start = time.perf_counter()
        got = run_scenario(llm, rec, shape, ahead, num_after, seed=10 + i)
        if ref is None:
            ref = got
            if len(got["rows"]) != shape["new_tokens"]:
                raise RuntimeError(f"found {len(got['rows'])} target rows, expected {shape['new_tokens']}")
            continue
        res = {"scenario": name, **compare(ref, got), "s": round(time.perf_counter() - start, 1)}
        log(f"  {name}: max |diff| {res['max_abs_diff']:.3g}, identical {res['identical']}, {res}")
        results.append(res)
    return results


def speed(llm: LLM) -> dict:
    figures = {f"decode_{b}_tok_s": bench_decode(llm, b)["tok_s"] for b in (1, 64, 256)}
    figures["prefill_4x2048_tok_s"] = bench_prefill(llm, 4, 2048)
    log(f"  {figures}")
    return figures


def build(model: str | None, batch_invariant: bool, shape: dict, smoke: bool) -> LLM:
    kwargs = dict(
        batch_invariant=batch_invariant,
        chunked_prefill=True,
        max_num_batched_tokens=shape["budget"],
        enable_prefix_caching=False,  # every run computes the target's prompt
        max_num_seqs=256,
    )
    if smoke:
        return LLM(kv_cache_memory=256 << 20, max_model_len=1024, **kwargs)
    return LLM(model=model, load_format="dummy", gpu_memory_utilization=0.45, max_model_len=8192, **kwargs)


def markdown(fig: dict) -> str:
    lines = ["| shape | mode | batch (prompt cut) | max abs logit diff | logits identical | tokens, log-probs equal |"]
    lines.append("|---|---|---|---|---|---|")
    for key, results in fig.items():
        if not key.startswith("invariance"):
            continue
        _, shape, mode = key.split(":")
        for r in results:
            equal = r["tokens_equal"] and r["logprobs_equal"] and r["prompt_logprobs_equal"]
            lines.append(
                f"| {shape} | {mode} | {r['scenario']} | {r['max_abs_diff']:.3g} | {r['identical']} | {equal} |"
            )
    if "speed:invariant" in fig and "speed:default" in fig:
        lines += ["", "| 8B, bf16, H200 | default | batch-invariant | ratio |", "|---|---|---|---|"]
        for name, value in fig["speed:invariant"].items():
            base = fig["speed:default"][name]
            lines.append(f"| {name} | {base:.0f} | {value:.0f} | {value / base:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/gpu"))
    parser.add_argument("--skip", default="", help="comma list of: 8b, 1b, default, speed")
    parser.add_argument("--smoke", action="store_true", help="the CPU, the default model, small shapes")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SMOKE_SHAPE if args.smoke else GPU_SHAPE
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    log(f"{device} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    fig: dict = {}
    models = [("smollm2-135m", None)] if args.smoke else [("8B", "preset:llama-3.1-8b"), ("1B", "preset:llama-3.2-1b")]
    for name, model in models:
        if name.lower() in skip:
            continue
        modes = [True] if name == "1B" or "default" in skip else [True, False]
        for mode in modes:
            label = "invariant" if mode else "default"
            start = time.perf_counter()
            llm = build(model, mode, shape, args.smoke)
            log(f"== {name} {label}: built in {time.perf_counter() - start:.0f} s")
            fig[f"invariance:{name}:{label}"] = invariance(llm, shape)
            if name == "8B" and "speed" not in skip:
                fig[f"speed:{label}"] = speed(llm)
            llm.engine.shutdown()
            del llm
            if not args.smoke:
                free_memory()
    (out / "gpu_batch_invariant.json").write_text(json.dumps(fig, indent=1))
    table = markdown(fig)
    (out / "gpu_batch_invariant.md").write_text(table)
    log("\n" + table)
    broken = [
        r["scenario"]
        for key, results in fig.items()
        if key.startswith("invariance:") and key.endswith(":invariant")
        for r in results
        if not (r["identical"] and r["same_positions"] and r["tokens_equal"] and r["prompt_logprobs_equal"])
    ]
    if broken:
        log(f"NOT INVARIANT: {broken}")
        sys.exit(1)


if __name__ == "__main__":
    main()
