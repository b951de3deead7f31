"""Typed messages of the KV hand-off, their encoding, integrity checks and authentication."""

from __future__ import annotations

import hashlib
import hmac
import zlib

import msgspec

PROTOCOL_VERSION = 2  # 2: the handshake's nonce and session

# A CE's KV port reads no frame larger than a push's payload can legally be plus this: every
# other message (and a push's header) fits in it, with 8 more bytes for each block id.
CONTROL_FRAME_BYTES = 64 << 10


def frame_limit(max_push_blocks: int, bytes_per_block: int) -> int:
    """ZMQ_MAXMSGSIZE of a CE's KV port: the largest legal push (``bytes_per_block`` 0 where
    K/V does not ride in a payload frame) plus its header."""
    return max_push_blocks * (bytes_per_block + 8) + CONTROL_FRAME_BYTES


class KVLayout(msgspec.Struct, frozen=True):
    """What one side's KV cache looks like; both sides of a hand-off must agree on all of it."""

    model: str  # architecture + shape fingerprint
    dtype: str
    num_layers: int
    num_kv_heads: int  # vectors per token, part and layer (MLA: 1 latent)
    head_dim: int  # their size (MLA: kv_lora_rank + qk_rope_head_dim)
    block_size: int
    kv_parts: int = 2  # K and V; MLA: 1

    def mismatch(self, other: KVLayout) -> str | None:
        diffs = [
            f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) or None


class Hello(msgspec.Struct, tag="hello"):
    layout: KVLayout
    engine_type: int
    version: int = PROTOCOL_VERSION
    # Fresh for every handshake: a CE refuses a nonce it has seen (a replayed Hello), and a PE
    # takes only the HelloAck that echoes its own.
    nonce: str = ""
    data_plane: str = "zmq"  # how K/V bytes travel: "zmq" (payload frames) or "mooncake" (in place)
    data_info: bytes = b""  # what the data plane tells the CE (cuda_ipc: the PE's staging pool)


class HelloAck(msgspec.Struct, tag="hello_ack"):
    ok: bool
    instance_id: str  # changes when the CE restarts: stale reservations are never trusted
    error: str | None = None
    nonce: str = ""  # the Hello's
    session: str = ""  # the PE names it in every later message on this connection
    # data_plane "mooncake": the CE's Mooncake session id and where its KV cache is in its memory
    data_session: str | None = None
    kv_address: int = 0
    kv_block_bytes: int = 0
    kv_num_blocks: int = 0


class KVPush(msgspec.Struct, tag="push"):
    """The prefix K/V of one request (payload frame) and its first sampled token."""

    transfer_id: str
    request_id: str
    instance_id: str  # the CE instance the reservation was made with
    num_tokens: int  # prompt tokens whose K/V is in the payload
    first_token: int
    first_tokens: list[int]  # n > 1: the first token of every output (the CE forks the rest)
    seed: int
    block_ids: list[int]  # CE blocks to write, in order
    nbytes: int
    checksum: int  # crc32 of the payload
    first_logprobs: dict[int, float] | None = None
    # A device transport (cuda_ipc): no payload frame; the blocks wait in the PE's staging
    # pool (segment ``staging_info``, at ``staging_offset``) and ``checksum`` is kv_checksum's.
    staging_offset: int = -1
    staging_info: bytes = b""
    session: str = ""  # the handshake's (HelloAck.session)


class KVAck(msgspec.Struct, tag="ack"):
    """CE -> PE: the push was written and enqueued (ok) or refused (with the reason)."""

    transfer_id: str
    ok: bool
    error: str | None = None


class KVAbort(msgspec.Struct, tag="abort"):
    transfer_id: str
    request_id: str
    session: str = ""  # the handshake's (HelloAck.session)


Message = Hello | HelloAck | KVPush | KVAck | KVAbort


class Envelope(msgspec.Struct):
    """A message with its authentication tag (HMAC of the encoded message, when a secret is set)."""

    body: bytes
    auth: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(Message)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)


class AuthError(ValueError):
    pass


def encode(message: Message, secret: bytes | None) -> bytes:
    body = _encoder.encode(message)
    auth = hmac.new(secret, body, hashlib.sha256).digest() if secret else b""
    return _encoder.encode(Envelope(body=body, auth=auth))


def decode(frame: bytes, secret: bytes | None) -> Message:
    """Decode and authenticate one frame; raises ``AuthError`` / ``msgspec.DecodeError``."""
    envelope = _envelope_decoder.decode(frame)
    if secret:
        expected = hmac.new(secret, envelope.body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, envelope.auth):
            raise AuthError("message not signed with this CE's shared secret")
    return _message_decoder.decode(envelope.body)


# The key a PE shows in ZeroMQ's PLAIN handshake when the cluster has a secret: the CE's ZAP
# handler admits a connection only with it, so a peer without the secret is dropped during
# the handshake, before ZeroMQ reads (and buffers) any message from it. It is derived from
# the secret, never the secret itself, and travels in clear as the K/V bytes do.
CONNECT_USER = b"pdinfer-pe"
ZAP_DOMAIN = b"pdinfer-kv"


def connect_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"pdinfer-kv-connect", hashlib.sha256).hexdigest().encode()


def checksum(payload) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def checksum_blocks(blocks) -> int:
    """``checksum`` of the concatenation of ``blocks`` (buffers), without joining them."""
    crc = 0
    for block in blocks:
        crc = zlib.crc32(block, crc)
    return crc & 0xFFFFFFFF


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in block_ids, first block id, count) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs
