"""What the batch-invariant mode costs: prefill and decode tokens per second with
``EngineArgs(batch_invariant=True)`` and without, at batch 1, 8 and 32, on the default model.

    python benchmarks/batch_invariant.py [--batches 1,8,32] [--prompt-tokens 256] [--new-tokens 64]
    python benchmarks/batch_invariant.py --gemm   # the GEMMs alone, GFLOP/s by row count

Prefill: B prompts of ``--prompt-tokens`` tokens, one output token each, timed from the first
step to the last (one prefill step at these sizes). Decode: B prompts of 64 tokens decode
``--new-tokens`` tokens each (greedy, ignore_eos); only the decode steps are timed, as in
benchmarks/zos.py. Prompts are fixed token ids; no prefix caching. Each configuration runs once
to warm up, then ``--repeats`` times, the two modes' engines taking turns; the table shows the
best run of each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import print_table  # noqa: E402


def prompts(batch: int, length: int, salt: int) -> list[dict]:
    return [
        {"prompt_token_ids": [(i * 7919 + j * 31 + salt) % 40000 + 100 for j in range(length)]} for i in range(batch)
    ]


def prefill_tok_s(engine, batch: int, length: int, salt: int) -> float:
    from pdinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts(batch, length, salt)):
        engine.add_request(f"p{salt}-{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * length / (time.perf_counter() - start)


def decode_tok_s(engine, batch: int, new_tokens: int, salt: int) -> float:
    from pdinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(batch, 64, salt)):
        engine.add_request(f"d{salt}-{i}", p, params)
    while engine.scheduler.waiting:  # the prefill first, untimed
        engine.step()
    engine.step()  # (with zero-overhead scheduling this waits for the last prefill)
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return batch * steps / (time.perf_counter() - start)


def measure(batches: list[int], args) -> dict[tuple[str, int, bool], float]:
    """Best tok/s by (phase, batch, batch_invariant). The two engines take turns run by run, so a
    load that comes and goes on a shared machine falls on both alike."""
    from pdinfer import EngineArgs, LLMEngine

    engines = {
        mode: LLMEngine(
            EngineArgs(batch_invariant=mode, kv_cache_memory=1 << 30, max_model_len=1024, enable_prefix_caching=False)
        )
        for mode in (False, True)
    }
    results: dict[tuple[str, int, bool], float] = {}
    salt = 0
    for batch in batches:
        for phase, fn, size in (
            ("prefill", prefill_tok_s, args.prompt_tokens),
            ("decode", decode_tok_s, args.new_tokens),
        ):
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats + 1):
                for mode, engine in engines.items():
                    salt += 1
                    rates[mode].append(fn(engine, batch, size, salt))
            for mode in engines:
                results[(phase, batch, mode)] = max(rates[mode][1:])  # the first is a warm-up
    for engine in engines.values():
        engine.shutdown()
    return results


def gemm_table(rows_list: list[int]) -> None:
    """GFLOP/s of the default dispatch and of the mode's kernel, for three of the default model's
    weights (a Q4_1 gate/up and down, the Q8_0 vocabulary projection), by row count."""
    import torch

    from pdinfer import env
    from pdinfer.layers import cpu_kernels
    from pdinfer.layers.cpu_linear import PackedLinear
    from pdinfer.models.loader import load_quantized_blocks, resolve_model

    folder, _ = resolve_model(None, env.get("PDINFER_CACHE_DIR"))
    blocks, lib = load_quantized_blocks(folder), cpu_kernels.load(env.get("PDINFER_CACHE_DIR"))
    table = []
    for name in ("layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.down_proj.weight", "embed_tokens.weight"):
        quant = blocks[name]
        weight = quant.dequantize()
        layers = {
            mode: PackedLinear(weight, None, lib, quant, amx=True, batch_invariant=mode) for mode in (False, True)
        }
        for m in rows_list:
            x = torch.randn(m, quant.k)
            gflops = {}
            for mode, layer in layers.items():
                layer(x)
                start, calls = time.perf_counter(), 0
                while time.perf_counter() - start < 0.3:
                    layer(x)
                    calls += 1
                gflops[mode] = 2 * m * quant.n * quant.k * calls / (time.perf_counter() - start) / 1e9
            table.append([name.replace(".weight", ""), m, f"{gflops[False]:.0f}", f"{gflops[True]:.0f}"])
    print_table(table, ["weight", "rows", "default GFLOP/s", "batch-invariant GFLOP/s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm", action="store_true", help="time the GEMMs alone instead")
    args = parser.parse_args()
    if args.gemm:
        gemm_table([1, 4, 8, 32, 256])
        return
    batches = [int(b) for b in args.batches.split(",")]
    results = measure(batches, args)
    rows = []
    for phase in ("prefill", "decode"):
        for batch in batches:
            off, on = results[(phase, batch, False)], results[(phase, batch, True)]
            rows.append([phase, batch, f"{off:.0f}", f"{on:.0f}", f"{on / off:.2f}"])
    print_table(rows, ["phase", "batch", "default tok/s", "batch-invariant tok/s", "ratio"])


if __name__ == "__main__":
    main()
