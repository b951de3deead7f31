"""The P/D workers of ``two_gpu.py``: the PE process, the CE process that drives the pair, and the
transports alone (stage, push, land, ack through the engines' own calls). Run through
``python benchmarks/two_gpu.py``.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from benchmarks.two_gpu_common import Setup, collect, greedy, summarize, write


# --- workers: P/D across two processes --------------------------------------------------------------
def switch_connector(engine, kind: str) -> None:
    """Give a built PE or CE another transport (one engine load serves every transport)."""
    import dataclasses

    role = engine.role
    role.connector.close()
    role.pd_config = dataclasses.replace(role.pd_config, connector=kind)
    engine.init_pd_split()


def part_pe(setup: Setup, out: Path, port: int, kinds: list[str]) -> None:
    import msgspec
    import zmq

    from pdinfer import LLMEngine
    from pdinfer.engine.pd_common import Reservation

    pe = LLMEngine(
        setup.engine_args("prompt", setup.devices[0], {"connector": kinds[0], "staging_mib": 64 if setup.dry else 2048})
    )
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_json({"op": "ready"})
    while True:
        busy = pe.has_unfinished_requests()
        if sock.poll(0 if busy else 5):
            msg = sock.recv_json()
            if msg["op"] == "quit":
                break
            if msg["op"] == "switch":
                switch_connector(pe, msg["kind"])
                sock.send_json({"op": "switched"})
            elif msg["op"] == "micro":
                sock.send_json({"op": "micro", "result": micro_send(pe, msg)})
            elif msg["op"] == "add":
                reservation = msgspec.json.decode(msg["reservation"].encode(), type=Reservation)
                pe.add_request(msg["rid"], {"prompt_token_ids": msg["ids"]}, greedy(msg["n"]), reservation=reservation)
            elif msg["op"] == "stats":
                stats = dict(
                    pe.role.handoff_stats,
                    free_blocks=[pe.get_num_free_blocks(), pe.num_blocks],
                    staged_bytes=getattr(pe.role.connector, "staged_bytes", 0),
                )
                sock.send_json({"op": "stats", "stats": stats})
        if busy:
            pe.step()
    pe.shutdown()
    write(out, {"ok": True})


class CeDriver:
    """The CE process drives the pair: it reserves, tells the PE, and times every request."""

    def __init__(self, setup: Setup, port: int, kind: str):
        import zmq

        from pdinfer import LLMEngine

        self.setup = setup
        self.ce = LLMEngine(setup.engine_args("completion", setup.devices[1], {"connector": kind}))
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        assert self.sock.recv_json()["op"] == "ready"

    def ask(self, msg: dict) -> dict:
        self.sock.send_json(msg)
        return self.sock.recv_json()

    def submit(self, items: list[tuple[str, list[int]]], n: int) -> tuple[float, set[str]]:
        import msgspec

        from pdinfer.engine.pd_common import NoRoomError

        start = time.perf_counter()
        for rid, ids in items:
            while True:
                try:
                    reservation = self.ce.role.reserve(rid, {"prompt_token_ids": ids}, greedy(n))
                    break
                except NoRoomError:
                    self.ce.step()  # decode until blocks free up (back-pressure)
            self.sock.send_json(
                {"op": "add", "rid": rid, "ids": ids, "n": n, "reservation": msgspec.json.encode(reservation).decode()}
            )
        return start, {rid for rid, _ in items}

    def run(self, items, n: int) -> dict:
        start, wanted = self.submit(items, n)
        return collect(self.ce, start, wanted)

    def transport(self, kind: str) -> dict:
        setup, ce = self.setup, self.ce
        if ce.role.pd_config.connector != kind:
            switch_connector(ce, kind)
            assert self.ask({"op": "switch", "kind": kind})["op"] == "switched"
        result = {"micro": micro_receive(ce, self, setup.micro_blocks, setup.micro_reps)}
        result["correct"] = {
            str(i): self.run([(f"{kind}-c{i}", ids)], setup.correct_tokens)[f"{kind}-c{i}"]["tokens"]
            for i, ids in enumerate(setup.correct)
        }
        self.run([(f"{kind}-warm", setup.warm)], 4)
        work = self.run([(f"{kind}-w{i}", ids) for i, ids in enumerate(setup.workload)], setup.new_tokens)
        result["workload"] = summarize(work)
        result["workload_tokens"] = {rid.split("-", 1)[1]: r["tokens"] for rid, r in work.items()}
        while ce.has_unfinished_requests():
            ce.step()
        time.sleep(0.2)  # the PE collects the last acks
        result["pe"] = self.ask({"op": "stats"})["stats"]
        result["ce_free_blocks"] = [ce.get_num_free_blocks(), ce.num_blocks]
        return result


def part_ce(setup: Setup, out: Path, port: int, kinds: list[str]) -> None:
    driver = CeDriver(setup, port, kinds[0])
    result = {}
    try:
        for kind in kinds:
            try:
                result[kind] = driver.transport(kind)
            except Exception:  # noqa: BLE001 - the next transport still runs
                result[kind] = {"error": traceback.format_exc()}
                print(result[kind]["error"], flush=True)
            write(out, result)
    finally:
        driver.sock.send_json({"op": "quit"})
        driver.ce.shutdown()
        write(out, result)


# --- the transports alone: stage, push, land, ack (the engines' own calls) ----------------------------
def micro_send(pe, msg: dict) -> dict:
    """PE side: ``reps`` pushes of each size to the CE's bench connector, two in flight; GB/s
    from the first staging copy to the last ack."""
    from pdinfer.engine.pd_common import kv_layout
    from pdinfer.kv_transfer.protocol import KVAck, KVPush

    conn = pe.role.pd_config.make_connector(listen=False, engine_type=1, device=pe.device)
    conn.register(kv_layout(pe))
    instance = conn.connect(msg["address"])
    pe.role.connector, bench = conn, pe.role.connector  # _read_kv stages through the bench connector
    result, failed = {}, []
    try:
        for nblocks in msg["sizes"]:
            pending: set[str] = set()
            start = time.perf_counter()
            for rep in range(msg["reps"]):
                payload, nbytes, crc = pe.role._read_kv(list(range(nblocks))).finish()
                push = KVPush(
                    transfer_id=f"m{nblocks}-{rep}",
                    request_id="micro",
                    instance_id=instance,
                    num_tokens=nblocks * pe.cache_config.block_size,
                    first_token=0,
                    first_tokens=[0],
                    seed=0,
                    block_ids=list(range(nblocks)),
                    nbytes=nbytes,
                    checksum=crc,
                )
                conn.send(msg["address"], push, payload)
                pending.add(push.transfer_id)
                while len(pending) >= 2 or (rep == msg["reps"] - 1 and pending):
                    for event in conn.events():
                        if isinstance(event, KVAck):
                            pending.discard(event.transfer_id)
                            if not event.ok:
                                failed.append(event.error)
                    time.sleep(0.0001)
            elapsed = time.perf_counter() - start
            result[str(nblocks)] = {
                "MiB": nbytes / 2**20,
                "GBps": nbytes * msg["reps"] / elapsed / 1e9,
                "ms_per_push": 1e3 * elapsed / msg["reps"],
            }
    finally:
        pe.role.connector = bench
        conn.close()
    return {"sizes": result, "failed": failed}


def micro_receive(ce, driver, sizes: list[int], reps: int) -> dict:
    """CE side: a bench connector of the same kind; every push landed (device) or checked and
    written (host payload) as the engine does, then confirmed."""

    from pdinfer.engine.pd_common import kv_layout

    conn = ce.role.pd_config.make_connector(listen=True, engine_type=2, device=ce.device)
    conn.register_kv_cache(ce.model_runner.cache.kv)
    conn.register(kv_layout(ce))
    cache = ce.model_runner.cache
    driver.sock.send_json({"op": "micro", "address": conn.address, "sizes": sizes, "reps": reps})
    done, refused = 0, []
    try:
        while done < len(sizes) * reps:
            arrivals = conn.receive()
            if not arrivals:
                time.sleep(0.0001)
            for arrival in arrivals:
                error = conn.land(arrival, cache)  # every transport: into the blocks, checked
                conn.confirm(arrival, ok=error is None, error=error)
                done += 1
                if error:
                    refused.append(error)
        result = driver.sock.recv_json()["result"]
    finally:
        conn.close()
    return dict(result, refused=refused)
