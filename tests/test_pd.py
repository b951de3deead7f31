"""P/D hand-off in one process (each TCP-capable connector over loopback, and the in-process
one): outputs equal a NORMAL engine's, blocks come back on both sides after every kind of fault."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from conftest import make_llm

from pdinfer import EngineArgs, SamplingParams, env
from pdinfer.engine.completion_engine import CompletionEngine, NoRoomError
from pdinfer.engine.pd_common import Reservation
from pdinfer.engine.pd_pair import PDPair
from pdinfer.engine.prefill_engine import PrefillEngine
from pdinfer.kv_transfer.mooncake import INSTALL_HINT, MooncakeConnector, mooncake_available
from pdinfer.kv_transfer.protocol import KVPush, checksum
from pdinfer.kv_transfer.tcp import TcpConnector

MEM = 640 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def pe_engine(**kv):
    return PrefillEngine(EngineArgs(engine_type="prompt", kv_cache_memory=MEM, kv_transfer=kv))


def ce_engine(num_kv_blocks=None, **kv):
    return CompletionEngine(
        EngineArgs(engine_type="completion", kv_cache_memory=MEM, num_kv_blocks=num_kv_blocks, kv_transfer=kv)
    )


def all_free(*engines):
    for e in engines:
        assert e.get_num_free_blocks() == e.num_blocks, f"{e.name} leaked KV blocks"


def run(pair, deadline_s=120):
    end = time.monotonic() + deadline_s
    outs = {}
    while pair.has_unfinished_requests():
        assert time.monotonic() < end, "P/D pair did not finish"
        for out in pair.step():
            outs[out.request_id] = out
    return outs


# Every connector-dependent test runs once per transport; Mooncake's run doubles the P/D time.
CONNECTORS = [
    "tcp",
    pytest.param(
        "mooncake", marks=[pytest.mark.slow, pytest.mark.skipif(not mooncake_available(), reason=INSTALL_HINT)]
    ),
]


@pytest.fixture(scope="module", params=CONNECTORS)
def connector(request):
    return request.param


@pytest.fixture(scope="module")
def tcp_pair(connector):
    pe, ce = pe_engine(connector=connector), ce_engine(connector=connector)
    yield PDPair(pe, ce)
    pe.shutdown()
    ce.shutdown()


def drain(engine, deadline_s=30):
    """Step until idle: an in-place transport holds aborted blocks until the reservation timeout."""
    end = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < end, f"{engine.name} did not settle"
        engine.step()
        time.sleep(0.01)


@pytest.fixture(scope="module")
def normal():
    return make_llm(kv_cache_memory=MEM)


def _prompts(prompt_ids):
    # 16 prompts of mixed lengths
    return [{"prompt_token_ids": ids[: 8 + 7 * i]} for i, ids in enumerate(prompt_ids * 2)][:16]


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
    ],
    ids=["greedy", "seeded", "n2", "prompt_logprobs"],
)
def test_pd_output_equals_normal(tcp_pair, normal, prompt_ids, params):
    prompts = _prompts(prompt_ids)
    expected = normal.generate(prompts, params, use_tqdm=False)
    got = tcp_pair.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.error is None
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in e.outputs]
        if params.prompt_logprobs is None:
            assert g.prompt_logprobs is None
        else:  # the PE computed them in its prefill
            assert [list(p or ()) for p in g.prompt_logprobs] == [list(p or ()) for p in e.prompt_logprobs]
            for p, q in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]):
                assert list(p.values()) == pytest.approx(list(q.values()), abs=1e-4)
    assert tcp_pair.pe.role.handoff_stats["count"] >= len(prompts)
    assert not tcp_pair.pe.requests  # n > 1 included: the PE forgets each request once handed off
    all_free(tcp_pair.pe, tcp_pair.ce)


def test_local_connector_pair(normal, prompt_ids):
    name = uuid.uuid4().hex
    pe, ce = pe_engine(connector="local"), ce_engine(connector="local", name=name)
    prompts = _prompts(prompt_ids)[:4]
    got = PDPair(pe, ce).generate(prompts, GREEDY)
    expected = normal.generate(prompts, GREEDY, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    all_free(pe, ce)


def test_n_outputs_of_one_token_each_through_a_hand_off(normal, prompt_ids):
    """n = 2, max_tokens = 1: the CE ends output 0 and its fork on the tokens the PE sampled;
    neither may stay in the CE's decode batch (the request ended: nothing would finish it)."""
    pe, ce = pe_engine(connector="local"), ce_engine(connector="local", name=uuid.uuid4().hex)
    pair = PDPair(pe, ce)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=1)
    for i, ids in enumerate(prompt_ids[:3]):
        pair.add_request(f"one-{i}", {"prompt_token_ids": ids}, params)
    got = run(pair)
    expected = normal.generate([{"prompt_token_ids": ids} for ids in prompt_ids[:3]], params, use_tqdm=False)
    for i, e in enumerate(expected):
        assert [c.token_ids for c in got[f"one-{i}"].outputs] == [c.token_ids for c in e.outputs]
        assert [len(c.token_ids) for c in e.outputs] == [1, 1]
    assert not ce.scheduler.running and not ce.requests
    all_free(pe, ce)


