"""The on-disk form of one stored KV block: a fixed binary header, then the raw K/V bytes.

Header (little-endian, 64 bytes): magic, format version, header size, namespace digest (the KV
layout the block was computed with), key (the block's chained prefix hash), payload size,
crc32 of the payload, crc32 of the header. A block is used only if every field checks out and
the file holds exactly the header and the payload: a torn, truncated, foreign or bit-flipped
file is a miss, never K/V.
"""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from typing import BinaryIO

MAGIC = b"PDKVBLK\x00"
VERSION = 1
KEY_BYTES = 16  # chain_hash digests
_HEADER = struct.Struct("<8sHH16s16sQII4x")
HEADER_BYTES = _HEADER.size


def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a KV store key is a {KEY_BYTES}-byte chained block hash, got {key!r}")


def encode_header(ns_digest: bytes, key: bytes, payload) -> bytes:
    size = memoryview(payload).nbytes
    body = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, ns_digest, key, size, zlib.crc32(payload), 0)
    return _with_header_crc(body)


def _with_header_crc(body: bytes) -> bytes:
    crc_at = HEADER_BYTES - 8  # the header crc, then 4 bytes of padding
    return body[:crc_at] + struct.pack("<I", zlib.crc32(body[:crc_at])) + body[crc_at + 4 :]


def _read_header(f: BinaryIO, ns_digest: bytes, key: bytes) -> tuple[int, int] | None:
    """(payload bytes, payload crc32) from a block file's header, if the header checks out."""
    header = f.read(HEADER_BYTES)
    if len(header) != HEADER_BYTES:
        return None
    magic, version, size, ns, stored_key, nbytes, payload_crc, _ = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or size != HEADER_BYTES:
        return None
    if _with_header_crc(header) != header or ns != ns_digest or stored_key != key:
        return None
    return nbytes, payload_crc


def read_block(f: BinaryIO, ns_digest: bytes, key: bytes) -> bytes | None:
    """The payload of an open block file, or None if anything about it is wrong."""
    header = _read_header(f, ns_digest, key)
    if header is None:
        return None
    payload = f.read(header[0])
    if len(payload) != header[0] or f.read(1):  # truncated, or trailing bytes
        return None
    return payload if zlib.crc32(payload) == header[1] else None


def read_block_into(f: io.BufferedReader, ns_digest: bytes, key: bytes, out: memoryview) -> bool:
    """Read an open block file's payload straight into ``out`` (exactly its size); False if
    anything about it is wrong (``out`` then holds garbage)."""
    header = _read_header(f, ns_digest, key)
    if header is None or header[0] != out.nbytes:
        return False
    if f.readinto(out) != out.nbytes or f.read(1):
        return False
    return zlib.crc32(out) == header[1]
