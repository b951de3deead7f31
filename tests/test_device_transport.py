"""The device KV transport (cuda_ipc) without a GPU: its staging pool, checksum and messages,
and whole P/D hand-offs on CPU engines, where the same code runs over POSIX shared memory. The CUDA-only checks at the end skip without CUDA; the GPU
runs themselves are in benchmarks/two_gpu.py."""

from __future__ import annotations

import time
from multiprocessing import resource_tracker
from types import SimpleNamespace

import msgspec
import pytest
import torch
from conftest import make_llm

from pdinfer import EngineArgs, SamplingParams
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.engine.pd_common import KVTransferConfig
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.kv_transfer.cuda_ipc import CudaIpcConnector
from pdinfer.kv_transfer.protocol import Hello, KVLayout, KVPush, decode, encode
from pdinfer.kv_transfer.staging import (
    CHECKSUM_MODULUS,
    RegionAllocator,
    Segment,
    SegmentInfo,
    block_sums,
    kv_checksum,
    land_blocks,
    open_segment,
    stage_into,
)

MEM = 640 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


# --- checksum, allocator, messages -------------------------------------------------------------------
def test_checksum_by_hand():
    blocks = torch.tensor([[1, 2, -3, 4], [5, 6, 7, 2**31 - 1]], dtype=torch.int32)
    sums = block_sums(blocks)
    assert sums.tolist() == [4, 18 + 2**31 - 1]
    expected = (4 % CHECKSUM_MODULUS * 1 + (18 + 2**31 - 1) % CHECKSUM_MODULUS * 2) % CHECKSUM_MODULUS
    assert kv_checksum(sums).item() == expected == 40
    assert kv_checksum(sums.flip(0)).item() != expected  # blocks in another order


def test_checksum_sees_a_flipped_bit_in_bf16_blocks():
    kv = torch.randn(6, 2, 16, 4, dtype=torch.float32).to(torch.bfloat16)
    before = kv_checksum(block_sums(kv)).item()
    kv.view(torch.int16)[3, 1, 5, 2] ^= 1 << 4
    assert kv_checksum(block_sums(kv)).item() != before


def test_region_allocator_first_fit_and_coalescing():
    pool = RegionAllocator(4096)
    a, b, c = pool.alloc(1000), pool.alloc(512), pool.alloc(1)
    assert (a, b, c) == (0, 1024, 1536)  # 512-byte alignment
    assert pool.alloc(4096) is None
    pool.free(b)
    pool.free(b)  # an ack and an abort of the same push
    assert pool.alloc(600) == 2048  # the 512-byte hole is too small
    pool.free(a)
    pool.free(c)
    assert pool.alloc(2048) == 0  # [0, 1024) + [1024, 1536) + [1536, 2048) merged
    assert pool.used_bytes == 2048 + 1024


def test_messages_round_trip_and_old_hellos_still_decode():
    layout = KVLayout(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=4, block_size=16)
    hello = Hello(layout=layout, engine_type=1, data_plane="cuda_ipc", data_info=b"\x01\x02")
    assert decode(encode(hello, b"k"), b"k") == hello
    push = KVPush(
        transfer_id="t",
        request_id="r",
        instance_id="i",
        num_tokens=3,
        first_token=7,
        first_tokens=[7],
        seed=0,
        block_ids=[4, 5],
        nbytes=1024,
        checksum=99,
        staging_offset=512,
        staging_info=b"seg",
    )
    assert decode(encode(push, None), None) == push

    class OldHello(msgspec.Struct, tag="hello"):  # what a peer without device transports sends
        layout: KVLayout
        engine_type: int
        version: int = 1

    old = msgspec.msgpack.encode(OldHello(layout=layout, engine_type=1))
    from pdinfer.kv_transfer.protocol import Envelope

    got = decode(msgspec.msgpack.encode(Envelope(body=old)), None)
    assert got.data_plane == "zmq" and got.data_info == b""


