"""P/D under overload: what request migration costs, measured through the router.

    python benchmarks/migration.py                                   # CPU, the default model
    python benchmarks/migration.py --model preset:llama-3.1-8b --load-format dummy \
        --concurrency 256 --requests 1024 --input-len 512 --output-len 128 \
        --small-blocks 6000 --large-blocks 16000 --pd-arg=--kv-connector --pd-arg=cuda_ipc --clients 4

One workload (``--requests`` streamed requests of ``--input-len`` random prompt tokens and exactly
``--output-len`` new tokens, greedy, ``ignore_eos``, ``--concurrency`` in flight) through
``pdinfer launch --prefill 1 --decode 1`` twice, in one run: with ``--small-blocks`` KV blocks
per engine (the CE runs short, gives requests up, and the router migrates them: the PE
prefills prompt + tokens so far again) and with ``--large-blocks`` (no migration). For each:
failed requests (the point: 0), output tok/s, TTFT and TPOT p50, migrations by reason, their
latency (from the CE giving a request up to its next token, the router's histogram) and the
tokens handed to the PE again. ``--json`` writes the numbers. Migration moves K/V only by a PE's
recompute (docs/kv-transfer.md says why), so there is no CE -> CE figure to give.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import httpx
from serve_vs_offline import Servers, free_port, make_prompts, run_load, vocab_size

_SAMPLE = re.compile(r"^(pdinfer_router_migration\w*)(\{[^}]*\})? (\S+)$", re.M)


def router_migrations(url: str) -> dict:
    """The router's migration counters and latency histogram (sums over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"latency_sum_s": 0.0, "latency_count": 0.0, "prefill_tokens": 0.0}
    reasons: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        if name == "pdinfer_router_migrations_total":
            reasons[re.search(r'reason="([^"]*)"', labels).group(1)] = float(value)
        elif name == "pdinfer_router_migration_latency_seconds_sum":
            out["latency_sum_s"] = float(value)
        elif name == "pdinfer_router_migration_latency_seconds_count":
            out["latency_count"] = float(value)
        elif name == "pdinfer_router_migration_prefill_tokens_total":
            out["prefill_tokens"] = float(value)
    return {**out, "by_reason": reasons}


def _difference(after: dict, before: dict) -> dict:
    reasons = {k: v - before["by_reason"].get(k, 0.0) for k, v in after["by_reason"].items()}
    count = after["latency_count"] - before["latency_count"]
    return {
        "migrations": sum(reasons.values()),
        "by_reason": {k: v for k, v in reasons.items() if v},
        "migration_latency_mean_s": (after["latency_sum_s"] - before["latency_sum_s"]) / count if count else None,
        "reprefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
    }


def cluster_run(args, blocks: int, prompts, log_dir: Path) -> dict:
    """One P/D cluster with ``blocks`` KV blocks per engine, the workload through its router."""
    servers = Servers(log_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--model", args.model] if args.model else []
    flags += ["--load-format", args.load_format] if args.load_format else []
    flags += ["--max-model-len", str(args.input_len + args.output_len + 16), "--num-kv-blocks", str(blocks)]
    flags += ["--max-num-seqs", str(args.concurrency), *args.pd_arg]
    try:
        servers.start("launch", ["launch", "--prefill", "1", "--decode", "1", "--port", str(port), *flags])
        servers.wait_healthy(url)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = max(1, args.concurrency // 8)
        run_load(url, model, prompts[:warm], 8, warm, 1)
        before = router_migrations(url)
        result = run_load(url, model, prompts, args.output_len, args.concurrency, args.clients)
        return {**result, **_difference(router_migrations(url), before), "blocks": blocks}
    finally:
        servers.stop()


def format_table(rows: dict) -> str:
    lines = [
        "| KV blocks per engine | ok / failed | output tok/s | TTFT p50 s | TPOT p50 ms | migrations (by reason) "
        "| migration latency mean s | tokens re-prefilled |",
        "|" + "---|" * 8,
    ]
    for name, r in rows.items():
        if "output_tok_s" not in r:
            lines.append(f"| {r.get('blocks')} ({name}) | 0 / all: {r.get('error')} | | | | | | |")
            continue
        latency = r["migration_latency_mean_s"]
        lines.append(
            f"| {r['blocks']} ({name}) | {r['ok']} / {r['failed']} | {r['output_tok_s']:.0f} | {r['ttft_p50_s']:.2f} "
            f"| {r['tpot_p50_ms']:.1f} | {r['migrations']:.0f} {r['by_reason'] or ''} "
            f"| {'-' if latency is None else f'{latency:.3f}'} | {r['reprefill_tokens']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--small-blocks", type=int, default=96, help="KV blocks per engine: a CE that runs short")
    p.add_argument("--large-blocks", type=int, default=1024, help="KV blocks per engine: room for every request")
    p.add_argument("--clients", type=int, default=1, help="client processes")
    p.add_argument("--pd-arg", action="append", default=[], help="extra flag for launch (engines and router)")
    p.add_argument("--runs", default="short,roomy", help="which of the two clusters to run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompts = make_prompts(args.requests, args.input_len, vocab_size(args))
    log_dir = Path(tempfile.mkdtemp(prefix="migration-"))
    rows: dict = {}
    runs = {"short": args.small_blocks, "roomy": args.large_blocks}
    for name, blocks in [(name, runs[name]) for name in args.runs.split(",")]:
        print(f"{name}: {blocks} KV blocks per engine ...", file=sys.stderr, flush=True)
        rows[name] = cluster_run(args, blocks, prompts, log_dir / name)
        print(f"  {rows[name]}", file=sys.stderr, flush=True)
        if args.json:  # after each run, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(format_table(rows))
    print(f"(server logs: {log_dir})")


if __name__ == "__main__":
    main()
