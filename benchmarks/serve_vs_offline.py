"""One workload offline and served, in one run: what HTTP costs the engine.

    python benchmarks/serve_vs_offline.py                       # CPU, the default model
    python benchmarks/serve_vs_offline.py --model preset:llama-3.1-8b --load-format dummy \
        --concurrency 64,256 --input-len 512 --output-len 128 --clients 4 --api-server-count 4

Each concurrency C runs ``--requests-per-stream`` x C requests of ``--input-len`` random prompt
token ids and exactly ``--output-len`` new tokens (greedy, ``ignore_eos``), in these modes:
- ``offline``: ``LLM.generate`` with ``max_num_seqs=C`` (C sequences in flight, like C streams);
- ``serve``: ``pdinfer serve``, C concurrent streamed requests from ``--clients`` processes;
- ``router``: ``pdinfer router --normal`` in front of that same kind of engine;
- ``pd``: ``pdinfer launch --prefill 1 --decode 1`` (a PE and a CE on the same device). On one
  GPU the two engines share its memory: give each a fixed cache, e.g. ``--pd-arg=--num-kv-blocks
  --pd-arg=16000 --pd-arg=--kv-connector --pd-arg=cuda_ipc`` for the 8B shape (with the default
  ``--gpu-memory-utilization`` the first engine takes the room the second needs).
Each mode runs in processes of its own (the device is free again between modes). Output tok/s is
all output tokens over the wall time from the first request to the last token; TTFT and TPOT
(time per output token after the first) are per request, p50, offline too (there the engine's
own step loop runs the same closed loop as the clients: C in flight, the next added when one
ends). For the served modes, ``front CPU us/token`` is the CPU time of the HTTP processes (the
API servers of ``serve``; the router's processes in ``router`` mode) over the output tokens: what the
HTTP path costs per token, wherever its processes run. The table gives each served mode
as a fraction of offline at the same concurrency, and the router's as a fraction of ``serve``.
``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("offline", "serve", "router", "pd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


# --- offline -------------------------------------------------------------------------------------
def run_offline(engine_args: dict, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """The engine's own step loop in this process, closed-loop like the served clients:
    ``concurrency`` requests in flight, the next added when one finishes. Per-request TTFT and
    TPOT as a served client measures them, without HTTP."""
    from pdinfer import LLM, SamplingParams

    llm = LLM(**{**engine_args, "max_num_seqs": concurrency})
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[: min(len(prompts), concurrency)]], params, use_tqdm=False)
    engine = llm.engine
    todo = list(enumerate(prompts))[::-1]
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    tokens: dict[str, int] = {}

    def add_next() -> None:
        i, prompt = todo.pop()
        start[f"r{i}"] = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)

    for _ in range(min(concurrency, len(todo))):
        add_next()
    while engine.has_unfinished_requests():
        deltas = engine.step_deltas()
        now = time.perf_counter()
        for d in deltas:
            n = sum(len(s.token_ids) for s in d.seqs)
            if n:
                first.setdefault(d.request_id, now)
                tokens[d.request_id] = tokens.get(d.request_id, 0) + n
            if d.finished:
                end[d.request_id] = now
                if todo:
                    add_next()
    wall = max(end.values()) - min(start.values())
    tpots = [(end[r] - first[r]) / (tokens[r] - 1) for r in end if tokens.get(r, 0) > 1]
    return {
        "output_tok_s": sum(tokens.values()) / wall,
        "wall_s": wall,
        "tokens": sum(tokens.values()),
        "ok": len(end),
        "ttft_p50_s": statistics.median(first[r] - start[r] for r in first),
        "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else None,
    }


def _offline_child(conn, engine_args, prompts, output_len, concurrency) -> None:
    try:
        conn.send(run_offline(engine_args, prompts, output_len, concurrency))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": repr(exc)})


# --- the load generator ----------------------------------------------------------------------------
async def _stream_one(client, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # a token counts as arrived even where it has no text
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"ok": False, "error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"ok": False, "error": str(event["error"])[:200]}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and any(c.get("token_ids") for c in event.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ok": True, "start": start, "end": end, "ttft": (first or end) - start, "tokens": tokens}


async def _client_main(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int) -> list:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    results.append(await _stream_one(client, url, model, prompt, output_len))
                except Exception as exc:  # noqa: BLE001 - counted as a failed request
                    results.append({"ok": False, "error": repr(exc)})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _client_child(conn, url, model, prompts, output_len, concurrency, start_at) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    conn.send(asyncio.run(_client_main(url, model, prompts, output_len, concurrency)))


def run_load(url: str, model: str, prompts, output_len: int, concurrency: int, clients: int) -> dict:
    """``concurrency`` streams split over ``clients`` processes, so the client is not the limit."""
    ctx = mp.get_context("spawn")
    clients = max(1, min(clients, concurrency))
    children = []
    start_at = time.time() + 2.0  # every client starts together, after its imports
    for i in range(clients):
        share = prompts[i::clients]
        streams = concurrency // clients + (i < concurrency % clients)
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_child, args=(child, url, model, share, output_len, streams, start_at))
        proc.start()
        children.append((proc, parent))
    results = []
    for proc, conn in children:
        results += conn.recv()
        proc.join()
    ok = [r for r in results if r["ok"]]
    if not ok:
        return {"error": results[0].get("error") if results else "no results", "ok": 0}
    wall = max(r["end"] for r in ok) - min(r["start"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    tpots = [(r["end"] - r["start"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    return {
        "output_tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if not r["ok"]), None),
        "ttft_p50_s": statistics.median(r["ttft"] for r in ok),
        "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else None,
    }


# --- servers ---------------------------------------------------------------------------------------
class Servers:
    """Starts pdinfer processes, waits until they answer /health, stops them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "pdinfer.cli", *argv]
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def wait_healthy(self, url: str, timeout_s: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a server exited ({p.args[3:5]}); logs in {self.log_dir}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{url} not healthy after {timeout_s} s; logs in {self.log_dir}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        self.procs = []


def engine_flags(args) -> list[str]:
    flags = ["--model", args.model] if args.model else []
    if args.load_format:
        flags += ["--load-format", args.load_format]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    flags += ["--max-model-len", str(args.input_len + args.output_len + 16)]
    return flags + args.engine_arg


def served(mode: str, args, concurrency: int, prompts, log_dir: Path) -> dict:
    servers = Servers(log_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = [*engine_flags(args), "--max-num-seqs", str(concurrency)]
    api = ["--api-server-count", str(args.api_server_count)] if args.api_server_count else []
    try:
        if mode == "serve":
            servers.start("serve", ["serve", "--port", str(port), *api, *engine])
        elif mode == "router":
            engine_port = free_port()
            servers.start("serve", ["serve", "--port", str(engine_port), *api, *engine])
            servers.wait_healthy(f"http://127.0.0.1:{engine_port}")
            model = ["--model", args.model] if args.model else []
            servers.start(
                "router",
                ["router", "--port", str(port), "--normal", f"http://127.0.0.1:{engine_port}", *model]
                + ["--normal-max-prompt-tokens", str(10 * args.input_len), "--workers", str(args.router_workers)],
            )
        else:
            pd = [*engine, *args.pd_arg]
            servers.start("launch", ["launch", "--prefill", "1", "--decode", "1", "--port", str(port), *pd])
        servers.wait_healthy(url)
        model = _served_model(url)
        run_load(url, model, prompts[: min(len(prompts), concurrency)], args.output_len, concurrency, args.clients)
        front = _front_pids(mode, servers)
        cpu_before = [cpu_seconds(pid) for pid in front]
        result = run_load(url, model, prompts, args.output_len, concurrency, args.clients)
        if front and result.get("tokens"):
            cpu = [cpu_seconds(pid) - before for pid, before in zip(front, cpu_before)]
            result["front_cpu_s"] = cpu  # per HTTP process
            result["front_cpu_us_per_token"] = 1e6 * sum(cpu) / result["tokens"]
        return result
    finally:
        servers.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (Linux /proc), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[tuple[int, str]]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(stat.parent.name), cmdline))
        except (OSError, ValueError):
            continue
    return found