def test_transfer_config_knows_the_device_connectors():
    assert KVTransferConfig.from_dict({"connector": "cuda_ipc", "staging_mib": 8}).staging_mib == 8
    with pytest.raises(ValueError, match="staging_mib"):
        KVTransferConfig.from_dict({"connector": "cuda_ipc", "staging_mib": 0})


# --- staging and landing, through shared memory ------------------------------------------------------
def test_stage_then_land_through_shared_memory():
    kv_pe = torch.randn(8, 2, 2, 4, 1, 8).to(torch.bfloat16)
    kv_ce = torch.zeros_like(kv_pe)
    segment = Segment(1 << 16, torch.device("cpu"))
    try:
        src_blocks, dst_blocks = [5, 6, 1], [0, 7, 3]
        offset = segment.allocator.alloc(3 * kv_pe[0].numel() * 2)
        staged = stage_into(segment, offset, kv_pe, src_blocks, None)
        payload, nbytes, crc = staged.finish()
        assert payload is staged and nbytes == 3 * kv_pe[0].numel() * 2
        # Attach by name, as another process does (pid -1: not our own segment).
        info = msgspec.msgpack.decode(segment.info, type=SegmentInfo)
        mapped, shm = open_segment(msgspec.structs.replace(info, pid=-1))
        region = mapped[offset : offset + nbytes]
        assert land_blocks(region, kv_ce, dst_blocks, None) == crc
        assert torch.equal(kv_ce[dst_blocks], kv_pe[src_blocks])
        region[100] ^= 0xFF  # the PE reused the region while the CE copied
        assert land_blocks(region, kv_ce, dst_blocks, None) != crc
        del mapped, region
        shm.close()
        resource_tracker.register(shm._name, "shared_memory")  # attached in-process: undo the unregister
        staged.release()
        assert segment.allocator.used_bytes == 0
    finally:
        segment.close()


def test_pool_grows_when_full_and_regions_come_back():
    conn = CudaIpcConnector(staging_bytes=4096)
    try:
        kv = torch.randn(4, 1, 2, 4, 1, 16)  # 512 bytes a block
        cache = SimpleNamespace(kv=kv, bytes_per_block=512)
        a = conn.stage_blocks(cache, [0, 1, 2, 3, 0, 1, 2, 3])  # 4096 bytes: the first segment
        b = conn.stage_blocks(cache, [1])  # no room left: a second segment
        segments = conn.plane.pool.segments
        assert (a.segment is segments[0], b.segment is segments[1]) == (True, True)
        a.release()
        b.release()
        assert conn.staged_bytes == 0
    finally:
        conn.close()


# --- whole hand-offs on CPU engines ------------------------------------------------------------------
@pytest.fixture(scope="module")
def normal():
    return make_llm(kv_cache_memory=MEM)


@pytest.mark.parametrize("connector", ["cuda_ipc", "nccl"])
def test_pd_over_device_connectors_equals_normal(connector, normal, prompt_ids):
    kv = {"connector": connector, "staging_mib": 1}  # small: the pool has to grow
    pe = PrefillEngine(EngineArgs(engine_type="prompt", kv_cache_memory=MEM, kv_transfer=kv))
    ce = CompletionEngine(EngineArgs(engine_type="completion", kv_cache_memory=MEM, kv_transfer=kv))
    try:
        prompts = [{"prompt_token_ids": ids[: 8 + 9 * i]} for i, ids in enumerate(prompt_ids * 2)][:8]
        got = PDPair(pe, ce).generate(prompts, GREEDY)
        expected = normal.generate(prompts, GREEDY, use_tqdm=False)
        assert [g.error for g in got] == [None] * len(prompts)
        assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
        assert pe.role.handoff_stats["count"] == len(prompts) and ce.role.refused_transfers == 0
        assert pe.get_num_free_blocks() == pe.num_blocks and ce.get_num_free_blocks() == ce.num_blocks
        assert pe.role.connector.staged_bytes == 0  # every staging region came back on its ack
    finally:
        pe.shutdown()
        ce.shutdown()


