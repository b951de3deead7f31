"""What the PE and CE share: the KV layout, reservations, connector settings, ``NoRoomError``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdinfer.kv_transfer.connector import DEFAULT_HANDSHAKE_TIMEOUT_S, KVConnector
from pdinfer.kv_transfer.protocol import KVLayout

DEFAULT_LEASE_S = 30.0  # PE: free a handed-over request's blocks if the CE has not confirmed
DEFAULT_RESERVATION_TIMEOUT_S = 60.0  # CE: drop a reservation whose K/V never arrived
DEFAULT_DECODE_MARGIN_TOKENS = 16  # CE: reserve this much room for decode beyond the prompt
CONNECTORS = ("tcp", "local", "mooncake", "cuda_ipc", "nccl")


class NoRoomError(RuntimeError):
    """This CE cannot hold the request now (back-pressure); try another CE or later."""


@dataclass(frozen=True)
class KVTransferConfig:
    """``EngineArgs.kv_transfer`` turned into settings (unknown keys are refused)."""

    connector: str = "tcp"  # "tcp", "local", "mooncake" (optional, see kv_transfer/mooncake.py),
    # "cuda_ipc" (one host, device to device) or "nccl" (NCCL send/recv, gloo on CPU)
    host: str = "127.0.0.1"  # CE: where to listen
    port: int = 0  # CE: 0 picks a free port
    advertise_host: str | None = None  # CE: the host reservations name, when PEs reach it by another (NAT, relay)
    name: str | None = None  # local connector: the address name
    secret: str | None = None  # shared secret: messages not signed with it are refused (default: $PDINFER_KV_SECRET)
    lease_s: float = DEFAULT_LEASE_S
    reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # PE: fail requests to a CE that never answers
    decode_margin_tokens: int = DEFAULT_DECODE_MARGIN_TOKENS
    staging_mib: int = 1024  # cuda_ipc, nccl: the PE's device staging pool (grows when full)

    @classmethod
    def from_dict(cls, values: dict[str, Any], default_secret: str | None = None) -> KVTransferConfig:
        """``default_secret``: ``EngineArgs.kv_secret`` (what `pdinfer launch` hands its engines)."""
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown kv_transfer settings: {sorted(unknown)}")
        config = cls(**values)
        if config.secret is None and default_secret:
            config = dataclasses.replace(config, secret=default_secret)
        if config.connector not in CONNECTORS:
            raise ValueError(f"kv_transfer connector must be one of {', '.join(CONNECTORS)}, got {config.connector!r}")
        if config.connector == "mooncake":
            from pdinfer.kv_transfer.mooncake import load_transfer_engine

            load_transfer_engine()  # fail before the model loads, naming what to install
        for name in ("lease_s", "reservation_timeout_s", "handshake_timeout_s"):
            value = getattr(config, name)
            if not isinstance(value, int | float) or not (0 < value < math.inf):
                raise ValueError(f"kv_transfer {name} must be a positive number of seconds, got {value!r}")
        if config.staging_mib <= 0:
            raise ValueError("kv_transfer staging_mib must be positive")
        return config

    def make_connector(
        self, listen: bool, engine_type: int, device=None, max_push_blocks: int = 0, bytes_per_block: int = 0
    ) -> KVConnector:
        """``max_push_blocks`` x ``bytes_per_block``: the largest push a CE takes (it bounds
        what its KV port reads)."""
        if self.connector == "local":
            from pdinfer.kv_transfer.local import LocalConnector

            return LocalConnector(self.name, secret=self.secret, listen=listen)
        # Every networked transport: the ZeroMQ control plane with the transport's data plane.
        from pdinfer.kv_transfer.data_plane import DataPlane
        from pdinfer.kv_transfer.tcp import TcpConnector

        listen_host = self.host if listen else None
        plane: DataPlane | None = None  # tcp: the bytes ride in the push (BytesPlane)
        if self.connector == "mooncake":
            from pdinfer.kv_transfer.mooncake import MooncakePlane

            plane = MooncakePlane(self.host)
        elif self.connector == "cuda_ipc":  # device transports stage on ``device``
            from pdinfer.kv_transfer.cuda_ipc import CudaIpcPlane

            plane = CudaIpcPlane(device, self.staging_mib << 20)
        elif self.connector == "nccl":  # a NCCL pair (gloo on a CPU KV cache)
            from pdinfer.kv_transfer.nccl import NcclPlane

            plane = NcclPlane(device, self.staging_mib << 20, listen_host)
        return TcpConnector(
            listen_host,
            self.port,
            secret=self.secret,
            engine_type=engine_type,
            max_push_blocks=max_push_blocks,
            bytes_per_block=bytes_per_block,
            plane=plane,
        )


class Reservation(msgspec.Struct):
    """A CE's answer to "decode this request": where to send its K/V. Sent to the PE as-is."""

    transfer_id: str
    request_id: str
    address: str  # the CE connector's address
    instance_id: str  # the CE process instance the blocks belong to
    block_ids: list[int]
    num_prompt_tokens: int
    timeout_s: float | None = None  # the CE drops the reservation if no K/V came in this long

    def check(self, num_blocks_needed: int) -> None:
        """A reservation reaches a PE over HTTP: check it as if from a stranger (ValueError).
        Whether the CE behind ``address`` made it, its handshake and checks tell."""
        for name in ("transfer_id", "request_id", "instance_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= 256:
                raise ValueError(f"reservation {name} must be a string of 1-256 characters")
        if not isinstance(self.address, str):
            raise ValueError(f"reservation address must be a string, got {str(self.address)[:80]!r}")
        blocks = self.block_ids
        if not isinstance(blocks, list) or not num_blocks_needed <= len(blocks) <= 1 << 20:
            raise ValueError(f"reservation block_ids must list at least the prompt's {num_blocks_needed} blocks")
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**31 for b in blocks):
            raise ValueError("reservation block_ids must be block numbers (integers in [0, 2**31))")
        timeout = self.timeout_s
        if timeout is not None and (not isinstance(timeout, int | float) or not 0 < timeout < math.inf):
            raise ValueError(f"reservation timeout_s must be a positive number of seconds, got {timeout!r}")


def kv_layout(engine) -> KVLayout:
    cache = engine.spec.kv_cache  # what a block holds (MLA: the latent, not K and V)
    return KVLayout(
        model=model_fingerprint(engine),
        dtype=str(engine.model_runner.kv_dtype).removeprefix("torch."),  # the cache's: e4m3 with fp8
        num_layers=cache.num_layers,
        num_kv_heads=cache.heads,
        head_dim=cache.dim,
        block_size=engine.cache_config.block_size,
        kv_parts=cache.parts,
    )


def model_fingerprint(engine) -> str:
    """Architecture, shapes and weights identity: two engines with different weights differ."""
    args = engine.args
    weights = f"dummy:{args.seed}" if args.load_format == "dummy" else engine.model_folder.rstrip("/").split("/")[-1]
    if args.quantization:  # FP8 weights compute other K/V than the model's own
        weights += f":{args.quantization}"
    text = json.dumps([dataclasses.asdict(engine.spec), weights], sort_keys=True, default=str)
    return f"{engine.spec.architecture}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class Handoff:
    """PE-side state of one request being handed over."""

    reservation: Reservation
    kv_future: Any = None  # the K/V copy, queued behind the prefill forward
    deadline: float = 0.0  # lease end
    expires_at: float = float("inf")  # the CE's reservation timeout, on our clock: push before it
    started: float = 0.0
    nbytes: int = 0
    sent: bool = False
    extra: dict = field(default_factory=dict)