def _front_pids(mode: str, servers: Servers) -> list[int]:
    """The HTTP processes: serve's own and its extra API servers; the router alone."""
    if mode == "router":
        pid = servers.procs[1].pid
        return [pid] + [c for c, cmd in _children(pid) if "--listen-fd" in cmd]
    if mode == "serve":
        pid = servers.procs[0].pid
        return [pid] + [c for c, cmd in _children(pid) if "pdinfer.serving.api_process" in cmd]
    return []


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def offline(args, concurrency: int, prompts) -> dict:

    engine_args: dict = {"max_model_len": args.input_len + args.output_len + 16}
    if args.model:
        engine_args["model"] = args.model
    if args.load_format:
        engine_args["load_format"] = args.load_format
    if args.dtype:
        engine_args["dtype"] = args.dtype
    engine_args.update(json.loads(args.offline_engine_json))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_offline_child, args=(child, engine_args, prompts, args.output_len, concurrency))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def vocab_size(args) -> int:
    from pdinfer import env
    from pdinfer.models.loader import resolve_model
    from pdinfer.models.spec import ModelSpec

    _, hf_config = resolve_model(args.model, env.get("PDINFER_CACHE_DIR"))
    return ModelSpec.from_hf_config(hf_config).vocab_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--api-server-count", type=int, default=None, help="passed to serve")
    p.add_argument("--router-workers", type=int, default=1, help="router mode: the router's --workers")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (serve, launch)")
    p.add_argument("--pd-arg", action="append", default=[], help="extra flag for launch only")
    p.add_argument("--offline-engine-json", default="{}", help="extra EngineArgs for offline, as JSON")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from pdinfer.serving.serve_cli import SERVE_PREFILL_ATTEMPT_INTERVAL

    # Offline runs the scheduling policy that serve runs (unless the environment sets one for both).
    os.environ.setdefault("PDINFER_PREFILL_ATTEMPT_INTERVAL", str(SERVE_PREFILL_ATTEMPT_INTERVAL))
    modes = args.modes.split(",")
    vocab = vocab_size(args)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-vs-offline-"))
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        prompts = make_prompts(concurrency * args.requests_per_stream, args.input_len, vocab, seed=concurrency)
        row: dict = {"concurrency": concurrency}
        for mode in modes:
            print(f"C={concurrency} {mode} ...", file=sys.stderr, flush=True)
            if mode == "offline":
                row[mode] = offline(args, concurrency, prompts)
            else:
                row[mode] = served(mode, args, concurrency, prompts, log_dir / f"{mode}-{concurrency}")
            print(f"  {row[mode]}", file=sys.stderr, flush=True)
            if args.json:  # after every mode, so a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [*rows, row]}, indent=1))
        rows.append(row)
    print(format_table(rows, modes))
    print(f"(server logs: {log_dir})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def format_table(rows: list[dict], modes: list[str]) -> str:
    head = (
        "| streams | mode | output tok/s | vs offline | vs serve | TTFT p50 s | TPOT p50 ms "
        "| front CPU us/token | ok/failed |"
    )
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        base = row.get("offline", {}).get("output_tok_s")
        serve = row.get("serve", {}).get("output_tok_s")
        for mode in modes:
            r = row[mode]
            tps = r.get("output_tok_s")
            if tps is None:
                lines.append(f"| {row['concurrency']} | {mode} | failed: {r.get('error')} | | | | | | |")
                continue
            vs_off = f"{tps / base:.0%}" if base and mode != "offline" else ""
            vs_serve = f"{tps / serve:.0%}" if serve and mode in ("router", "pd") else ""
            ttft = f"{r['ttft_p50_s']:.2f}" if r.get("ttft_p50_s") is not None else ""
            tpot = f"{r['tpot_p50_ms']:.1f}" if r.get("tpot_p50_ms") is not None else ""
            cpu = f"{r['front_cpu_us_per_token']:.0f}" if r.get("front_cpu_us_per_token") is not None else ""
            lines.append(
                f"| {row['concurrency']} | {mode} | {tps:,.0f} | {vs_off} | {vs_serve} | {ttft} | {tpot} "
                f"| {cpu} | {r.get('ok')}/{r.get('failed', 0)} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