# --- CUDA only (skipped here; benchmarks/two_gpu.py runs these paths on two GPUs) ---------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_segment_round_trip_in_process():
    segment = Segment(1 << 20, torch.device("cuda"))
    try:
        kv = torch.randn(4, 2, 16, 8, device="cuda").to(torch.bfloat16)
        staged = stage_into(segment, 0, kv, [2, 3, 0], torch.cuda.Stream())
        _, nbytes, crc = staged.finish()
        out = torch.zeros_like(kv)
        assert land_blocks(segment.data[:nbytes], out, [0, 1, 2], torch.cuda.Stream()) == crc
        assert torch.equal(out[:3], kv[[2, 3, 0]])
    finally:
        segment.close()


# --- the NCCL pair (a gloo group on CPU): receives stay matched to pushes in order ----------------
def test_nccl_pair_drains_a_refused_push_and_lands_the_next():
    """The CE posts a receive for every push, even one it refuses, so the bytes of the next push
    land in the next push's blocks (point-to-point messages of a pair match in posting order)."""
    from pdinfer.kv_transfer.nccl import NcclConnector

    layout = KVLayout(model="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=16, block_size=4)
    pe_kv = torch.randn(6, 2, 1, 4, 1, 16)
    ce_cache = SimpleNamespace(kv=torch.zeros_like(pe_kv), bytes_per_block=pe_kv[0].numel() * 4)
    ce, pe = NcclConnector(listen_host="127.0.0.1"), NcclConnector(staging_bytes=1 << 16)
    try:
        ce.register(layout)
        pe.register(layout)
        instance = pe.connect(ce.address)
        pushes = []
        # "unknown" was never reserved: the KV port refuses it on arrival and still drains its bytes.
        for transfer_id, src in (("refused", [0, 1]), ("unknown", [3]), ("landed", [4, 2, 5])):
            if transfer_id != "unknown":
                ce.gate.expect(transfer_id, transfer_id, len(src) * ce_cache.bytes_per_block)  # reserved
            staged, nbytes, crc = pe.stage_blocks(
                SimpleNamespace(kv=pe_kv, bytes_per_block=ce_cache.bytes_per_block), src
            ).finish()
            push = KVPush(
                transfer_id=transfer_id,
                request_id=transfer_id,
                instance_id=instance,
                num_tokens=4,
                first_token=1,
                first_tokens=[1],
                seed=0,
                block_ids=[3, 0, 1][: len(src)],
                nbytes=nbytes,
                checksum=crc,
            )
            pe.send(ce.address, push, staged)
            pushes.append(push)
        arrivals = []
        for _ in range(200):
            arrivals += ce.receive()
            if len(arrivals) == 2:
                break
            time.sleep(0.05)
        assert [a.push.transfer_id for a in arrivals] == ["refused", "landed"]
        ce.confirm(arrivals[0], ok=False, error="unknown transfer")
        assert ce.land(arrivals[1], ce_cache) is None  # its checksum holds in our blocks
        ce.confirm(arrivals[1], ok=True)
        assert torch.equal(ce_cache.kv[[3, 0, 1]], pe_kv[[4, 2, 5]])
        assert torch.count_nonzero(ce_cache.kv[[2, 4, 5]]) == 0
        acks = []
        for _ in range(200):
            acks += pe.events()
            ce.receive()  # (the engine's steps: the CE posts the drain of "unknown" here)
            if len(acks) == 3 and pe.staged_bytes == 0:
                break
            time.sleep(0.05)
        assert sorted((a.transfer_id, a.ok) for a in acks) == [("landed", True), ("refused", False), ("unknown", False)]
        assert pe.staged_bytes == 0  # every region back once its send completed
    finally:
        pe.close()
        ce.close()