def test_prompt_engine_with_zero_overhead_scheduling_hands_off(normal, prompt_ids, monkeypatch):
    """ZOS is off by default for PROMPT, but an operator may turn it on: post-processing then
    lags a step behind scheduling, and every finished prefill must still be pushed."""
    monkeypatch.setenv("PDINFER_ZERO_OVERHEAD_SCHEDULING", "1")  # exported by the operator,
    monkeypatch.delitem(env._role_defaults, "PDINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)  # not us
    name = uuid.uuid4().hex
    pe, ce = pe_engine(connector="local"), ce_engine(connector="local", name=name)
    assert pe.zero_overhead
    prompts = _prompts(prompt_ids)[:6]
    pair = PDPair(pe, ce)
    for i, prompt in enumerate(prompts):
        pair.add_request(f"zos-{i}", prompt, GREEDY)
    got = run(pair, deadline_s=120)
    expected = normal.generate(prompts, GREEDY, use_tqdm=False)
    assert [got[f"zos-{i}"].outputs[0].token_ids for i in range(len(prompts))] == [
        e.outputs[0].token_ids for e in expected
    ]
    all_free(pe, ce)


def test_first_token_comes_from_the_pe_and_ce_never_prefills(tcp_pair, prompt_ids):
    ce = tcp_pair.ce
    prefill_steps = []
    original = ce.post_schedule
    ce.post_schedule = lambda plan: (prefill_steps.append(plan.prompt_run), original(plan))
    try:
        reservation = ce.role.reserve("solo", {"prompt_token_ids": prompt_ids[2]}, GREEDY)
        pe_seq = tcp_pair.pe.add_request("solo", {"prompt_token_ids": prompt_ids[2]}, GREEDY, reservation=reservation)
        out = run(tcp_pair)["solo"]
    finally:
        ce.post_schedule = original
    assert not any(prefill_steps)
    assert out.outputs[0].token_ids[0] == pe_seq.first_tokens[0]
    all_free(tcp_pair.pe, ce)


def test_ce_without_room_refuses_and_the_request_is_not_lost(connector, prompt_ids):
    pe = pe_engine(connector=connector)
    # (mooncake writes in place: the aborted filler's blocks stay quarantined until its
    # reservation times out, so that timeout is short here)
    small = ce_engine(num_kv_blocks=8, connector=connector, reservation_timeout_s=2.0)
    big = ce_engine(connector=connector)
    prompt = {"prompt_token_ids": prompt_ids[6]}  # ~60 tokens + margin: 5 blocks of 16
    small.step()  # step() is in use from here: it tracks every request's client side
    small.role.reserve("filler", prompt, GREEDY)  # 3 of the 8 blocks left: full for now
    with pytest.raises(NoRoomError):
        small.role.reserve("r", prompt, GREEDY)
    assert "r" not in small.requests
    small.abort_request("filler")
    drain(small)
    all_free(small)
    # The refused id is free, and nothing of the refused request is left under it.
    other = {"prompt_token_ids": prompt_ids[0]}
    small.role.reserve("r", other, GREEDY)
    small.abort_request("r")
    assert small.step()[0].prompt_token_ids == prompt_ids[0]
    drain(small)
    reservation = big.role.reserve("r", prompt, GREEDY)  # the caller picks another CE
    pe.add_request("r", prompt, GREEDY, reservation=reservation)
    out = run(PDPair(pe, big))["r"]
    assert out.error is None and len(out.outputs[0].token_ids) == 24
    all_free(pe, small, big)
    for e in (pe, small, big):
        e.shutdown()


def test_a_ce_reserves_no_more_than_the_request_can_use(connector):
    # 3 blocks of 16; 39 prompt tokens + max_tokens 8 need 46 slots: the 16-token decode margin
    # (4 blocks) must not make a request that fits look like one that never will.
    ce = ce_engine(num_kv_blocks=3, connector=connector, reservation_timeout_s=2.0)  # (mooncake: quarantine)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reservation = ce.role.reserve("r", {"prompt_token_ids": list(range(1, 40))}, params)
    assert len(reservation.block_ids) == 3
    ce.abort_request("r")
    drain(ce)
    all_free(ce)
    ce.shutdown()


def _run_pe(pe, deadline_s=30) -> dict:
    outs, end = {}, time.monotonic() + deadline_s
    while pe.has_unfinished_requests():
        assert time.monotonic() < end, "the PE did not settle"
        for out in pe.step():
            outs[out.request_id] = out
        time.sleep(0.01)
    return outs


def _assert_refused_at_connect(pe, ce, reason: str) -> None:
    """A PE's request whose CE refuses the handshake ends with ``reason`` in its error, never
    prefilled, and both engines get every block back."""
    reservation = ce.role.reserve("r", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    pe.add_request("r", {"prompt_token_ids": [1, 2, 3]}, GREEDY, reservation=reservation)
    out = _run_pe(pe)["r"]  # the handshake runs beside the PE's steps; its refusal ends the request
    assert out.finished and reason in out.error
    assert not pe.role.handoff_stats["count"]  # never prefilled, never pushed
    ce.abort_request("r")
    drain(ce)
    all_free(pe, ce)
    pe.shutdown()
    ce.shutdown()


def test_handshake_mismatch_is_refused_at_connect(connector):
    ce = ce_engine(connector=connector, reservation_timeout_s=1.0)
    pe = PrefillEngine(
        EngineArgs(engine_type="prompt", kv_cache_memory=MEM, block_size=32, kv_transfer={"connector": connector})
    )
    _assert_refused_at_connect(pe, ce, "block_size")


def test_wrong_secret_is_refused_at_connect(connector):
    ce = ce_engine(secret="s3cret", connector=connector, reservation_timeout_s=1.0)
    _assert_refused_at_connect(pe_engine(secret="guess", connector=connector), ce, "authentication")


def test_refusal_inside_add_request_reaches_the_first_step():
    """The in-process connector answers a handshake at once, inside ``add_request``: the
    request ends before the first ``step()``, which must still return it (a fast loopback
    handshake can do the same over TCP)."""
    ce = ce_engine(connector="local", name=uuid.uuid4().hex, secret="s3cret", reservation_timeout_s=1.0)
    _assert_refused_at_connect(pe_engine(connector="local", secret="guess"), ce, "authentication")


def _reservation(prompt_ids, **changes) -> Reservation:
    values = dict(
        transfer_id=uuid.uuid4().hex,
        request_id="bad",
        address="tcp://127.0.0.1:9",
        instance_id=uuid.uuid4().hex,
        block_ids=list(range(8)),
        num_prompt_tokens=len(prompt_ids),
        timeout_s=60.0,
    )
    values.update(changes)
    return Reservation(**values)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"address": "not-an-endpoint"}, "address"),
        ({"address": "tcp://"}, "address"),
        ({"address": "tcp://127.0.0.1:99999"}, "address"),
        ({"address": "tcp://127.0.0.1:"}, "address"),
        ({"address": "tcp://*:5555"}, "address"),
        ({"address": "ipc:///tmp/kv"}, "address"),
        ({"address": "inproc://pdinfer-kv-wake"}, "address"),
        ({"address": 42}, "address"),
        ({"block_ids": [2**70] * 8}, "block_ids"),
        ({"block_ids": ["0"] * 8}, "block_ids"),
        ({"block_ids": [0]}, "block_ids"),  # fewer blocks than the prompt needs
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": "x" * 10_000}, "transfer_id"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, dict) else "",
)
def test_a_bad_reservation_is_refused_for_that_request_only(tcp_pair, prompt_ids, changes, message):
    """A reservation comes over HTTP (/pd/prefill): the PE checks it as if from a stranger. An
    address that is no TCP endpoint once killed the PE's socket thread, then its engine loop."""
    pe = tcp_pair.pe
    prompt = {"prompt_token_ids": prompt_ids[6]}  # 61 tokens: 4 blocks
    with pytest.raises(ValueError, match=message):
        pe.add_request("bad", prompt, GREEDY, reservation=_reservation(prompt_ids[6], **changes))
    assert "bad" not in pe.requests
    out = tcp_pair.generate([prompt], GREEDY)[0]  # the PE still hands over
    assert out.error is None and len(out.outputs[0].token_ids) == 24
    all_free(tcp_pair.pe, tcp_pair.ce)


