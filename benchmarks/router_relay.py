"""What the router's relay of a NORMAL engine's stream costs per token, without a model.

    python benchmarks/router_relay.py --concurrency 64,256 --step-ms 10 --output-len 128

A stand-in engine (an asyncio server in a process of its own, written for this benchmark)
answers ``/health`` and ``/v1/models`` and streams every POST as ``pdinfer serve`` would: one SSE
event of a completion chunk per stream per "step" (``--step-ms``), ``--output-len`` of them, then
``[DONE]``. Clients (``--clients`` processes of raw sockets, cheap so that they leave the CPU to
the router) run C concurrent streams, C requests per stream wave, first straight to the engine
and then through ``pdinfer router --normal``. Printed per C: output tok/s both ways, the router's
as a fraction of direct, and the router's CPU time per relayed token (its processes' user +
system time over the tokens). The engine here costs almost nothing, so the router's CPU per token
is the figure to compare between router versions and machines; on a GPU host the real engine
runs beside it (benchmarks/serve_vs_offline.py measures that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHUNK = {
    "id": "cmpl-0123456789abcdef0123456789abcdef",
    "object": "text_completion",
    "created": 1764700000,
    "model": "SmolLM2-135M-Instruct",
    "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the stand-in engine -------------------------------------------------------------------------
def run_engine(port: int, step_s: float, output_len: int) -> None:
    event = b"data: " + json.dumps(CHUNK, separators=(",", ":")).encode() + b"\n\n"
    frame = b"%x\r\n%s\r\n" % (len(event), event)
    done = b"data: [DONE]\n\n"
    tail = b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
    streams: dict[asyncio.Transport, int] = {}  # transport -> events left

    async def ticker() -> None:
        while True:
            await asyncio.sleep(step_s)
            for transport, left in list(streams.items()):
                if transport.is_closing():
                    del streams[transport]
                elif left:
                    transport.write(frame)
                    streams[transport] = left - 1
                else:
                    transport.write(tail)
                    del streams[transport]

    def answer(transport, status: str, body: bytes) -> None:
        head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        transport.write(head.encode() + body)

    class Conn(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while b"\r\n\r\n" in self.buf:
                head, rest = self.buf.split(b"\r\n\r\n", 1)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(rest) < length:
                    return
                self.buf = rest[length:]
                path = head.split(b" ")[1]
                if path == b"/health":
                    answer(self.transport, "200 OK", b'{"status":"ok"}')
                elif path == b"/v1/models":
                    answer(self.transport, "200 OK", b'{"object":"list","data":[{"id":"m","max_model_len":4096}]}')
                else:
                    self.transport.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    )
                    streams[self.transport] = output_len

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Conn, "127.0.0.1", port)
        asyncio.ensure_future(ticker())
        await server.serve_forever()

    asyncio.run(main())


# --- clients -------------------------------------------------------------------------------------
def run_clients(port: int, streams: int, requests: int, output_len: int, out) -> None:
    body = json.dumps({"model": CHUNK["model"], "prompt": [1, 2, 3], "max_tokens": output_len, "stream": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n{body}"
    ).encode()

    async def one_stream(todo: list[int], counts: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while todo:
            todo.pop()
            writer.write(request)
            seen, buf = 0, b""
            while not buf.endswith(b"0\r\n\r\n"):
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the stream ended early")
                buf = buf[-8:] + data
                seen += data.count(b"data: ")
            counts[0] += seen - 1  # [DONE] is no token
        writer.close()

    async def main() -> None:
        todo, counts = list(range(requests)), [0]
        await asyncio.gather(*(one_stream(todo, counts) for _ in range(streams)))
        out.put(counts[0])

    asyncio.run(main())


def drive(port: int, concurrency: int, clients: int, requests: int, output_len: int) -> tuple[int, float]:
    out: mp.Queue = mp.Queue()
    share = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    reqs = [requests * s // concurrency for s in share]
    start = time.perf_counter()
    procs = [mp.Process(target=run_clients, args=(port, s, r, output_len, out)) for s, r in zip(share, reqs) if s]
    for p in procs:
        p.start()
    tokens = sum(out.get() for _ in procs)
    for p in procs:
        p.join()
    return tokens, time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User + system time of ``pid`` and its children (the router's workers)."""
    total = 0.0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(c) for c in children.read_text().split()]
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--router-workers", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    engine_port, router_port = free_port(), free_port()
    engine = mp.Process(target=run_engine, args=(engine_port, args.step_ms / 1000, args.output_len), daemon=True)
    engine.start()
    log = tempfile.NamedTemporaryFile("w", prefix="router-relay-", suffix=".log", delete=False)
    router = subprocess.Popen(
        [sys.executable, "-m", "pdinfer.cli", "router", "--normal", f"http://127.0.0.1:{engine_port}",
         "--port", str(router_port), "--workers", str(args.router_workers)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{engine_port}")
        wait_ready(f"http://127.0.0.1:{router_port}")
        for c in (int(x) for x in args.concurrency.split(",")):
            n = c * args.requests_per_stream
            direct_tokens, direct_s = drive(engine_port, c, args.clients, n, args.output_len)
            cpu0 = cpu_seconds(router.pid)
            routed_tokens, routed_s = drive(router_port, c, args.clients, n, args.output_len)
            cpu = cpu_seconds(router.pid) - cpu0
            assert direct_tokens == routed_tokens == n * args.output_len, (direct_tokens, routed_tokens)
            row = {
                "concurrency": c,
                "direct_tok_s": direct_tokens / direct_s,
                "router_tok_s": routed_tokens / routed_s,
                "router_cpu_us_per_token": cpu / routed_tokens * 1e6,
            }
            row["router_fraction"] = row["router_tok_s"] / row["direct_tok_s"]
            rows.append(row)
            print(
                f"C={c:4d}  direct {row['direct_tok_s']:9,.0f} tok/s  router {row['router_tok_s']:9,.0f} tok/s "
                f"({row['router_fraction']:.0%})  router CPU {row['router_cpu_us_per_token']:.1f} us/token",
                flush=True,
            )
    finally:
        router.terminate()
        router.wait(timeout=30)
        engine.terminate()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
