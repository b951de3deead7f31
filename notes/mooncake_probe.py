#!/usr/bin/env python3
"""Probe: can Mooncake Transfer Engine move host-memory buffers between two
processes over TCP on 127.0.0.1 without etcd?

Two spawned processes each run a TransferEngine(protocol="tcp").  The receiver
registers a numpy buffer and sends (session_id, address, size) to the sender
over a Pipe; the sender registers its own source buffer and
  * transfer_sync_write()s 1/16/64 MiB into the receiver's buffer (timed),
  * asks the receiver to verify a sha256 of the written region,
  * transfer_sync_read()s the receiver's buffer back (timed) and verifies it.

Metadata: "P2PHANDSHAKE" (default, no server at all) or --metadata http, which
starts mooncake's own aiohttp metadata server in the parent process.

Everything has a hard timeout: children arm faulthandler.dump_traceback_later
(exit=True) and the parent kills them if they overrun.

Usage:  python notes/mooncake_probe.py [--metadata p2p|http] [--timeout 120] [--baseline]
        [--sizes 1,16,64]
Needs:  pip install mooncake-transfer-engine-non-cuda ; apt-get install libibverbs1
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time

MiB = 1 << 20
SIZES = [1 * MiB, 16 * MiB, 64 * MiB]  # overridable with --sizes (MiB list)
BUF = max(SIZES)


def _reps(size: int) -> int:
    return 20 if size <= MiB else 8 if size <= 16 * MiB else 4


def _set_sizes(sizes) -> None:
    global SIZES, BUF
    SIZES, BUF = list(sizes), max(sizes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(metadata: str):
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if metadata == "P2PHANDSHAKE":
        # The engine picks its own RPC port (read back with get_rpc_port());
        # the session id peers must use is "<ip>:<rpc_port>".
        rc = eng.initialize("127.0.0.1", metadata, "tcp", "")
        session = f"127.0.0.1:{eng.get_rpc_port()}"
    else:
        # With a metadata server the segment is published under the
        # local_hostname string, so it must be unique per engine and is
        # itself the session id peers use.
        session = f"127.0.0.1:{_free_port()}"
        rc = eng.initialize(session, metadata, "tcp", "")
    if rc != 0:
        raise RuntimeError(f"initialize({metadata!r}, 'tcp') returned {rc}")
    return eng, session


def receiver(conn, metadata: str, timeout: float, sizes) -> None:
    _set_sizes(sizes)
    faulthandler.dump_traceback_later(timeout, exit=True)
    import numpy as np

    try:
        eng, session = _engine(metadata)
        buf = np.zeros(BUF, dtype=np.uint8)
        addr = buf.ctypes.data
        rc = eng.register_memory(addr, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        conn.send(("ready", session, addr, buf.nbytes))
        while True:
            msg = conn.recv()
            if msg[0] == "zero":
                buf[:] = 0
                conn.send(("ok",))
            elif msg[0] == "fill":  # deterministic pattern for the read test
                _, size, seed = msg
                rng = np.random.default_rng(seed)
                buf[:size] = rng.integers(0, 256, size, dtype=np.uint8)
                conn.send(("ok", hashlib.sha256(buf[:size]).hexdigest()))
            elif msg[0] == "hash":
                conn.send(("ok", hashlib.sha256(buf[: msg[1]]).hexdigest()))
            elif msg[0] == "stop":
                eng.unregister_memory(addr)
                conn.send(("bye",))
                return
    except BaseException as e:  # report, never hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def sender(conn, peer, metadata: str, timeout: float, sizes) -> None:
    _set_sizes(sizes)
    faulthandler.dump_traceback_later(timeout, exit=True)
    import numpy as np

    def ask(*msg):
        conn.send(msg)
        if not conn.poll(timeout):
            raise TimeoutError(f"receiver did not answer {msg[0]}")
        r = conn.recv()
        if r[0] == "error":
            raise RuntimeError(f"receiver: {r[1]}")
        return r

    out = {"write": {}, "read": {}}
    try:
        t0 = time.perf_counter()
        eng, session = _engine(metadata)
        out["init_s"] = round(time.perf_counter() - t0, 3)
        out["sender_session"] = session
        _, rsession, raddr, rcap = peer
        src = np.random.default_rng(1).integers(0, 256, BUF, dtype=np.uint8)
        dst = np.zeros(BUF, dtype=np.uint8)
        for b in (src, dst):
            rc = eng.register_memory(b.ctypes.data, b.nbytes)
            if rc != 0:
                raise RuntimeError(f"sender register_memory returned {rc}")

        # first transfer includes the P2P handshake / connection setup
        t0 = time.perf_counter()
        rc = eng.transfer_sync_write(rsession, src.ctypes.data, raddr, 4096)
        out["first_write_4k_s"] = round(time.perf_counter() - t0, 4)
        if rc != 0:
            raise RuntimeError(f"first transfer_sync_write returned {rc}")

        for size in SIZES:
            ask("zero")
            times = []
            for _ in range(_reps(size)):
                t0 = time.perf_counter()
                rc = eng.transfer_sync_write(rsession, src.ctypes.data, raddr, size)
                times.append(time.perf_counter() - t0)
                if rc != 0:
                    raise RuntimeError(f"transfer_sync_write({size}) returned {rc}")
            want = hashlib.sha256(src[:size]).hexdigest()
            got = ask("hash", size)[1]
            out["write"][f"{size // MiB}MiB"] = {
                "ok": got == want,
                "best_GBps": round(size / min(times) / 1e9, 3),
                "median_GBps": round(size / sorted(times)[len(times) // 2] / 1e9, 3),
                "reps": len(times),
            }

        for size in SIZES:
            want = ask("fill", size, size)[1]
            dst[:] = 0
            times = []
            for _ in range(_reps(size)):
                t0 = time.perf_counter()
                rc = eng.transfer_sync_read(rsession, dst.ctypes.data, raddr, size)
                times.append(time.perf_counter() - t0)
                if rc != 0:
                    raise RuntimeError(f"transfer_sync_read({size}) returned {rc}")
            out["read"][f"{size // MiB}MiB"] = {
                "ok": hashlib.sha256(dst[:size]).hexdigest() == want,
                "best_GBps": round(size / min(times) / 1e9, 3),
                "median_GBps": round(size / sorted(times)[len(times) // 2] / 1e9, 3),
                "reps": len(times),
            }

        # error path: bogus peer address outside the registered region
        t0 = time.perf_counter()
        rc = eng.transfer_sync_write(rsession, src.ctypes.data, raddr + rcap + (1 << 30), 4096)
        out["bad_addr_rc"] = rc
        out["bad_addr_s"] = round(time.perf_counter() - t0, 3)

        ask("stop")  # receiver unregisters and exits
        time.sleep(1.0)
        t0 = time.perf_counter()
        rc = eng.transfer_sync_write(rsession, src.ctypes.data, raddr, 4096)
        out["dead_peer_rc"] = rc
        out["dead_peer_s"] = round(time.perf_counter() - t0, 3)
        out["status"] = "ok"
    except BaseException as e:
        out["status"] = f"error: {type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out), flush=True)


def _sock_baseline() -> dict:
    """Plain-socket reference: one sendall()/recv_into() of each size over
    127.0.0.1 between two processes (what a hand-rolled TCP transport gets)."""
    import numpy as np

    res = {}
    ctx = mp.get_context("spawn")
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    p = ctx.Process(target=_sock_sink, args=(lsock.getsockname()[1], SIZES))
    p.start()
    conn, _ = lsock.accept()
    src = np.random.default_rng(1).integers(0, 256, BUF, dtype=np.uint8)
    for size in SIZES:
        times = []
        for _ in range(_reps(size)):
            t0 = time.perf_counter()
            conn.sendall(memoryview(src)[:size])
            conn.recv(1)  # ack after the sink has the whole buffer
            times.append(time.perf_counter() - t0)
        res[f"{size // MiB}MiB"] = {
            "best_GBps": round(size / min(times) / 1e9, 3),
            "median_GBps": round(size / sorted(times)[len(times) // 2] / 1e9, 3),
        }
    conn.close()
    p.join(10)
    if p.is_alive():
        p.kill()
    return res


def _sock_sink(port: int, sizes) -> None:
    _set_sizes(sizes)
    faulthandler.dump_traceback_later(60, exit=True)
    import numpy as np

    dst = np.zeros(BUF, dtype=np.uint8)
    s = socket.create_connection(("127.0.0.1", port))
    for size in SIZES:
        for _ in range(_reps(size)):
            mv, got = memoryview(dst)[:size], 0
            while got < size:
                got += s.recv_into(mv[got:])
            s.sendall(b"k")
    s.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--metadata", choices=["p2p", "http"], default="p2p")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--baseline", action="store_true", help="also time plain sockets")
    ap.add_argument("--sizes", default="1,16,64", help="MiB, comma separated")
    args = ap.parse_args()
    _set_sizes([int(x) * MiB for x in args.sizes.split(",")])
    # Without this the engine advertises the first non-loopback interface
    # (eth0) when a metadata server is used; keep all traffic on loopback.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if args.baseline:
        print("SOCKET_BASELINE " + json.dumps(_sock_baseline()), flush=True)
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "20")  # seconds, per transfer

    server = None
    if args.metadata == "http":
        from mooncake.http_metadata_server import KVBootstrapServer

        port = _free_port()
        server = KVBootstrapServer(port, host="127.0.0.1")
        server.run()
        time.sleep(0.5)
        metadata = f"http://127.0.0.1:{port}/metadata"
    else:
        metadata = "P2PHANDSHAKE"
    print(f"metadata_server={metadata}", flush=True)

    ctx = mp.get_context("spawn")
    r_conn, r_child = ctx.Pipe()
    s_conn, s_child = ctx.Pipe()
    recv_p = ctx.Process(target=receiver, args=(r_child, metadata, args.timeout, SIZES))
    recv_p.start()
    rc = 1
    send_p = None
    try:
        if not r_conn.poll(args.timeout):
            print("FAIL: receiver did not become ready", flush=True)
            return 1
        peer = r_conn.recv()
        if peer[0] != "ready":
            print(f"FAIL: receiver: {peer}", flush=True)
            return 1
        print(f"receiver session={peer[1]} addr=0x{peer[2]:x} size={peer[3]}", flush=True)
        # The sender talks to the receiver through the parent: relay messages.
        send_p = ctx.Process(target=sender, args=(s_child, peer, metadata, args.timeout, SIZES))
        send_p.start()
        deadline = time.monotonic() + args.timeout
        while send_p.is_alive() and time.monotonic() < deadline:
            if s_conn.poll(0.05):
                r_conn.send(s_conn.recv())
                if not r_conn.poll(args.timeout):
                    print("FAIL: receiver stopped answering", flush=True)
                    break
                s_conn.send(r_conn.recv())
        send_p.join(max(0.0, deadline - time.monotonic()))
        rc = 0 if send_p.exitcode == 0 else 1
        if send_p.is_alive():
            print("FAIL: sender timed out", flush=True)
    finally:
        for p in (send_p, recv_p):
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
                print(f"{p.name} exitcode={p.exitcode}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
