"""The data-parallel flags of ``pdinfer serve`` (no heavy imports: the CLI parses them first).

One host: ``pdinfer serve --data-parallel-size 2`` -- the front starts both ranks on free ports.
Several hosts (example: 4 ranks, 2 per host):

    host0$ pdinfer serve --data-parallel-size 4 --data-parallel-size-local 2 \\
               --dp-master-addr 10.0.0.1 --dp-master-port 29500
    host1$ pdinfer serve --headless --data-parallel-size 4 --data-parallel-size-local 2 \\
               --dp-rank-offset 2 --dp-master-addr 10.0.0.1 --dp-master-port 29500

The front (host 0) hosts the rendezvous store on the master port and its request socket on the
master port + 1; the headless host runs an agent that starts its ranks with the front's engine
settings, and restarts them with the rest of the group after a failure.
"""

from __future__ import annotations

import argparse


def add_dp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel (with --data-parallel-size N > 1)")
    g.add_argument(
        "--data-parallel-size-local", type=int, default=None, help="ranks started on this host (default: all of them)"
    )
    g.add_argument("--dp-rank-offset", type=int, default=0, help="first rank of this host (with --headless)")
    g.add_argument(
        "--dp-master-addr", default="127.0.0.1", help="address of the front's host, reachable from every rank"
    )
    g.add_argument(
        "--dp-master-port",
        type=int,
        default=0,
        help="rendezvous port on the front's host (its request socket is this + 1); 0: free ports (one host only)",
    )
    g.add_argument(
        "--dp-timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait for a peer before the rank gives up",
    )
    g.add_argument(
        "--headless", action="store_true", help="run this host's ranks of a DP group whose front is elsewhere (no HTTP)"
    )


def front_from_args(args: argparse.Namespace, engine_args):
    """A started ``DPFront`` whose ranks are all up (raises if they could not start)."""
    from pdinfer.distributed.dp_front import DPFront, DPOptions

    try:
        options = DPOptions(
            master_addr=args.dp_master_addr,
            master_port=args.dp_master_port,
            num_local_ranks=args.data_parallel_size_local,
            timeout_s=args.dp_timeout,
        )
        front = DPFront(engine_args, options, max_waiting=args.max_waiting)
    except ValueError as exc:
        raise SystemExit(f"pdinfer serve: {exc}") from None
    from pdinfer.engine.client import EngineDeadError

    front.start()
    try:
        front.wait_ready()
    except EngineDeadError as exc:  # the ranks logged the cause; the user gets one line
        front.shutdown()
        raise SystemExit(f"pdinfer serve: the engine cannot start: {exc}") from None
    except BaseException:
        front.shutdown()
        raise
    return front


def run_headless(args: argparse.Namespace) -> int:
    from pdinfer.distributed.dp_agent import run_agent

    if not args.dp_master_port:
        raise SystemExit("pdinfer serve --headless: --dp-master-port is required (the front's)")
    local = args.data_parallel_size_local
    if not local or args.dp_rank_offset + local > args.data_parallel_size or args.dp_rank_offset < 1:
        raise SystemExit(
            "pdinfer serve --headless: need --dp-rank-offset K >= 1 and "
            "--data-parallel-size-local L with K + L <= --data-parallel-size"
        )
    address = f"tcp://{args.dp_master_addr}:{args.dp_master_port + 1}"
    return run_agent(address, args.dp_rank_offset, local, silence_timeout_s=args.dp_timeout + 15)
