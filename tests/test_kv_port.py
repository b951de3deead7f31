"""A completion engine's KV port (ZeroMQ over TCP) as a stranger meets it: raw sockets and
hand-built messages against a real CE that is never stepped unless a test says so. The port
bounds what it reads, refuses what no reservation asked for at once (busy or idle), lets only
the owner of a transfer abort it, refuses a replayed handshake, and logs each kind of refusal
once per peer."""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
import uuid

import msgspec
import pytest
import zmq

from pdinfer import EngineArgs, SamplingParams
from pdinfer.engine.completion_engine import CompletionEngine
from pdinfer.kv_transfer.protocol import (
    CONNECT_USER,
    CONTROL_FRAME_BYTES,
    Hello,
    KVAbort,
    KVPush,
    checksum,
    connect_key,
    decode,
    encode,
)
from pdinfer.kv_transfer.tcp import TcpConnector

SECRET = "cluster-secret"
PROMPT = {"prompt_token_ids": list(range(1, 40))}  # 39 tokens: 3 blocks of 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_ce(**kv) -> CompletionEngine:
    # max_model_len 256: the longest push is 16 blocks of 16 tokens (of the 32 blocks)
    args = EngineArgs(engine_type="completion", num_kv_blocks=32, max_model_len=256, kv_transfer=kv)
    return CompletionEngine(args)


@pytest.fixture(scope="module")
def ce():
    engine = make_ce()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def secret_ce():
    engine = make_ce(secret=SECRET)
    yield engine
    engine.shutdown()


class Stranger:
    """A raw ZeroMQ peer of the KV port: sends whatever it likes, reads what comes back.
    ``key``: the connect key a CE with a secret requires (else no message of ours arrives).
    A send has a timeout: a DEALER whose handshake the CE refused has no pipe left, and ZeroMQ
    would block its next send forever (how the suite hung on a fast machine)."""

    def __init__(self, address: str, key: bytes | None = None, send_timeout_s: float = 5.0):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        if key is not None:
            self.sock.setsockopt(zmq.PLAIN_USERNAME, CONNECT_USER)
            self.sock.setsockopt(zmq.PLAIN_PASSWORD, key)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> bool:
        """Queue the frames; False when ZeroMQ would not take them in time (no live pipe)."""
        try:
            self.sock.send_multipart(list(frames))
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_s: float = 20.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_multipart()
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


def hello(layout, **changes) -> Hello:
    return Hello(layout=layout, engine_type=1, nonce=uuid.uuid4().hex, **changes)


def push_for(ce, reservation, payload: bytes, **changes) -> KVPush:
    num_blocks = ce.block_manager.blocks_for(reservation.num_prompt_tokens)
    values = dict(
        transfer_id=reservation.transfer_id,
        request_id=reservation.request_id,
        instance_id=reservation.instance_id,
        num_tokens=reservation.num_prompt_tokens,
        first_token=5,
        first_tokens=[5],
        seed=1,
        block_ids=reservation.block_ids[:num_blocks],
        nbytes=len(payload),
        checksum=checksum(payload),
    )
    values.update(changes)
    return KVPush(**values)


def wait_events(connector, count: int, deadline_s: float = 20.0) -> list:
    events, end = [], time.monotonic() + deadline_s
    while len(events) < count and time.monotonic() < end:
        events += connector.events()
        time.sleep(0.02)
    return events


def run_until_idle(ce, deadline_s: float = 60.0) -> dict:
    outs, end = {}, time.monotonic() + deadline_s
    while ce.has_unfinished_requests():
        assert time.monotonic() < end, "the CE did not settle"
        for out in ce.step():
            outs[out.request_id] = out
        time.sleep(0.005)
    return outs


def all_free(ce) -> None:
    assert ce.get_num_free_blocks() == ce.num_blocks, "KV blocks leaked"


@pytest.fixture
def warnings_of_pdinfer(caplog):
    logger = logging.getLogger("pdinfer")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="pdinfer")
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    logger.removeHandler(caplog.handler)


