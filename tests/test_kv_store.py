"""KV cache store: the directory and memory backends on their own (verification, LRU bound,
several processes at once), then engines: what a NORMAL engine or a CE saves, a fresh NORMAL
engine, another process or a fresh PE loads, and the output equals the store-off output."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import uuid

import pytest

from pdinfer.kv_store.backends import open_store
from pdinfer.kv_store.directory import SUFFIX, DirectoryStore
from pdinfer.kv_store.memory import MemoryStore
from pdinfer.kv_store.store import TieredStore, prefix_hashes

BLOCK = 16
NUM_KV_BLOCKS = 96


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return prefix_hashes([seed * 100_000 + i for i in range(n * BLOCK)], BLOCK, n)


def _payload(key: bytes, size: int = 4096) -> bytes:
    return hashlib.blake2b(key).digest() * (size // 64)


def _disk_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


# --- backends ------------------------------------------------------------------------------------
def test_directory_roundtrip_and_prefix(tmp_path):
    store = DirectoryStore(str(tmp_path), "ns", BLOCK, 1 << 20)
    keys = _keys(4)
    for key in keys[:3]:
        assert store.put(key, _payload(key))
    assert not store.put(keys[0], _payload(keys[0]))  # already there
    assert store.get(keys[1]) == _payload(keys[1])
    assert store.get(keys[3]) is None
    # a prompt with 4 full blocks + 1 token: 3 stored leading blocks
    tokens = list(range(4 * BLOCK + 1))
    assert store.longest_stored_prefix(tokens) == 3 * BLOCK
    assert store.longest_stored_prefix(tokens[: 3 * BLOCK]) == 2 * BLOCK  # one token stays to compute
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"]) == (1, 1, 3)
    assert stats["bytes"] == _disk_bytes(tmp_path)
    other = DirectoryStore(str(tmp_path), "other-layout", BLOCK, 1 << 20)
    assert other.get(keys[0]) is None  # a block is only valid for its own layout


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "append", "wrong_key"])
def test_damaged_block_file_is_a_miss_and_deleted(tmp_path, damage):
    store = DirectoryStore(str(tmp_path), "ns", BLOCK, 1 << 20)
    key, other = _keys(2)
    store.put(key, _payload(key))
    store.put(other, _payload(other))
    path = store.path_of(key)
    data = bytearray(open(path, "rb").read())
    if damage == "flip_payload":
        data[-100] ^= 0x01
    elif damage == "flip_header":
        data[40] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 1000]
    elif damage == "append":
        data += b"\x00"
    else:  # a valid file of another block under this block's name
        data = bytearray(open(store.path_of(other), "rb").read())
    open(path, "wb").write(bytes(data))
    assert store.get(key) is None
    assert not os.path.exists(path)
    assert store.stats()["corrupt"] == 1
    assert store.get(other) == _payload(other)


def test_eviction_keeps_the_directory_under_its_bound_in_lru_order(tmp_path):
    file_bytes = len(_payload(b"x" * 16)) + 64
    store = DirectoryStore(str(tmp_path), "ns", BLOCK, 6 * file_bytes, low_watermark=1.0)
    keys = _keys(20)
    for key in keys:
        store.put(key, _payload(key))
        assert store.get(keys[0]) is not None  # used all the time: never evicted
        assert _disk_bytes(tmp_path) <= store.max_bytes
        assert store.size_bytes() == _disk_bytes(tmp_path)
    remaining = {k for k in keys if store.contains(k)}
    assert remaining == {keys[0], *keys[-5:]}
    assert store.stats()["evictions"] == 14
    store.evict(2 * file_bytes)
    assert _disk_bytes(tmp_path) <= 2 * file_bytes


def test_memory_tier_in_front_of_a_directory(tmp_path):
    memory = MemoryStore("ns", BLOCK, 3 * 4096)
    keys = _keys(5)
    for key in keys:
        memory.put(key, _payload(key))
    assert [memory.contains(k) for k in keys] == [False, False, True, True, True]
    assert memory.stats()["evictions"] == 2 and memory.size_bytes() <= memory.max_bytes

    store = open_store(str(tmp_path), "ns", BLOCK, max_bytes=1 << 20, memory_bytes=1 << 20)
    assert isinstance(store, TieredStore)
    store.put(keys[0], _payload(keys[0]))
    elsewhere = open_store(str(tmp_path), "ns", BLOCK, memory_bytes=1 << 20)  # another process
    assert not elsewhere.front.contains(keys[0])
    assert elsewhere.get(keys[0]) == _payload(keys[0])  # from the directory ...
    assert elsewhere.front.contains(keys[0])  # ... and now in memory
    assert elsewhere.get(keys[0]) == _payload(keys[0])
    stats = elsewhere.stats()
    assert stats["hits"] == 2 and stats["memory_hits"] == 1 and stats["misses"] == 0


def _hammer(root: str, worker: int, max_bytes: int, num_keys: int, rounds: int) -> dict:
    """One process: rewrite (after deleting, as an eviction elsewhere would) and read the same
    keys as the other processes; every read must be the exact block or a miss."""
    store = DirectoryStore(root, "ns", BLOCK, max_bytes, rescan_interval_s=0.0)
    keys = _keys(num_keys)
    rng = random.Random(worker)
    wrong = 0
    for _ in range(rounds):
        for key in rng.sample(keys, len(keys)):
            if rng.random() < 0.5:
                try:
                    os.unlink(store.path_of(key))
                except FileNotFoundError:
                    pass
            store.put(key, _payload(key, 65536))
            probe = rng.choice(keys)
            got = store.get(probe)
            wrong += got is not None and got != _payload(probe, 65536)
    return {"wrong": wrong, **store.stats()}


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "bounded"])
def test_processes_writing_the_same_blocks_leave_one_valid_copy(tmp_path, bounded):
    num_keys, workers = 12, 4
    file_bytes = 65536 + 64
    max_bytes = 6 * file_bytes if bounded else 1 << 30
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.starmap(_hammer, [(str(tmp_path), w, max_bytes, num_keys, 15) for w in range(workers)])
    assert all(r["wrong"] == 0 and r["corrupt"] == 0 and r["write_errors"] == 0 for r in results)
    store = DirectoryStore(str(tmp_path), "ns", BLOCK, 1 << 30)
    good, bad = store.verify_all()
    assert bad == []
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if not f.endswith(SUFFIX)]
    assert leftovers == []  # no temp files left behind
    if bounded:
        assert sum(r["evictions"] for r in results) > 0
        # Each process evicts after its own writes; others' writes in flight may overshoot.
        assert _disk_bytes(tmp_path) <= max_bytes + workers * file_bytes
    else:
        assert good == num_keys
        assert all(store.get(k) == _payload(k, 65536) for k in _keys(num_keys))


# --- engines -------------------------------------------------------------------------------------
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)


def _params(kind: str):
    from pdinfer import SamplingParams

    return SamplingParams(**(GREEDY if kind == "greedy" else SEEDED))


@pytest.fixture(scope="module")
def prefixes(prompt_ids):
    """Four long (10+ blocks) prefixes, with different first blocks, and short questions."""
    flat = [t for ids in prompt_ids for t in ids]
    long = [flat[:170], flat[40:210] + flat[:20], flat[::-1][:180], flat[100:] + flat[:100]]
    return [p[:190] for p in long], [ids[:6] for ids in prompt_ids]


def _prompts(prefix, questions):
    return [{"prompt_token_ids": prefix + q} for q in questions]


def _llm(**kwargs):
    from pdinfer import LLM

    return LLM(num_kv_blocks=NUM_KV_BLOCKS, kv_cache_memory=512 << 20, **kwargs)


def _all_free(*engines):
    for e in engines:
        assert not e.has_unfinished_requests()
        assert e.get_num_free_blocks() == e.num_blocks, f"{e.name} leaked KV blocks"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv_store"))


@pytest.fixture(scope="module")
def baseline():
    llm = _llm()
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def writer(store_dir):
    llm = _llm(kv_store=store_dir)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def reader(store_dir):
    llm = _llm(kv_store=store_dir)
    yield llm
    llm.engine.shutdown()


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_store_on_equals_store_off_and_a_fresh_engine_loads_it(baseline, writer, reader, prefixes, kind):
    prefix, questions = prefixes[0][0], prefixes[1]
    prompts = _prompts(prefix, questions[:3] if kind == "greedy" else questions[3:6])
    expected = baseline.generate(prompts, _params(kind), use_tqdm=False)
    assert _tokens(writer.generate(prompts, _params(kind), use_tqdm=False)) == _tokens(expected)
    assert writer.engine.kv_store.flush(60)
    loaded = reader.engine.kv_store.stats()["loaded_blocks"]
    got = reader.generate(prompts, _params(kind), use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [g.outputs[0].text for g in got] == [e.outputs[0].text for e in expected]
    assert all(g.metrics.num_cached_tokens > 0 for g in got)
    if kind == "greedy":  # the reader's local cache was empty: the prefix came from the store
        assert reader.engine.kv_store.stats()["loaded_blocks"] - loaded == len(prefix) // BLOCK
        assert got[0].metrics.num_cached_tokens == len(prefix) // BLOCK * BLOCK
    _all_free(baseline.engine, writer.engine, reader.engine)


def test_corrupted_and_truncated_blocks_are_recomputed(baseline, writer, reader, prefixes):
    (_, flipped, _, cut), questions = prefixes
    prompts = _prompts(flipped, questions[:2]) + _prompts(cut, questions[:2])
    writer.generate(prompts, _params("greedy"), use_tqdm=False)
    assert writer.engine.kv_store.flush(60)
    store = reader.engine.kv_store.store
    flipped_keys = prefix_hashes(flipped, BLOCK, len(flipped) // BLOCK)
    cut_keys = prefix_hashes(cut, BLOCK, len(cut) // BLOCK)
    with open(store.path_of(flipped_keys[3]), "r+b") as f:  # one flipped bit in block 3's K/V
        f.seek(5000)
        byte = f.read(1)[0]
        f.seek(5000)
        f.write(bytes([byte ^ 0x40]))
    with open(store.path_of(cut_keys[2]), "r+b") as f:  # block 2 cut short
        f.truncate(1000)
    corrupt = store.stats()["corrupt"]
    got = reader.generate(prompts, _params("greedy"), use_tqdm=False)
    assert got[0].metrics.num_cached_tokens == 3 * BLOCK  # blocks 0-2, then recomputed
    assert got[2].metrics.num_cached_tokens == 2 * BLOCK
    assert store.stats()["corrupt"] == corrupt + 2
    assert not store.contains(flipped_keys[3]) or store.get(flipped_keys[3]) is not None
    assert _tokens(got) == _tokens(baseline.generate(prompts, _params("greedy"), use_tqdm=False))
    assert reader.engine.kv_store.flush(60)
    # the reader saved what it recomputed, whole
    assert store.get(flipped_keys[3]) is not None and store.get(cut_keys[2]) is not None
    _all_free(baseline.engine, writer.engine, reader.engine)


def test_running_sequences_are_saved_every_n_tokens_with_the_flag(writer):
    from pdinfer import SamplingParams

    engine, agent = writer.engine, writer.engine.kv_store
    agent.save_interval_tokens = 2 * BLOCK  # what kv_store_save_interval_tokens=32 sets
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        seq = engine.add_request("long", {"prompt_token_ids": [7, 8, 9] * 11}, params)
        while seq.num_output_tokens < 45:
            engine.step()
        assert agent.flush(60) and not seq.is_finished
        # saved while running: full blocks past the 33-token prompt, output tokens included
        assert agent.store.longest_stored_prefix(seq.token_ids) >= 3 * BLOCK
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        agent.save_interval_tokens = 0
    _all_free(engine)


_OTHER_PROCESS = r"""
import json, sys
from pdinfer import LLM, SamplingParams
store, prompts, params = json.loads(sys.argv[1])
llm = LLM(kv_store=store, num_kv_blocks=96, kv_cache_memory=512 << 20)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
engine = llm.engine
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "cached": [o.metrics.num_cached_tokens for o in outs],
                  "loaded": engine.kv_store.stats()["loaded_blocks"],
                  "free": engine.get_num_free_blocks(), "total": engine.num_blocks}))
engine.shutdown()
"""


def test_another_process_loads_the_prefix(baseline, writer, store_dir, prefixes):
    prefix, questions = prefixes[0][0], prefixes[1]
    assert writer.engine.kv_store.store.longest_stored_prefix(prefix + [1]) >= len(prefix) // BLOCK * BLOCK
    prompts = _prompts(prefix, questions[6:9])  # new questions after the stored prefix
    env = dict(os.environ, PDINFER_LOG_LEVEL="WARNING")
    arg = json.dumps([store_dir, [p["prompt_token_ids"] for p in prompts], GREEDY])
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, arg], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == len(prefix) // BLOCK
    assert result["cached"][0] == len(prefix) // BLOCK * BLOCK
    assert result["free"] == result["total"]
    expected = baseline.generate(prompts, _params("greedy"), use_tqdm=False)
    assert result["tokens"] == _tokens(expected)


def _pd_engines(store_dir, name):
    from pdinfer import EngineArgs
    from pdinfer.engine.completion_engine import CompletionEngine
    from pdinfer.engine.prefill_engine import PrefillEngine

    common = dict(kv_cache_memory=512 << 20, num_kv_blocks=NUM_KV_BLOCKS, kv_store=store_dir)
    ce = CompletionEngine(
        EngineArgs(engine_type="completion", kv_transfer={"connector": "local", "name": name}, **common)
    )
    return ce, lambda: PrefillEngine(EngineArgs(engine_type="prompt", kv_transfer={"connector": "local"}, **common))


def _run_pair(pair, requests):
    """Reserve on the CE, prefill on the PE; returns the PE sequences and the final outputs."""
    pe_seqs = {}
    for request_id, prompt, params in requests:
        reservation = pair.ce.role.reserve(request_id, prompt, params)
        pe_seqs[request_id] = pair.pe.add_request(request_id, prompt, params, reservation=reservation)
    outs = {}
    while pair.has_unfinished_requests():
        for out in pair.step():
            outs[out.request_id] = out
    return pe_seqs, outs


def test_pd_completion_engine_saves_and_a_fresh_prefill_engine_loads(baseline, store_dir, prefixes):
    from pdinfer.engine.pd_pair import PDPair

    prefix, questions = prefixes[0][2], prefixes[1]
    ce, make_pe = _pd_engines(store_dir, uuid.uuid4().hex)
    first, second = make_pe(), None
    try:
        prompts = _prompts(prefix, questions[:2])
        requests = [(f"a-{i}", p, _params("greedy")) for i, p in enumerate(prompts)]
        _, outs = _run_pair(PDPair(first, ce), requests)
        assert [outs[r].outputs[0].token_ids for r, _, _ in requests] == _tokens(
            baseline.generate(prompts, _params("greedy"), use_tqdm=False)
        )
        assert ce.kv_store.flush(60) and ce.kv_store.stats()["saved_blocks"] > 0
        assert "saved_blocks" not in first.kv_store.stats()  # a PE's prompts are saved by the CE
        second = make_pe()  # a PE that has never seen this prefix
        prompts = _prompts(prefix, questions[4:6])
        requests = [(f"b-{i}", p, _params("seeded")) for i, p in enumerate(prompts)]
        pe_seqs, outs = _run_pair(PDPair(second, ce), requests)
        assert pe_seqs["b-0"].num_cached_tokens == len(prefix) // BLOCK * BLOCK
        assert second.kv_store.stats()["loaded_blocks"] == len(prefix) // BLOCK
        assert [outs[r].error for r, _, _ in requests] == [None] * 2
        assert [outs[r].outputs[0].token_ids for r, _, _ in requests] == _tokens(
            baseline.generate(prompts, _params("seeded"), use_tqdm=False)
        )
        _all_free(ce, first, second, baseline.engine)
    finally:
        for engine in (first, second, ce):
            if engine is not None:
                engine.shutdown()
