"""KV hand-off cost on loopback: transport GB/s, and TTFT of PE -> CE against NORMAL.

    python benchmarks/kv_transfer.py [--lengths 128,512,2048,8192] [--repeats 3]
                                     [--connector tcp,mooncake]

Part 1 pushes K/V payloads of the size a real prompt has (default model, and a dummy
Llama-3.2-1B-shaped KV layout) from a PE connector to a CE connector on 127.0.0.1: checksum,
send, receive, verify, ack. ``tcp``: ZeroMQ, the bytes in a payload frame. ``mooncake``: the
blocks written by Mooncake's Transfer Engine (TCP) straight into a registered CE "cache", then a
payload-less push; the CE checks the crc32 over its own blocks. CE block ids are shuffled (a
cache after some churn), so each block is its own write. Part 2 runs the default model end to
end: the time to first token of a NORMAL engine against a PE -> CE pair for the same prompts,
and what the hand-off adds, per connector.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import print_table  # noqa: E402

from pdinfer.kv_transfer.protocol import KVLayout, KVPush, checksum, checksum_blocks  # noqa: E402
from pdinfer.kv_transfer.tcp import TcpConnector  # noqa: E402

# bytes of K and V per token, float32: 2 * layers * kv_heads * head_dim * 4
KV_SHAPES = {
    "SmolLM2-135M": 2 * 30 * 3 * 64 * 4,
    "Llama-3.2-1B (dummy)": 2 * 16 * 8 * 64 * 4,
}


BLOCK_TOKENS = 16


def transport(lengths: list[int], repeats: int, connectors: list[str]) -> list[list]:
    """Best and median GB/s per connector; repeats alternate between connectors, so all of them
    see the same machine load."""
    rows = []
    for model, per_token in KV_SHAPES.items():
        block_bytes = per_token * BLOCK_TOKENS
        num_blocks = -(-max(lengths) // BLOCK_TOKENS)
        pairs = {c: _pair(c, block_bytes, num_blocks) for c in connectors}
        for n in lengths:
            rng = np.random.default_rng(n)
            blocks = rng.permutation(num_blocks)[: -(-n // BLOCK_TOKENS)].tolist()
            payload = rng.integers(0, 255, size=len(blocks) * block_bytes, dtype=np.uint8)
            times: dict[str, list[float]] = {c: [] for c in connectors}
            for r in range(repeats):
                for c in connectors:
                    times[c].append(_push_once(*pairs[c], f"{n}-{r}", n, blocks, payload))
            for c in connectors:
                best, median = min(times[c]), float(np.median(times[c]))
                rows.append(
                    [
                        c,
                        model,
                        n,
                        f"{payload.nbytes / 2**20:.1f}",
                        f"{best * 1e3:.1f}",
                        f"{payload.nbytes / best / 1e9:.2f}",
                        f"{payload.nbytes / median / 1e9:.2f}",
                    ]
                )
        for ce, pe, _, _ in pairs.values():
            pe.close()
            ce.close()
    return sorted(rows, key=lambda row: connectors.index(row[0]))


def _push_once(ce, pe, cache, instance, transfer_id, n, blocks, payload) -> float:
    ce.gate.expect(transfer_id, "x", payload.nbytes)  # what a reservation does: the port lets it in
    start = time.perf_counter()
    push = KVPush(
        transfer_id=transfer_id,
        request_id="x",
        instance_id=instance,
        num_tokens=n,
        first_token=0,
        first_tokens=[0],
        seed=0,
        block_ids=blocks,
        nbytes=payload.nbytes,
        checksum=checksum(payload),
    )
    pe.send(ce.address, push, payload)
    arrival = _wait(ce.receive)
    received = [cache[b] for b in blocks] if ce.writes_in_place else [arrival.payload]
    assert checksum_blocks(received) == arrival.push.checksum
    ce.confirm(arrival, ok=True)
    assert _wait(pe.events).ok
    return time.perf_counter() - start


def _pair(connector: str, block_bytes: int, num_blocks: int):
    """A listening CE connector, a PE connector, and the CE's "KV cache" (blocks of bytes)."""
    import torch

    layout = KVLayout("bench", "uint8", 1, 1, 1, BLOCK_TOKENS)
    cache = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)
    if connector == "mooncake":
        from pdinfer.kv_transfer.mooncake import MooncakeConnector

        ce, pe = MooncakeConnector("127.0.0.1"), MooncakeConnector()
    else:
        ce, pe = TcpConnector("127.0.0.1"), TcpConnector()
    ce.register_kv_cache(cache)
    for c in (ce, pe):
        c.register(layout)
    return ce, pe, cache.numpy(), pe.connect(ce.address)


def _wait(poll):
    while True:
        items = poll()
        if items:
            return items[0]
        time.sleep(0.0005)


def ttft(lengths: list[int], repeats: int, connectors: list[str]) -> list[list]:
    """One PE/CE pair at a time (memory); NORMAL runs the same prompts alongside each pair."""
    from pdinfer import EngineArgs, LLMEngine, SamplingParams
    from pdinfer.engine.pd_pair import PDPair

    common = dict(kv_cache_memory=2 << 30, enable_prefix_caching=False, max_num_batched_tokens=8192)
    normal = LLMEngine(EngineArgs(**common))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rows = []
    for c in connectors:
        kv = {"connector": c}
        pair = PDPair(
            LLMEngine(EngineArgs(engine_type="prompt", kv_transfer=kv, **common)),
            LLMEngine(EngineArgs(engine_type="completion", kv_transfer=kv, **common)),
        )
        for n in lengths:
            t_normal, t_pd = [], []
            for r in range(repeats):
                ids = np.random.default_rng(n * 100 + r).integers(100, 40000, size=n).tolist()
                t_normal.append(_first_token_time(normal, f"n{c}{n}-{r}", ids, params, normal.add_request))
                t_pd.append(_first_token_time(pair, f"p{c}{n}-{r}", ids, params, pair.add_request))
            a, b = float(np.median(t_normal)), float(np.median(t_pd))
            rows.append(
                [c, n, f"{a * 1e3:.0f}", f"{b * 1e3:.0f}", f"{(b - a) * 1e3:.0f}", f"{(b / a - 1) * 100:+.1f}%"]
            )
        stats = pair.pe.role.handoff_stats
        print(
            f"{c} hand-offs: {stats['count']}, {stats['bytes'] / 2**20:.1f} MiB, "
            f"mean push->ack {stats['seconds'] / max(stats['count'], 1) * 1e3:.1f} ms"
        )
        pair.pe.shutdown()
        pair.ce.shutdown()
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
    parser.add_argument(
        "--connector", default="tcp", help="comma-separated: tcp (ZeroMQ) and/or mooncake (needs the optional package)"
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    connectors = args.connector.split(",")
    print("## Transport on 127.0.0.1 (checksum + send + verify + ack)\n")
    print_table(
        transport(lengths, args.repeats, connectors),
        ["connector", "KV layout", "tokens", "MiB", "best ms", "best GB/s", "median GB/s"],
    )
    print("\n## TTFT: NORMAL vs PE -> CE (default model, both engines in one process)\n")
    print_table(
        ttft([int(x) for x in args.ttft_lengths.split(",")], args.repeats, connectors),
        ["connector", "prompt tokens", "NORMAL ms", "PE->CE ms", "added ms", "added"],
    )


if __name__ == "__main__":
    main()
