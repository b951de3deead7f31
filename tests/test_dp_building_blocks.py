"""Data parallelism without a front: the replica load balancer scored by hand, the output deltas
the ranks send, the rendezvous store, and a collective between two real processes whose peer
dies or hangs (gloo on CPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from dp_helpers import WAIT_S

from pdinfer.distributed.failure_cause import FailureCause
from pdinfer.distributed.replica_lb import ReplicaLoadBalancer


# --- pure pieces ---------------------------------------------------------------------------------
def test_load_balancer_scores_by_hand():
    lb = ReplicaLoadBalancer(2, kv_token_weight=0.25, request_weight_tokens=16)
    assert [lb.choose(10) for _ in range(2)] == [0, 1]  # idle: round robin
    lb.assign("a", 0, 100)  # rank 0: 100 queued prompt tokens
    assert lb.choose(10) == 1
    lb.assign("b", 1, 40)
    lb.progress("b", 1)  # b decodes: 0.25 * 41 + 16 = 26.25 < 100
    assert lb.score(1) == pytest.approx(26.25)
    assert lb.choose(10) == 1
    lb.progress("a", 1)  # a decodes too: 0.25 * 101 + 16 = 41.25 > 26.25
    assert lb.choose(10) == 1
    lb.set_capacity(1, 50)  # rank 1 holds 41 KV tokens of 50: a 10-token prompt does not fit
    assert lb.choose(10) == 0
    lb.release("a")
    lb.release("b")
    assert lb.score(0) == lb.score(1) == 0
    # a CE rank that had no room is passed over for that request, unless every rank had none
    assert lb.choose(10, exclude={1}) == lb.choose(10, exclude={1}) == 0
    assert lb.choose(10, exclude={0, 1}) in (0, 1)


def test_the_killed_rank_is_named_the_cause_whatever_order_the_front_sees_events_in():
    # Rank 1 is SIGKILLed; rank 0's collective fails and it exits with code 1. The front may see
    # rank 0's exit, or its report, before rank 1's exit (CI did once): the cause still wins.
    killed = "DP rank 1 was killed by SIGKILL"
    orders = {
        "exit first": [("exit", 0, 1), ("exit", 1, -9)],
        "report, exit, then the cause": [("failed", 0, True), ("exit", 0, 1), ("exit", 1, -9)],
        "cause first": [("exit", 1, -9), ("failed", 0, True), ("exit", 0, 1)],
    }
    for name, events in orders.items():
        cause = FailureCause(grace_s=1.0)
        for t, (kind, rank, value) in enumerate(events):
            if kind == "exit":
                cause.rank_exited(rank, value, now=0.1 * t)
            else:
                cause.rank_failed(rank, "all-reduce failed", peer=value, now=0.1 * t)
        assert cause.take(now=0.3) == killed, name
        assert cause.take(now=5.0) is None, name  # taken once


def test_a_suspect_waits_out_the_grace_period_and_a_ranks_own_failure_does_not():
    cause = FailureCause(grace_s=1.0)
    cause.rank_exited(0, 1, now=10.0)  # exited with a code, no report (yet)
    assert cause.take(now=10.5) is None
    assert cause.take(now=11.0) == "DP rank 0 exited with code 1"
    cause.rank_failed(1, "CUDA out of memory", peer=False, now=20.0)  # failed on its own
    cause.rank_exited(0, 1, now=20.1)  # its peer follows
    assert cause.take(now=20.1) == "DP rank 1 failed: CUDA out of memory"
    cause.new_generation()
    cause.rank_failed(0, "all-reduce failed", peer=True, now=30.0)
    cause.rank_exited(0, 0, now=30.1)  # after a collective failed, even exit code 0 is a consequence
    assert cause.take(now=30.2) is None
    assert cause.take(now=31.0) == "DP rank 0 failed: all-reduce failed"


_GROUP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pdinfer.distributed.dp_group import TorchDPGroup, DPGroupError
    rank, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = TorchDPGroup(rank, 2, "127.0.0.1", port, timeout_s=3.0)
    group.join(120)
    print("min", group.all_reduce_min([rank, 5 - rank]), flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "die" else signal.SIGSTOP)
    try:
        for _ in range(1000):
            group.all_reduce_min([0])
            time.sleep(0.01)
    except DPGroupError as exc:
        print("failed:", exc, flush=True)
        # As dp_rank.py does: skip interpreter teardown, where gloo, destroying a pair whose
        # receive timed out, sometimes aborts (SIGABRT) after the error was raised and reported.
        os._exit(3)
""")


def test_the_rendezvous_store_listens_on_its_host_only():
    """TCPStore's own server listens on every interface; ours is bound to the host given
    (127.0.0.2 is loopback too, so a store on every interface would answer there)."""
    import socket

    from pdinfer.distributed.dp_group import host_store

    store = host_store("127.0.0.1")
    store.set("k", "v")
    assert store.get("k") == b"v"
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.2", store.port))
    with socket.socket() as s:
        s.connect(("127.0.0.1", store.port))


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_collective_with_a_dead_or_stuck_peer_fails_within_the_group_timeout(how):
    from pdinfer.distributed.dp_group import host_store

    store = host_store("127.0.0.1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GROUP_SCRIPT, str(r), str(store.port), how], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=WAIT_S)  # a hang here fails the test
        assert "min [0, 4]" in out
        assert procs[0].returncode == 3 and "failed: DP rank 0/2: all-reduce failed" in out
    finally:
        for p in procs:
            p.kill()
            p.wait(60)