# --- item 5: what the port reads is bounded ------------------------------------------------------
def test_the_kv_port_bounds_a_message_by_the_largest_legal_push(ce):
    bytes_per_block = ce.model_runner.require_cache().bytes_per_block
    limit = 16 * (bytes_per_block + 8) + CONTROL_FRAME_BYTES  # the payload, and 8 bytes a block id
    assert ce.role.connector.max_message_bytes == limit
    big, fine = Stranger(ce.role.kv_address), Stranger(ce.role.kv_address)
    try:
        big.send(encode(hello(ce.role.connector.layout, data_info=b"\0" * (limit + 1)), None))
        fine.send(encode(hello(ce.role.connector.layout), None))
        assert decode(fine.recv()[0], None).ok
        assert big.recv(timeout_s=2) is None  # ZeroMQ dropped the connection: never read in full
    finally:
        big.close()
        fine.close()


# --- item 7: pushes nobody asked for are refused at once, busy or idle ------------------------------
def test_an_idle_ce_refuses_unsolicited_pushes_at_once(ce):
    reservation = ce.role.reserve("idle", PROMPT, PARAMS)
    nbytes = 3 * ce.model_runner.require_cache().bytes_per_block
    sender = TcpConnector()
    sender.register(ce.role.connector.layout)
    sender.connect(ce.role.kv_address)
    try:
        payload = b"\x01" * nbytes
        unknown = push_for(ce, reservation, payload, transfer_id=uuid.uuid4().hex)
        short = push_for(ce, reservation, payload[:-16])
        sender.send(ce.role.kv_address, unknown, payload)
        sender.send(ce.role.kv_address, short, payload[:-16])
        acks = wait_events(sender, 2)  # the CE is never stepped here
        assert len(acks) == 2 and not any(a.ok for a in acks)
        errors = {a.transfer_id: a.error for a in acks}
        assert "unknown" in errors[unknown.transfer_id]
        assert "bytes" in errors[reservation.transfer_id]
        assert ce.role.connector.receive() == []  # nothing waits in the inbox
        assert reservation.transfer_id in ce.role.reservations  # a bad push cost the reservation nothing
    finally:
        sender.close()
    ce.abort_request("idle")
    run_until_idle(ce)
    all_free(ce)


# --- item 6: only the owner of a transfer aborts it ------------------------------------------------
def test_an_abort_counts_only_from_the_connection_that_owns_the_transfer(ce):
    victim = ce.role.reserve("victim", PROMPT, PARAMS)
    # A connection that never shook hands: its abort is refused. In order on one connection,
    # so once the Hello behind it is answered the abort was handled.
    raw = Stranger(ce.role.kv_address)
    raw.send(encode(KVAbort(transfer_id=victim.transfer_id, request_id="victim"), None))
    raw.send(encode(hello(ce.role.connector.layout), None))
    assert raw.recv() is not None
    raw.close()
    ce.step()
    assert victim.transfer_id in ce.role.reservations

    pe, stranger = TcpConnector(), TcpConnector()
    for connector in (pe, stranger):
        connector.register(ce.role.connector.layout)
        connector.connect(ce.role.kv_address)
    try:
        payload = b"\x01" * (3 * ce.model_runner.require_cache().bytes_per_block)
        pe.send(ce.role.kv_address, push_for(ce, victim, payload), payload)
        end = time.monotonic() + 30
        while victim.transfer_id in ce.role.reservations:  # until the CE took the push over
            assert time.monotonic() < end, "the push never arrived"
            ce.step()
        # A handshaken stranger aborts it by its transfer id, then by its request id alone.
        stranger.abort(ce.role.kv_address, KVAbort(transfer_id=victim.transfer_id, request_id="victim"))
        stranger.abort(ce.role.kv_address, KVAbort(transfer_id=uuid.uuid4().hex, request_id="victim"))
        outs = run_until_idle(ce)
        assert outs["victim"].error is None
        assert outs["victim"].outputs[0].finish_reason == "length"
        assert len(outs["victim"].outputs[0].token_ids) == 8
        # The owner's abort counts.
        second = ce.role.reserve("second", PROMPT, PARAMS)
        pe.abort(ce.role.kv_address, KVAbort(transfer_id=second.transfer_id, request_id="second"))
        outs = run_until_idle(ce)
        assert "aborted by the prefill engine" in outs["second"].error
    finally:
        pe.close()
        stranger.close()
    all_free(ce)


