"""The agent of a host that runs some ranks of a DP group whose front is on another host.

``pdinfer serve --headless --dp-rank-offset K --data-parallel-size-local L --dp-master-addr A
--dp-master-port P``: connects to the front at A:P+1, and for every generation the front
announces starts ranks K..K+L-1 with the front's engine settings (killing the previous
generation's first). It reports rank exits to the front, stops the ranks when the front says so,
and kills them and exits when the front has been silent for the group's heartbeat timeout.
"""

from __future__ import annotations

import logging
import time

import zmq

from pdinfer.distributed.launcher import RankLauncher
from pdinfer.distributed.messages import (
    AgentHello,
    Ping,
    RankExited,
    StartGeneration,
    StopRanks,
    decode_to_rank,
    encode,
)

logger = logging.getLogger("pdinfer")


def run_agent(front_address: str, rank_offset: int, num_local_ranks: int, silence_timeout_s: float = 75.0) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"agent{rank_offset}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(front_address)
    sock.send(encode(AgentHello(rank_offset, num_local_ranks)))
    launcher: RankLauncher | None = None
    last_heard_s = time.monotonic()
    print(
        f"pdinfer serve --headless: ranks {rank_offset}..{rank_offset + num_local_ranks - 1} "
        f"waiting for the DP front at {front_address}",
        flush=True,
    )
    try:
        while True:
            if sock.poll(200):
                message = decode_to_rank(sock.recv())
                last_heard_s = time.monotonic()
                if isinstance(message, StartGeneration):
                    template = message.template
                    if launcher is None:
                        launcher = RankLauncher(
                            range(rank_offset, rank_offset + num_local_ranks),
                            template,
                            template.engine_args.get("device", "auto"),
                        )
                    launcher.template = template
                    launcher.start(message.generation)
                elif isinstance(message, StopRanks):
                    if launcher is not None:
                        launcher.wait(10.0)
                    return 0
                elif not isinstance(message, Ping):
                    logger.warning("DP agent: unexpected message %r", message)
            for rank, generation, returncode in launcher.poll_exited() if launcher else ():
                sock.send(encode(RankExited(rank, generation, returncode)))
            if time.monotonic() - last_heard_s > silence_timeout_s:
                logger.error(
                    "the DP front at %s has been silent for %.0f s: stopping", front_address, silence_timeout_s
                )
                return 1
    finally:
        if launcher is not None:
            launcher.kill()
        sock.close()
        ctx.term()
