"""P/D on two GPUs behind the router, the way a user runs it: ``pdinfer launch``, HTTP in front.

    python benchmarks/two_gpu_router.py [--out DIR] [--connector nccl] [--dry-run]

1. ``pdinfer serve --role normal`` on GPU 0 alone; the workload through its OpenAI API.
2. ``pdinfer launch --prefill 1 --decode 1`` (PE on GPU 0, CE on GPU 1: launch gives each engine
   its own GPU) with the router in front; the same workload through the router.
Each request streams with ``return_token_ids``, so outputs compare token for token without a
tokenizer (the 8B shape has dummy weights and none). Prints TTFT, TPOT and throughput of both,
whether P/D's tokens equal NORMAL's, and every engine's free KV blocks after the run
(``/debug/kv``). ``--dry-run``: the same on CPU with the SmolLM2 shape, to test the script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import httpx

from pdinfer.serving.launch import Child, free_port, start_child, stop_all, wait_healthy

SAFETY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def serve(name: str, args: list[str], log: Path, timeout_s: float) -> Child:
    """``pdinfer <args>`` on a free port, healthy (a child named "router" also waits for every
    engine behind it), through ``pdinfer launch``'s own child handling."""
    port = free_port()
    child = Child(
        name, [sys.executable, "-m", "pdinfer.cli", *args, "--port", str(port)], f"http://127.0.0.1:{port}", log
    )
    start_child(child)
    failed = wait_healthy([child], timeout_s)
    if failed is not None:
        stop_all([child])
        raise RuntimeError(f"{name} exited or is not healthy in {timeout_s:.0f} s:\n{failed.log_tail()}")
    return child


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; token ids, TTFT and end time (s from the request)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start, first, tokens, error = time.perf_counter(), None, [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {resp.read()[:300]!r}", "tokens": [], "ttft": 0, "done": 0}
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    first = first or time.perf_counter() - start
                    tokens += choice["token_ids"]
    return {"tokens": tokens, "ttft": first or 0.0, "done": time.perf_counter() - start, "error": error}


def run_workload(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    results: dict[int, dict] = {}
    lock = threading.Lock()
    queue = list(range(len(prompts)))
    start = time.perf_counter()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            results[i] = one_request(url, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results.values())
    tpot = sorted((r["done"] - r["ttft"]) / max(1, len(r["tokens"]) - 1) for r in results.values())
    return {
        "tokens": {str(i): results[i]["tokens"] for i in sorted(results)},
        "errors": [r["error"] for r in results.values() if r["error"]],
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot),
        "tpot_p50_ms": 1e3 * tpot[len(tpot) // 2],
        "out_tok_s": sum(len(r["tokens"]) for r in results.values()) / span,
        "span_s": span,
    }


def kv_state(url: str) -> list[int]:
    state = httpx.get(f"{url}/debug/kv", timeout=10).json()
    return [state["free_blocks"], state["total_blocks"]]


def blocks_back(url: str, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    state = kv_state(url)
    while state[0] != state[1] and time.monotonic() < deadline:
        time.sleep(0.3)
        state = kv_state(url)
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out/two_gpu_router"))
    parser.add_argument("--connector", default="nccl")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    os.environ.update({**SAFETY, "PYTHONUNBUFFERED": "1"})  # the children inherit them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    model_flags = ["--model", "preset:smollm2-135m" if dry else "preset:llama-3.1-8b", "--load-format", "dummy"]
    model_flags += (
        ["--device", "cpu", "--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
        if dry
        else ["--max-model-len", "4096", "--max-num-seqs", "64"]
    )
    rng = random.Random(11)
    vocab = 49152 if dry else 128256
    n, lo, hi = (6, 20, 120) if dry else (args.num_prompts, 256, 2048)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    max_tokens = 8 if dry else 128
    concurrency = 3 if dry else args.concurrency
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "connector": args.connector}

    # 1. NORMAL on GPU 0
    normal = serve(
        "normal",
        ["serve", "--role", "normal", *model_flags, *([] if dry else ["--device", "cuda:0"])],
        out / "normal.log",
        600,
    )
    url = normal.url
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        one_request(url, model, prompts[0][:64], 4)  # warm-up
        result["normal"] = run_workload(url, model, prompts, max_tokens, concurrency)
        result["normal"]["blocks"] = blocks_back(url)
    finally:
        stop_all([normal])
    print(f"NORMAL done: {result['normal']['out_tok_s']:.0f} tok/s", flush=True)

    # 2. P/D behind the router: PE on GPU 0, CE on GPU 1 (launch assigns them)
    launch = serve(
        "router",
        [
            "launch",
            "--prefill",
            "1",
            "--decode",
            "1",
            *model_flags,
            "--kv-connector",
            args.connector,
            "--log-dir",
            str(out),
        ],
        out / "launch.log",
        900,
    )
    url = launch.url
    try:
        engines = httpx.get(f"{url}/debug/engines", timeout=10).json()
        one_request(url, model, prompts[0][:64], 4)
        result["pd"] = run_workload(url, model, prompts, max_tokens, concurrency)
        result["pd"]["blocks"] = {e["url"]: blocks_back(e["url"]) for e in engines}
        result["pd"]["engines"] = engines
    finally:
        stop_all([launch])
    (out / "two_gpu_router.json").write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)


def table(r: dict) -> str:
    normal, pd = r["normal"], r["pd"]
    same = sum(pd["tokens"].get(k) == v for k, v in normal["tokens"].items())
    lines = [
        "| setup | TTFT mean (p50) | TPOT mean | output tok/s | errors | KV blocks after |",
        "|---|---|---|---|---|---|",
    ]
    for name, w, blocks in (
        ("NORMAL, GPU 0, `pdinfer serve`", normal, [normal["blocks"]]),
        (f"P/D {r['connector']}, PE GPU 0 + CE GPU 1, `pdinfer launch` + router", pd, list(pd["blocks"].values())),
    ):
        lines.append(
            f"| {name} | {w['ttft_mean_s']:.2f} s ({w['ttft_p50_s']:.2f}) | {w['tpot_mean_ms']:.1f} ms | "
            f"{w['out_tok_s']:.0f} | {len(w['errors'])} | " + ", ".join(f"{b[0]}/{b[1]}" for b in blocks) + " |"
        )
    lines.append(f"\nP/D tokens = NORMAL tokens (greedy, through HTTP): {same}/{len(normal['tokens'])} requests")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
