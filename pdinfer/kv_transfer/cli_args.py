"""The P/D hand-off flags of ``pdinfer serve`` and ``pdinfer launch`` (no heavy imports: the CLI
parses them first). ``kv_transfer_from`` turns them into ``EngineArgs.kv_transfer``.
"""

from __future__ import annotations

import argparse


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("P/D hand-off (prompt and completion roles)")
    g.add_argument(
        "--kv-connector",
        default="tcp",
        choices=["tcp", "mooncake", "cuda_ipc", "nccl"],
        help="how K/V moves from a prefill to a completion engine: ZeroMQ over TCP; "
        "Mooncake's Transfer Engine writing into the CE's cache (optional: apt-get "
        "install libibverbs1 && pip install mooncake-transfer-engine-non-cuda); or "
        "cuda_ipc, device to device between processes of one host (shared memory "
        "for CPU engines); or nccl, GPU to GPU by NCCL send/recv (gloo for CPU engines; "
        "also across hosts); the device ones keep ZeroMQ for the control messages",
    )
    g.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="completion engine: the address its K/V port binds, which PEs push to (but see --kv-advertise-host)",
    )
    g.add_argument("--kv-port", type=int, default=0, help="completion engine: K/V port (0: any free)")
    g.add_argument(
        "--kv-advertise-host",
        default=None,
        help="completion engine: the host PEs are told to push K/V to when they reach this CE by "
        "another address than --kv-host (NAT, a proxy or relay in front of it); same port",
    )
    g.add_argument(
        "--kv-secret",
        default=None,
        help="shared secret of the P/D cluster: KV messages not signed with it are refused (set the same on "
        "every PE and CE; default: $PDINFER_KV_SECRET, which `pdinfer launch` sets to a random one per cluster)",
    )
    g.add_argument(
        "--kv-lease-s",
        type=float,
        default=None,
        help="prefill engine: free a handed-over request's blocks if the CE has not "
        "confirmed within this many seconds (default 30)",
    )
    g.add_argument(
        "--kv-reservation-timeout-s",
        type=float,
        default=None,
        help="completion engine: drop a reservation whose K/V never came (default 60)",
    )


def kv_transfer_from(args: argparse.Namespace) -> dict:
    values = {
        "connector": args.kv_connector,
        "host": args.kv_host,
        "port": args.kv_port,
        "advertise_host": args.kv_advertise_host,
        "secret": args.kv_secret,
        "lease_s": args.kv_lease_s,
        "reservation_timeout_s": args.kv_reservation_timeout_s,
    }
    return {k: v for k, v in values.items() if v is not None}
