"""What the PE and CE share: the KV layout, reservations, connector settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdinfer.kv_transfer.connector import KVConnector
from pdinfer.kv_transfer.protocol import KVLayout

DEFAULT_LEASE_S = 30.0  # PE: free a handed-over request's blocks if the CE has not confirmed
DEFAULT_RESERVATION_TIMEOUT_S = 60.0  # CE: drop a reservation whose K/V never arrived
DEFAULT_DECODE_MARGIN_TOKENS = 16  # CE: reserve this much room for decode beyond the prompt
CONNECTORS = ("tcp", "local", "mooncake", "cuda_ipc", "nccl")


@dataclass(frozen=True)
class KVTransferConfig:
    """``EngineArgs.kv_transfer`` turned into settings (unknown keys are refused)."""

    connector: str = "tcp"  # "tcp", "local", "mooncake" (optional, see kv_transfer/mooncake.py),
    # "cuda_ipc" (one host, device to device) or "nccl" (NCCL send/recv, gloo on CPU)
    host: str = "127.0.0.1"  # CE: where to listen
    port: int = 0  # CE: 0 picks a free port
    name: str | None = None  # local connector: the address name
    secret: str | None = None  # shared secret: pushes not signed with it are refused
    lease_s: float = DEFAULT_LEASE_S
    reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S
    decode_margin_tokens: int = DEFAULT_DECODE_MARGIN_TOKENS
    staging_mib: int = 1024  # cuda_ipc, nccl: the PE's device staging pool (grows when full)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown kv_transfer settings: {sorted(unknown)}")
        config = cls(**values)
        if config.connector not in CONNECTORS:
            raise ValueError(f"kv_transfer connector must be one of {', '.join(CONNECTORS)}, got {config.connector!r}")
        if config.connector == "mooncake":
            from pdinfer.kv_transfer.mooncake import load_transfer_engine

            load_transfer_engine()  # fail before the model loads, naming what to install
        if config.lease_s <= 0 or config.reservation_timeout_s <= 0:
            raise ValueError("kv_transfer lease_s and reservation_timeout_s must be positive")
        if config.staging_mib <= 0:
            raise ValueError("kv_transfer staging_mib must be positive")
        return config

    def make_connector(self, listen: bool, engine_type: int, device=None) -> KVConnector:
        if self.connector == "local":
            from pdinfer.kv_transfer.local import LocalConnector

            return LocalConnector(self.name, secret=self.secret, listen=listen)
        if self.connector == "mooncake":
            from pdinfer.kv_transfer.mooncake import MooncakeConnector

            return MooncakeConnector(
                self.host if listen else None, self.port, secret=self.secret, engine_type=engine_type, host=self.host
            )
        if self.connector in ("cuda_ipc", "nccl"):  # device transports: they stage on ``device``
            if self.connector == "cuda_ipc":
                from pdinfer.kv_transfer.cuda_ipc import CudaIpcConnector as cls
            else:  # a NCCL pair (gloo on a CPU KV cache)
                from pdinfer.kv_transfer.nccl import NcclConnector as cls
            return cls(
                self.host if listen else None,
                self.port,
                secret=self.secret,
                engine_type=engine_type,
                device=device,
                staging_bytes=self.staging_mib << 20,
            )
        from pdinfer.kv_transfer.tcp import TcpConnector

        return TcpConnector(self.host if listen else None, self.port, secret=self.secret, engine_type=engine_type)


class Reservation(msgspec.Struct):
    """A CE's answer to "decode this request": where to send its K/V. Sent to the PE as-is."""

    transfer_id: str
    request_id: str
    address: str  # the CE connector's address
    instance_id: str  # the CE process instance the blocks belong to
    block_ids: list[int]
    num_prompt_tokens: int
    timeout_s: float | None = None  # the CE drops the reservation if no K/V came in this long


def kv_layout(engine) -> KVLayout:
    spec = engine.spec
    return KVLayout(
        model=model_fingerprint(engine),
        dtype=str(engine.dtype).removeprefix("torch."),
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=engine.cache_config.block_size,
    )


def model_fingerprint(engine) -> str:
    """Architecture, shapes and weights identity: two engines with different weights differ."""
    args = engine.args
    weights = f"dummy:{args.seed}" if args.load_format == "dummy" else engine.model_folder.rstrip("/").split("/")[-1]
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
