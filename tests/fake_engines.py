"""Engines' HTTP surfaces on real sockets, scripted, for router tests: each serves from a thread
of its own; GET /health and /v1/models answer as an engine's do, POSTs as a subclass says."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from servers import free_port

from pdinfer.core.scheduler import PREEMPTED_ERROR

MODEL = "SmolLM2-135M-Instruct"


class FakeEngine:
    role = "normal"

    def __init__(self) -> None:
        self.posts = 0
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            method, path = head.split(b" ")[:2]
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            body = await reader.readexactly(length)
            if method == b"GET":
                if path == b"/v1/models":
                    answer(writer, 200, {"data": [{"id": MODEL, "max_model_len": 1024}]})
                else:
                    answer(writer, 200, {"status": "ok", "role": self.role})
                await writer.drain()
                continue
            self.posts += 1
            if not await self.post(path.decode(), json.loads(body or b"{}"), reader, writer):
                writer.close()
                return

    async def post(self, path: str, body: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one POST; False: the connection closes."""
        raise NotImplementedError

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def answer(writer: asyncio.StreamWriter, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n{extra}\r\n"
    writer.write(head.encode() + payload)


class ScriptedEngine(FakeEngine):
    """A NORMAL engine answering POSTs from a script: "drop" closes the connection without an
    answer (what a pooled keep-alive connection the engine just closed looks like to the
    router), "ok" answers a completion, "busy" a 503 with Retry-After."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        super().__init__()

    async def post(self, path: str, body: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        action = self.script.pop(0) if self.script else "ok"
        if action == "drop":
            return False
        if action == "busy":
            error = {"message": "the engine is busy", "type": "server_overloaded", "param": None, "code": "overloaded"}
            answer(writer, 503, {"error": error}, {"Retry-After": "7"})
        else:
            choice = {"index": 0, "text": "scripted", "logprobs": None, "finish_reason": "stop"}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            body = {"id": "x", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice]}
            answer(writer, 200, {**body, "usage": usage})
        await writer.drain()
        return True


class FakeCE(FakeEngine):
    """A CE whose /pd/decode answers 200 and then, by ``mode``: "silent": nothing more (the
    router waits for the reservation); "reserve": a reservation that sends the PE to a K/V
    address of its own that accepts connections and never says a word (the PE's handshake
    takes its timeout, 10 s), and nothing more; "finish": that reservation and, once the PE
    connected to that address (so it holds the request), the request finished (one token) and
    the end of the stream; "preempt": as "finish", but the one token (86) is followed by the end
    of the request as a CE that ran out of blocks ends it (given up, for another CE to continue),
    and the next /pd/decode is "finish". ``closed`` counts the /pd/decode streams that the router
    closed before their end; ``bodies`` holds every /pd/decode body."""

    role = "completion"

    def __init__(self) -> None:
        self.mode = "reserve"
        self.closed = 0
        self.bodies: list[dict] = []
        self.sockets: list[socket.socket] = []  # the silent K/V addresses and what they accepted
        super().__init__()

    async def post(self, path: str, body: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        assert path == "/pd/decode", path
        self.bodies.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if self.mode != "silent":
            kv = socket.socket()
            kv.bind(("127.0.0.1", 0))
            kv.listen()
            kv.setblocking(False)
            self.sockets.append(kv)
            reservation = {
                "transfer_id": body["request_id"][-32:],
                "request_id": body["request_id"],
                "address": f"tcp://127.0.0.1:{kv.getsockname()[1]}",
                "instance_id": "i" * 32,
                "block_ids": list(range(64)),
                "num_prompt_tokens": len(body["prompt_token_ids"]) + len(body.get("resume", {}).get("token_ids", [])),
            }
            writer.write(_chunk({"reservation": reservation}))
        if self.mode in ("finish", "preempt"):
            await writer.drain()
            conn, _ = await asyncio.wait_for(self.loop.sock_accept(kv), 30)
            self.sockets.append(conn)
            if self.mode == "preempt":
                self.mode = "finish"
                writer.write(_chunk({"outputs": [{"index": 0, "text": " y", "token_ids": [86]}]}))
                await writer.drain()
                await asyncio.sleep(0.2)  # a stream's first token reaches its client first
                end = {"outputs": [], "finished": True, "error": PREEMPTED_ERROR, "migrate": "preempted"}
                writer.write(_chunk(end) + b"0\r\n\r\n")
                await writer.drain()
                return False
            output = {"index": 0, "text": " x", "token_ids": [87], "finish_reason": "length"}
            writer.write(_chunk({"outputs": [output], "finished": True}) + b"0\r\n\r\n")
            await writer.drain()
            return False
        await writer.drain()
        await reader.read()  # until the router closes the stream
        self.closed += 1
        return False

    def stop(self) -> None:
        super().stop()
        for sock in self.sockets:
            sock.close()


def _chunk(event: dict) -> bytes:
    data = b"data: " + json.dumps(event).encode() + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"
