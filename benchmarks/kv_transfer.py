"""KV hand-off cost on loopback: transport GB/s, and TTFT of PE -> CE against NORMAL.

    python benchmarks/kv_transfer.py [--lengths 128,512,2048,8192] [--repeats 3]

Part 1 pushes K/V payloads of the size a real prompt has (default model, and a dummy
Llama-3.2-1B-shaped KV layout) from a PE connector to a CE connector over ZeroMQ TCP on
127.0.0.1: checksum, send, receive, verify, ack. Part 2 runs the default model end to end:
the time to first token of a NORMAL engine against a PE -> CE pair (TCP connector) for the same
prompts, and what the hand-off adds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import print_table  # noqa: E402

from pdinfer.kv_transfer.protocol import KVLayout, KVPush, checksum  # noqa: E402
from pdinfer.kv_transfer.tcp import TcpConnector  # noqa: E402

# bytes of K and V per token, float32: 2 * layers * kv_heads * head_dim * 4
KV_SHAPES = {
    "SmolLM2-135M": 2 * 30 * 3 * 64 * 4,
    "Llama-3.2-1B (dummy)": 2 * 16 * 8 * 64 * 4,
}


def transport(lengths: list[int], repeats: int) -> list[list]:
    layout = KVLayout("bench", "float32", 1, 1, 1, 16)
    ce, pe = TcpConnector("127.0.0.1"), TcpConnector()
    for c in (ce, pe):
        c.register(layout)
    instance = pe.connect(ce.address)
    rows = []
    for model, per_token in KV_SHAPES.items():
        for n in lengths:
            payload = np.random.default_rng(n).integers(0, 255, size=n * per_token, dtype=np.uint8)
            times = []
            for r in range(repeats):
                start = time.perf_counter()
                push = KVPush(transfer_id=f"{n}-{r}", request_id="x", instance_id=instance,
                              num_tokens=n, first_token=0, first_tokens=[0], seed=0,
                              block_ids=[], nbytes=payload.nbytes, checksum=checksum(payload))
                pe.send(ce.address, push, payload)
                arrival = _wait(ce.receive)
                assert checksum(arrival.payload) == arrival.push.checksum
                ce.confirm(arrival, ok=True)
                _wait(pe.events)
                times.append(time.perf_counter() - start)
            best = min(times)
            rows.append([model, n, f"{payload.nbytes / 2**20:.1f}", f"{best * 1e3:.1f}",
                         f"{payload.nbytes / best / 1e9:.2f}"])
    pe.close()
    ce.close()
    return rows


def _wait(poll):
    while True:
        items = poll()
        if items:
            return items[0]
        time.sleep(0.0005)


def ttft(lengths: list[int], repeats: int) -> list[list]:
    from pdinfer import EngineArgs, LLMEngine, SamplingParams
    from pdinfer.engine.completion_engine import CompletionEngine
    from pdinfer.engine.pd_pair import PDPair
    from pdinfer.engine.prefill_engine import PrefillEngine

    mem = 2 << 30
    common = dict(kv_cache_memory=mem, enable_prefix_caching=False, max_num_batched_tokens=8192)
    normal = LLMEngine(EngineArgs(**common))
    pair = PDPair(PrefillEngine(EngineArgs(engine_type="prompt", kv_transfer={"connector": "tcp"}, **common)),
                  CompletionEngine(EngineArgs(engine_type="completion", kv_transfer={"connector": "tcp"}, **common)))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        t_normal, t_pd = [], []
        for r in range(repeats):
            ids = rng.integers(100, 40000, size=n).tolist()
            t_normal.append(_first_token_time(normal, f"n{n}-{r}", ids, params, normal.add_request))
            t_pd.append(_first_token_time(pair, f"p{n}-{r}", ids, params, pair.add_request))
        a, b = float(np.median(t_normal)), float(np.median(t_pd))
        rows.append([n, f"{a * 1e3:.0f}", f"{b * 1e3:.0f}", f"{(b - a) * 1e3:.0f}", f"{(b / a - 1) * 100:+.1f}%"])
    stats = pair.pe.handoff_stats
    print(f"hand-offs: {stats['count']}, {stats['bytes'] / 2**20:.1f} MiB, "
          f"mean push->ack {stats['seconds'] / max(stats['count'], 1) * 1e3:.1f} ms")
    return rows


def _first_token_time(runner, request_id, ids, params, add) -> float:
    start = time.perf_counter()
    add(request_id, {"prompt_token_ids": ids}, params)
    first = None
    while runner.has_unfinished_requests():
        for out in runner.step():
            if first is None and out.request_id == request_id and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048,8192")
    parser.add_argument("--ttft-lengths", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print("## Transport: ZeroMQ TCP on 127.0.0.1 (checksum + send + verify + ack)\n")
    print_table(transport(lengths, args.repeats), ["KV layout", "tokens", "MiB", "ms", "GB/s"])
    print("\n## TTFT: NORMAL vs PE -> CE (default model, TCP connector, one process each side's thread)\n")
    print_table(ttft([int(x) for x in args.ttft_lengths.split(",")], args.repeats),
                ["prompt tokens", "NORMAL ms", "PE->CE ms", "added ms", "added"])


if __name__ == "__main__":
    main()
