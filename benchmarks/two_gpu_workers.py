"""The workers of ``two_gpu.py`` (one process each, this module's functions) and the model and
workload they share. Run through ``python benchmarks/two_gpu.py``.
"""

from __future__ import annotations

import json
import random
import time
import traceback
import warnings
from pathlib import Path


class Setup:
    """Model and workload; ``dry`` shrinks both for a CPU run."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.model = "preset:smollm2-135m" if dry else "preset:llama-3.1-8b"
        self.devices = ("cpu", "cpu") if dry else ("cuda:0", "cuda:1")
        self.vocab = 49152 if dry else 128256
        rng = random.Random(5)
        n, lo, hi = (4, 24, 80) if dry else (64, 256, 2048)
        self.workload = [[rng.randrange(self.vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        self.new_tokens = 8 if dry else 128
        self.warm = [rng.randrange(self.vocab) for _ in range(hi // 2)]  # no prefix of any prompt
        lengths = [17, 40, 64] if dry else [17, 100, 300, 555, 1000, 64, 1500, 2000]
        self.correct = [[rng.randrange(self.vocab) for _ in range(k)] for k in lengths]
        self.correct_tokens = 6 if dry else 32
        per_rank = [30 + 7 * i for i in range(4)] if dry else [120 + 25 * i for i in range(16)]
        self.dp = [[rng.randrange(self.vocab) for _ in range(k)] for k in per_rank * 2]
        self.micro_blocks = [2, 8] if dry else [8, 64, 128]  # 16 MiB, 128 MiB, 256 MiB on the 8B shape
        self.micro_reps = 3 if dry else 8

    def engine_args(self, role: str, device: str, kv: dict | None = None):
        from pdinfer import EngineArgs

        extra = (
            {"num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 1024}
            if self.dry
            else {"num_kv_blocks": 12288, "max_num_seqs": 64, "max_model_len": 4096, "max_num_batched_tokens": 8192}
        )
        return EngineArgs(
            model=self.model,
            load_format="dummy",
            engine_type=role,
            device=device,
            kv_transfer=kv or {},
            seed=0,
            **extra,
        )


def greedy(n: int):
    from pdinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def write(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, default=str))


# --- workers: NORMAL -----------------------------------------------------------------------------
def run_engine(engine, items: list[tuple[str, list[int]]], params) -> dict:
    """Add all, step until done; per request: tokens, time of first token and of the last."""
    start = time.perf_counter()
    for rid, ids in items:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    return collect(engine, start, {rid for rid, _ in items})


def collect(engine, start: float, wanted: set[str], step=None) -> dict:
    step = step or engine.step
    done: dict[str, dict] = {}
    first: dict[str, float] = {}
    while len(done) < len(wanted):
        for out in step():
            if out.request_id not in wanted:
                continue
            now = time.perf_counter() - start
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = {
                    "tokens": list(out.outputs[0].token_ids),
                    "ttft": first.get(out.request_id, now),
                    "done": now,
                    "error": out.error,
                }
    return done


def settle(engine) -> None:
    """Finish the step still in flight (zero-overhead scheduling runs one ahead)."""
    while engine.has_unfinished_requests():
        engine.step()


def summarize(results: dict, elapsed: float | None = None) -> dict:
    ttft = sorted(r["ttft"] for r in results.values())
    tpot = sorted((r["done"] - r["ttft"]) / max(1, len(r["tokens"]) - 1) for r in results.values())
    tokens = sum(len(r["tokens"]) for r in results.values())
    span = elapsed or max(r["done"] for r in results.values())
    return {
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot),
        "tpot_p50_ms": 1e3 * tpot[len(tpot) // 2],
        "out_tok_s": tokens / span,
        "span_s": span,
        "errors": sum(r["error"] is not None for r in results.values()),
    }


def part_normal(setup: Setup, out: Path) -> None:
    from pdinfer import LLMEngine

    engine = LLMEngine(setup.engine_args("normal", setup.devices[0]))
    result = {"correct": {}}
    for i, ids in enumerate(setup.correct):  # one at a time: the batch shapes P/D will have
        result["correct"][str(i)] = run_engine(engine, [(f"c{i}", ids)], greedy(setup.correct_tokens))[f"c{i}"][
            "tokens"
        ]
    run_engine(engine, [("warm", setup.warm)], greedy(4))
    items = [(f"w{i}", ids) for i, ids in enumerate(setup.workload)]
    work = run_engine(engine, items, greedy(setup.new_tokens))
    settle(engine)
    result["workload"] = summarize(work)
    result["workload_tokens"] = {rid: r["tokens"] for rid, r in work.items()}
    result["free_blocks"] = [engine.get_num_free_blocks(), engine.num_blocks]
    write(out, result)
    engine.shutdown()


# --- workers: P/D across two processes --------------------------------------------------------------
def switch_connector(engine, kind: str) -> None:
    """Give a built PE or CE another transport (one engine load serves every transport)."""
    import dataclasses

    engine.connector.close()
    engine.pd_config = dataclasses.replace(engine.pd_config, connector=kind)
    engine.init_pd_split()


def part_pe(setup: Setup, out: Path, port: int, kinds: list[str]) -> None:
    import msgspec
    import zmq

    from pdinfer.engine.pd_common import Reservation
    from pdinfer.engine.prefill_engine import PrefillEngine

    pe = PrefillEngine(
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
                    pe.handoff_stats,
                    free_blocks=[pe.get_num_free_blocks(), pe.num_blocks],
                    staged_bytes=getattr(pe.connector, "staged_bytes", 0),
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

        from pdinfer.engine.completion_engine import CompletionEngine

        self.setup = setup
        self.ce = CompletionEngine(setup.engine_args("completion", setup.devices[1], {"connector": kind}))
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        assert self.sock.recv_json()["op"] == "ready"

    def ask(self, msg: dict) -> dict:
        self.sock.send_json(msg)
        return self.sock.recv_json()

    def submit(self, items: list[tuple[str, list[int]]], n: int) -> tuple[float, set[str]]:
        import msgspec

        from pdinfer.engine.completion_engine import NoRoomError

        start = time.perf_counter()
        for rid, ids in items:
            while True:
                try:
                    reservation = self.ce.reserve(rid, {"prompt_token_ids": ids}, greedy(n))
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
        if ce.pd_config.connector != kind:
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


# --- workers: DP ------------------------------------------------------------------------------------
def part_dp(setup: Setup, out: Path, rank: int, port: int) -> None:
    from pdinfer import LLMEngine
    from pdinfer.core.dp import SingleProcessDPGroup
    from pdinfer.distributed.dp_group import TorchDPGroup

    group = TorchDPGroup(rank, 2, "127.0.0.1", port, backend="gloo" if setup.dry else "nccl")
    engine = LLMEngine(setup.engine_args("normal", setup.devices[rank]), dp_group=group)
    items = [(f"dp{i}", ids) for i, ids in enumerate(setup.dp) if i % 2 == rank]
    params = greedy(setup.new_tokens)
    engine.scheduler.dp_group = SingleProcessDPGroup()  # DP-1: this rank's prompts alone
    run_engine(engine, [("warm", setup.warm)], greedy(4))
    settle(engine)
    start = time.perf_counter()
    alone = run_engine(engine, items, params)
    alone_s = time.perf_counter() - start
    settle(engine)
    engine.scheduler.dp_group = group
    group.join(device=engine.device)
    steps = [0]

    def lockstep():  # every rank steps while any rank has work (as dp_rank.py's loop)
        idle = group.all_reduce_min([0 if engine.has_unfinished_requests() else 1])[0]
        if idle:
            return []
        steps[0] += 1
        return engine.step()

    calls0, ns0 = group.num_calls, group.total_ns
    start = time.perf_counter()
    for rid, ids in items:
        engine.add_request(f"dp2-{rid}", {"prompt_token_ids": ids}, params)
    together = collect(engine, start, {f"dp2-{rid}" for rid, _ in items}, step=lockstep)
    together = {rid.removeprefix("dp2-"): r for rid, r in together.items()}
    while group.all_reduce_min([0 if engine.has_unfinished_requests() else 1])[0] == 0:
        steps[0] += 1
        engine.step()  # the other rank still has work: companion steps
    together_s = time.perf_counter() - start
    calls, ns = group.num_calls - calls0, group.total_ns - ns0
    # The vote alone: back-to-back all-reduces, no step between them to wait for.
    for _ in range(10):
        group.all_reduce_min([0, 1])
    calls1, ns1 = group.num_calls, group.total_ns
    for _ in range(200):
        group.all_reduce_min([rank, 1])
    vote_us = (group.total_ns - ns1) / 1e3 / (group.num_calls - calls1)
    write(
        out,
        {
            "rank": rank,
            "equal": sum(alone[r]["tokens"] == together[r]["tokens"] for r in alone),
            "of": len(alone),
            "dp1_s": alone_s,
            "dp2_s": together_s,
            "steps": steps[0],
            "allreduce_calls": calls,
            "allreduce_ms_total": ns / 1e6,
            "allreduce_us_per_call": ns / 1e3 / max(1, calls),
            "allreduce_us_per_step": ns / 1e3 / max(1, steps[0]),
            "vote_alone_us": vote_us,
            "tokens": sum(len(r["tokens"]) for r in together.values()),
            "free_blocks": [engine.get_num_free_blocks(), engine.num_blocks],
        },
    )
    engine.shutdown()
    group.close()


def part_correct(setup: Setup, out: Path, preset: str) -> None:
    import benchmarks.gpu_suite as suite
    from benchmarks.gpu_micro import FIG, ROWS

    name = {"llama-3.2-1b": "1B", "llama-3.1-8b": "8B"}[preset]
    kwargs = dict(max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=8192, num_kv_blocks=4096)
    try:
        _, llm = suite.correctness(preset, name, preset == "llama-3.2-1b", kwargs, with_fp32=False)
        llm.engine.shutdown()
    except Exception:  # noqa: BLE001 - reported in the table
        FIG["error"] = traceback.format_exc()
        print(FIG["error"], flush=True)
    write(out, {"fig": FIG, "rows": ROWS})


# --- the transports alone: stage, push, land, ack (the engines' own calls) ----------------------------
def micro_send(pe, msg: dict) -> dict:
    """PE side: ``reps`` pushes of each size to the CE's bench connector, two in flight; GB/s
    from the first staging copy to the last ack."""
    from pdinfer.engine.pd_common import kv_layout
    from pdinfer.kv_transfer.protocol import KVAck, KVPush

    conn = pe.pd_config.make_connector(listen=False, engine_type=1, device=pe.device)
    conn.register(kv_layout(pe))
    instance = conn.connect(msg["address"])
    pe.connector, bench = conn, pe.connector  # _read_kv stages through the bench connector
    result, failed = {}, []
    try:
        for nblocks in msg["sizes"]:
            pending: set[str] = set()
            start = time.perf_counter()
            for rep in range(msg["reps"]):
                payload, nbytes, crc = pe._payload(pe._read_kv(list(range(nblocks))))
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
        pe.connector = bench
        conn.close()
    return {"sizes": result, "failed": failed}


def micro_receive(ce, driver, sizes: list[int], reps: int) -> dict:
    """CE side: a bench connector of the same kind; every push landed (device) or checked and
    written (host payload) as the engine does, then confirmed."""
    import torch

    from pdinfer.engine.pd_common import kv_layout
    from pdinfer.kv_transfer.protocol import checksum

    conn = ce.pd_config.make_connector(listen=True, engine_type=2, device=ce.device)
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
                push = arrival.push
                if getattr(conn, "device_payload", False):
                    error = conn.land(arrival, cache)
                elif checksum(arrival.payload) != push.checksum:
                    error = "checksum mismatch"
                else:
                    error = None
                    with warnings.catch_warnings():  # read-only receive buffer: only copied from
                        warnings.simplefilter("ignore", UserWarning)
                        data = torch.frombuffer(arrival.payload, dtype=torch.uint8)
                    cache.write_blocks(
                        list(push.block_ids), data.view(cache.dtype).view(len(push.block_ids), *cache.block_shape)
                    )
                conn.confirm(arrival, ok=error is None, error=error)
                done += 1
                if error:
                    refused.append(error)
        result = driver.sock.recv_json()["result"]
    finally:
        conn.close()
    return dict(result, refused=refused)