@pytest.fixture
def silent_peer():
    """A TCP port that accepts connections and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_a_silent_kv_peer_does_not_stall_other_requests(connector, prompt_ids, normal, silent_peer):
    pe = pe_engine(connector=connector, handshake_timeout_s=600.0)
    ce = ce_engine(connector=connector)
    pair = PDPair(pe, ce)
    prompt = {"prompt_token_ids": prompt_ids[1]}
    # add_request returns at once: the handshake with the silent peer goes on beside the steps
    pe.add_request(
        "stuck", prompt, GREEDY, reservation=_reservation(prompt_ids[1], request_id="stuck", address=silent_peer)
    )
    pair.add_request("live", prompt, GREEDY)
    outs, end = {}, time.monotonic() + 120
    while "live" not in outs or not outs["live"].finished:
        assert time.monotonic() < end, "the live request waited on the silent peer"
        for out in pair.step():
            outs[out.request_id] = out
    expected = normal.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert outs["live"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert "stuck" in pe.requests and not pe.requests["stuck"].seqs[0].is_finished
    pe.abort_request("stuck")
    _run_pe(pe)
    drain(ce)
    all_free(pe, ce)
    pe.shutdown()
    ce.shutdown()


def test_a_silent_kv_peer_ends_the_request_at_the_handshake_timeout(connector, prompt_ids, silent_peer):
    pe = pe_engine(connector=connector, handshake_timeout_s=1.0)
    prompt = {"prompt_token_ids": prompt_ids[1]}
    pe.add_request(
        "stuck", prompt, GREEDY, reservation=_reservation(prompt_ids[1], request_id="stuck", address=silent_peer)
    )
    out = _run_pe(pe)["stuck"]
    assert out.finished and "no handshake answer" in out.error
    all_free(pe)
    pe.shutdown()


def _raw_push(ce, reservation, corrupt: str, connector: str):
    """Push K/V for a reservation from a hand-built sender, corrupted on purpose (in place: what
    lands in the CE's blocks does not match the push's checksum)."""
    sender = MooncakeConnector() if connector == "mooncake" else TcpConnector(secret=None)
    sender.register(ce.role.connector.layout)
    sender.connect(reservation.address)
    nbytes = ce.model_runner.cache.bytes_per_block * ce.block_manager.blocks_for(reservation.num_prompt_tokens)
    payload = bytearray(b"\x01" * nbytes)
    crc = checksum(payload)
    if corrupt == "flip":
        payload[nbytes // 2] ^= 0xFF  # the checksum no longer matches
    elif corrupt == "truncate":
        payload = payload[: nbytes // 2]
    push = KVPush(
        transfer_id=reservation.transfer_id,
        request_id=reservation.request_id,
        instance_id=reservation.instance_id,
        num_tokens=reservation.num_prompt_tokens,
        first_token=5,
        first_tokens=[5],
        seed=1,
        block_ids=reservation.block_ids[: ce.block_manager.blocks_for(reservation.num_prompt_tokens)],
        nbytes=nbytes,
        checksum=crc,
    )
    sender.send(reservation.address, push, bytes(payload))
    return sender


@pytest.mark.parametrize("corrupt", ["flip", "truncate"])
def test_corrupted_payload_is_refused_never_decoded(connector, corrupt):
    ce = ce_engine(connector=connector)
    reservation = ce.role.reserve("r", {"prompt_token_ids": list(range(1, 40))}, GREEDY)
    sender = _raw_push(ce, reservation, corrupt, connector)
    end, outs, acks = time.monotonic() + 20, {}, []
    while not acks and time.monotonic() < end:
        for out in ce.step():
            outs[out.request_id] = out
        acks = sender.events()
        time.sleep(0.01)
    assert acks and not acks[0].ok and ("checksum" in acks[0].error or "bytes" in acks[0].error)
    if corrupt == "truncate":  # refused by the KV port on arrival: the reservation waits on
        assert reservation.transfer_id in ce.role.reservations
        ce.abort_request("r")
    end = time.monotonic() + 20
    while ce.has_unfinished_requests() and time.monotonic() < end:
        for out in ce.step():
            outs[out.request_id] = out
    assert outs["r"].finished and outs["r"].error
    assert outs["r"].outputs[0].token_ids == []  # nothing was decoded
    all_free(ce)
    sender.close()
    ce.shutdown()


def test_aborts_before_during_and_after_the_transfer_free_both_sides(connector, prompt_ids):
    pe, ce = pe_engine(connector=connector), ce_engine(connector=connector)
    pair = PDPair(pe, ce)
    prompt = {"prompt_token_ids": prompt_ids[3]}
    # before: reserved on the CE, waiting on the PE
    pair.add_request("before", prompt, GREEDY)
    pair.abort_request("before")
    # during: prefilled and pushed, not yet accepted by the CE
    pair.add_request("during", prompt, GREEDY)
    end = time.monotonic() + 30
    while "during" not in {s.request_id for s in pe.role.handoffs.values()}:  # after its handshake
        assert time.monotonic() < end, "'during' was never pushed"
        pe.step()
    pair.abort_request("during")
    # after: the CE is decoding it
    pair.add_request("after", prompt, GREEDY)
    end = time.monotonic() + 60
    while not any(s.request_id == "after" for s in ce.scheduler.running):
        assert time.monotonic() < end, "'after' never reached the CE's decode batch"
        pair.step()
    pair.abort_request("after")
    outs = run(pair)
    assert all(outs[r].finished for r in ("after",))
    all_free(pe, ce)
    pe.shutdown()
    ce.shutdown()


def test_dead_ce_makes_the_pe_free_its_blocks_within_the_lease(connector, prompt_ids):
    pe = pe_engine(lease_s=1.5, connector=connector)
    ce = ce_engine(reservation_timeout_s=4.0, connector=connector)  # longer than the prefill
    reservation = ce.role.reserve("r", {"prompt_token_ids": prompt_ids[3]}, GREEDY)
    pe.role.connector.connect(reservation.address)  # they shook hands (an earlier request)
    pe.add_request("r", {"prompt_token_ids": prompt_ids[3]}, GREEDY, reservation=reservation)
    ce.role.connector.close()  # the CE stops answering before the K/V arrives
    start, outs = time.monotonic(), {}
    while pe.has_unfinished_requests():
        assert time.monotonic() - start < 15
        for out in pe.step():
            outs[out.request_id] = out
        time.sleep(0.01)
    # Freed by the lease, or sooner: a prefill slower than the CE's reservation timeout (busy
    # machine) is never pushed, and Mooncake's write into a closed CE fails at once.
    reasons = ["lease expired", "reservation expired"] + (["write"] if connector == "mooncake" else [])
    assert any(reason in outs["r"].error for reason in reasons), outs["r"].error
    all_free(pe)
    while ce.has_unfinished_requests():  # the CE drops the reservation it never got K/V for
        assert time.monotonic() - start < 30
        ce.step()
        time.sleep(0.01)
    all_free(ce)
    pe.shutdown()
    ce.shutdown()
