"""The router's HTTP/1.1 client for relaying an engine's answer: one connection per request,
bytes handed on as they arrive.

httpx costs the router most of its CPU at a few hundred streams: its connection pool scans every
connection for every request opened or closed (quadratic in the streams), and its chunked-body
reader hands on one SSE event per read however many arrived together. Here each request opens
its own connection (``Connection: close``: no pool, and no request ever sent on a connection the
engine is closing), and ``UpstreamResponse.chunks`` returns everything that arrived since the
last call as one piece, so a router that falls behind relays several events per write and its
cost per token falls as the load rises. Closing a response before its end closes the
connection, which the engine takes as the client gone (it aborts the request).

The engines are pdinfer's own (uvicorn): a status line, headers, then a body framed by
``content-length``, ``transfer-encoding: chunked`` or the connection's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

# Reading pauses while this much of an answer waits for a slow client (backpressure to the engine).
_HIGH_WATER_BYTES = 1 << 20
_MAX_HEAD_BYTES = 64 << 10
CONNECT_TIMEOUT_S = 5.0


class UpstreamError(ConnectionError):
    """The engine could not be reached, or its answer broke off or was not HTTP.
    ``before_head``: nothing of the answer arrived (the request may not have reached it)."""

    def __init__(self, message: str, before_head: bool):
        super().__init__(message)
        self.before_head = before_head


class _Dechunker:
    """``transfer-encoding: chunked`` to the bytes it frames, fed in any pieces."""

    def __init__(self) -> None:
        self.pending = b""
        self.left = 0  # bytes of the current chunk still to come; -1: its closing CRLF
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf, i, out = self.pending + data, 0, []
        while not self.done:
            if self.left > 0:
                piece = buf[i : i + self.left]
                out.append(piece)
                i += len(piece)
                self.left -= len(piece)
                if self.left:
                    break
                self.left = -1
            if self.left == -1:
                if len(buf) - i < 2:
                    break
                if buf[i : i + 2] != b"\r\n":
                    raise UpstreamError("a malformed chunked body", before_head=False)
                i += 2
                self.left = 0
            end = buf.find(b"\r\n", i)
            if end < 0:
                if len(buf) - i > 1024:
                    raise UpstreamError("a malformed chunk size line", before_head=False)
                break
            try:
                size = int(buf[i:end].split(b";", 1)[0], 16)
            except ValueError:
                raise UpstreamError("a malformed chunk size line", before_head=False) from None
            i = end + 2
            if size == 0:
                self.done = True  # trailers, if any, are not read: the connection closes
            self.left = size
        self.pending = buf[i:]
        return b"".join(out)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: BaseException | None = None
        self.paused = False
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self, timeout_s: float) -> bytes:
        """What arrived since the last call (waiting up to ``timeout_s`` for something);
        b"" once the connection ended."""
        if not self.buffer and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout_s)  # (asyncio.timeout: Python 3.11 on)
            except asyncio.TimeoutError:
                raise UpstreamError(f"no answer from the engine for {timeout_s:g} s", before_head=False) from None
            finally:
                self._waiter = None
        data = bytes(self.buffer)
        self.buffer.clear()
        if self.paused:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return data


class UpstreamResponse:
    def __init__(self, conn: _Connection, status: int, headers: dict[str, str], rest: bytes, read_timeout_s: float):
        self.status_code = status
        self.headers = headers
        self._conn = conn
        self._timeout_s = read_timeout_s
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._dechunker = _Dechunker() if self._chunked else None
        length = headers.get("content-length")
        self._left = int(length) if length is not None and length.isdigit() and not self._chunked else None
        self._first = rest
        self.ended = self._left == 0

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, each piece everything that came since the last one."""
        while not self.ended:
            if self._first:
                data, self._first = self._first, b""
            else:
                data = await self._conn.take(self._timeout_s)
                if not data:
                    if self._chunked or self._left:
                        raise UpstreamError("the engine's answer broke off", before_head=False)
                    self.ended = True
                    break
            if self._dechunker is not None:
                data = self._dechunker.feed(data)
                self.ended = self._dechunker.done
            elif self._left is not None:
                data = data[: self._left]
                self._left -= len(data)
                self.ended = self._left == 0
            if data:
                yield data
        self.close()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        """End the exchange; before the body's end this is the client going away."""
        self.ended = True
        if self._conn.transport is not None:
            self._conn.transport.close()


async def sse_data(resp: UpstreamResponse) -> AsyncIterator[bytes]:
    """The payloads of the ``data:`` lines of an SSE answer, in order."""
    rest = b""
    async for data in resp.chunks():
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:]


async def send(
    url: str,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    read_timeout_s: float,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> UpstreamResponse:
    """Send one request on a new connection and read the answer's head."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the router relays to http:// engines, got {url!r}")
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, parts.hostname, parts.port or 80), connect_timeout_s
        )
    except (OSError, asyncio.TimeoutError) as exc:
        raise UpstreamError(f"cannot connect to {url}: {exc!r}", before_head=True) from None
    lines = [f"{method} {path} HTTP/1.1", f"host: {parts.netloc}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"content-length: {len(body)}")
    conn.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)  # type: ignore[union-attr]
    try:
        return await _read_head(conn, read_timeout_s)
    except BaseException:
        conn.transport.close()  # type: ignore[union-attr]
        raise


async def _read_head(conn: _Connection, read_timeout_s: float) -> UpstreamResponse:
    head = b""
    while b"\r\n\r\n" not in head:
        data = await conn.take(read_timeout_s)
        if not data:
            raise UpstreamError(f"the engine closed the connection: {conn.error!r}", before_head=not head)
        head += data
        if len(head) > _MAX_HEAD_BYTES and b"\r\n\r\n" not in head:
            raise UpstreamError("the engine's answer has no end of headers", before_head=False)
    head, rest = head.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(status_line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise UpstreamError(f"not an HTTP answer: {status_line[:80]!r}", before_head=False) from None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return UpstreamResponse(conn, status, headers, rest, read_timeout_s)