# --- item 6: the signed handshake ------------------------------------------------------------------
def test_a_replayed_hello_is_refused(secret_ce):
    message = hello(secret_ce.role.connector.layout)
    frame = encode(message, SECRET.encode())
    key = connect_key(SECRET.encode())  # the messages are what is checked here
    first, replay = Stranger(secret_ce.role.kv_address, key), Stranger(secret_ce.role.kv_address, key)
    try:
        first.send(frame)
        ack = decode(first.recv()[0], SECRET.encode())
        assert ack.ok and ack.nonce == message.nonce
        replay.send(frame)
        refusal = decode(replay.recv()[0], None)
        assert not refusal.ok and "replayed" in refusal.error
    finally:
        first.close()
        replay.close()


def test_refused_messages_are_logged_once_per_peer(secret_ce, warnings_of_pdinfer):
    layout = secret_ce.role.connector.layout
    key = connect_key(SECRET.encode())  # past the connection's check: the messages' is tested
    peers = [Stranger(secret_ce.role.kv_address, key) for _ in range(2)]  # two connections of one host
    try:
        for peer in peers:
            for _ in range(3):
                peer.send(encode(hello(layout), b"a-guess"))
                assert not decode(peer.recv()[0], None).ok
        mismatched = msgspec.structs.replace(layout, block_size=32)
        for _ in range(3):
            peers[0].send(encode(hello(mismatched), SECRET.encode()))
            assert not decode(peers[0].recv()[0], None).ok
    finally:
        for peer in peers:
            peer.close()
    warnings = warnings_of_pdinfer()
    assert sum("not signed" in w for w in warnings) == 1, warnings
    assert sum("layout mismatch" in w for w in warnings) == 1, warnings


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _zmtp_null_peer(address: str) -> socket.socket:
    """A raw TCP peer that speaks ZMTP 3.0 with the NULL mechanism (no key): its greeting and
    READY, as the audit's stranger sent them."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"\xff" + b"\x00" * 7 + b"\x01\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    props = bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + props
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    return sock


def test_a_peer_without_the_key_is_dropped_before_any_message(secret_ce, warnings_of_pdinfer):
    """Only a peer with the cluster's connect key gets past ZeroMQ's handshake. Before, any peer
    could announce one frame of up to the largest legal push and make the CE hold it all before
    its signature was checked: a few connections could fill the host's memory. Now a keyless
    peer's frame is never read: four peers each send all but the last MiB of the largest frame
    the port takes and hold it there, and the process does not grow by what they sent; a
    signed message from a peer without the key gets no answer, and the refusal is logged; a
    peer with the key is served."""
    address = secret_ce.role.kv_address
    limit = secret_ce.role.connector.max_message_bytes
    chunk = b"z" * (1 << 20)
    before, peers, sent = _rss_bytes(), [], 0
    try:
        for _ in range(4):
            sock = _zmtp_null_peer(address)
            peers.append(sock)
            try:
                sock.sendall(bytes([0x02]) + struct.pack(">Q", limit - (64 << 10)))
                for _ in range(limit // len(chunk) - 1):
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass  # the CE closed the connection
        time.sleep(1.0)  # what the CE would buffer has arrived
        grown = _rss_bytes() - before
    finally:
        for sock in peers:
            sock.close()
    # (Before, the port let them send about 4 x 11 MiB here, and held it all.)
    assert grown < 8 << 20, (sent, grown)
    layout = secret_ce.role.connector.layout
    keyless, keyed = Stranger(address), Stranger(address, connect_key(SECRET.encode()))
    wrong = Stranger(address, connect_key(b"a-guess"))
    try:
        for peer in (keyless, wrong):
            peer.send(encode(hello(layout), SECRET.encode()))
            assert peer.recv(timeout_s=3) is None
        assert keyed.send(encode(hello(layout), SECRET.encode()))
        assert decode(keyed.recv()[0], SECRET.encode()).ok
    finally:
        for peer in (keyless, wrong, keyed):
            peer.close()
    assert any("without the cluster's key" in w for w in warnings_of_pdinfer()), warnings_of_pdinfer()
