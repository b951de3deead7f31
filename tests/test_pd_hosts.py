"""P/D across hosts: the router, the PE and the CE each in a network namespace of its own (a host
with its own address on a control LAN), the K/V crossing a link of its own.

    test process (.254) --- bridge (control LAN: HTTP) --- router (.1), PE (.2), CE (.3)
    PE --veth-- wan --veth-- CE      the K/V path: the CE advertises the relay on "wan"

The CE binds its K/V port on its side of the wan link and tells PEs (``--kv-advertise-host``) to
push to a relay on the wan host, which forwards to it with a chosen delay each way (the kernel
here has no netem). The PE has no other route to the CE's K/V port. Skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
from conftest import make_llm
from netns import DelayRelay, Hosts, HostsUnavailable
from servers import Server

from pdinfer import SamplingParams

ENGINE = ["--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 32
MAX_TOKENS = 16
LEASE_S = 3.0
DELAY_S = 0.05
KV_PORT = 5557
PREFILL_SLACK_S = 7.0  # a failing request may end this much after a lease from the cut (a prefill, busy steps)
BURST_TIMEOUT_S = 240  # a request that hangs fails the test here


@dataclass
class Outcome:
    status: int  # 0: the connection to the router broke
    result: list[int] | str  # token ids, or the error message
    ended_s: float  # time.monotonic() when the answer came


@pytest.fixture(scope="module")
def prompts(prompt_ids) -> list[list[int]]:
    return [(prompt_ids[i % 10] + prompt_ids[(3 * i + 1) % 10])[: 12 + 2 * i] for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prompts):
    tmp = tmp_path_factory.mktemp("hosts")
    hosts = Hosts()
    servers: list[Server] = []
    relay = None
    try:
        try:
            router_ns = hosts.add("router")
        except HostsUnavailable as exc:
            pytest.skip(str(exc))
        pe_ns, ce_ns, wan_ns = hosts.add("pe"), hosts.add("ce"), hosts.add("wan")
        lan = hosts.lan({router_ns: 1, pe_ns: 2, ce_ns: 3})
        _, relay_host = hosts.link(pe_ns, wan_ns, "192.168.77")
        _, ce_kv_host = hosts.link(wan_ns, ce_ns, "192.168.78")
        relay = DelayRelay(wan_ns, (relay_host, KV_PORT), (ce_kv_host, KV_PORT))
        kv = ["--kv-host", ce_kv_host, "--kv-port", str(KV_PORT), "--kv-advertise-host", relay_host]
        ce = Server(["serve", "--role", "completion", *ENGINE, *kv], tmp / "ce.log", host=lan[ce_ns], netns=ce_ns)
        pe = Server(
            ["serve", "--role", "prompt", *ENGINE, "--kv-lease-s", str(LEASE_S)],
            tmp / "pe.log",
            host=lan[pe_ns],
            netns=pe_ns,
        )
        servers += [ce.start(wait=False), pe.start(wait=False)]
        # the one-host reference while the engines load
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = make_llm(kv_cache_memory=512 << 20, max_model_len=1024).generate(
            [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
        )
        ce.wait_healthy()
        pe.wait_healthy()
        router = Server(
            ["router", "--prefill", pe.url, "--decode", ce.url, "--max-attempts", "1", "--health-interval-s", "0.5"],
            tmp / "router.log",
            host=lan[router_ns],
            netns=router_ns,
        )
        servers.append(router.start())
        _wait_for(lambda: all(e["healthy"] for e in _get(f"{router.url}/debug/engines")), "engines in rotation")
        # one request first: the PE and the CE shake hands, and one hand-off's size gives the K/V's
        (warm,) = asyncio.run(_burst(router.url, prompts[-1:]))
        assert warm.status == 200, warm.result
        kv_bytes_per_token = _metric(pe.url, "pdinfer_kv_handoff_bytes") / len(prompts[-1])
        yield SimpleNamespace(
            hosts=hosts,
            relay=relay,
            router=router,
            pe=pe,
            ce=ce,
            ce_ns=ce_ns,
            expected=[o.outputs[0].token_ids for o in outs],
            burst_kv_bytes=kv_bytes_per_token * sum(map(len, prompts)),
        )
    finally:
        for server in reversed(servers):
            server.stop()
        if relay is not None:
            relay.close()
        hosts.close()


def _get(url: str):
    return httpx.get(url, timeout=10).json()


def _wait_for(check, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


async def _burst(url: str, prompts: list[list[int]], during=None) -> list[Outcome]:
    """Every prompt to the router at once (greedy, ``MAX_TOKENS`` ids each); ``during``, an async
    function, runs while they do."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(BURST_TIMEOUT_S, connect=10)) as client:

        async def one(ids: list[int]) -> Outcome:
            body = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
            try:
                answer = await client.post(
                    f"{url}/v1/completions", json={**body, "ignore_eos": True, "return_token_ids": True}
                )
            except httpx.HTTPError as exc:
                return Outcome(0, repr(exc), time.monotonic())
            reply = answer.json()
            if answer.status_code == 200:
                return Outcome(200, reply["choices"][0]["token_ids"], time.monotonic())
            return Outcome(answer.status_code, reply["error"]["message"], time.monotonic())

        requests = [asyncio.ensure_future(one(ids)) for ids in prompts]
        if during is not None:
            await during()
        return await asyncio.wait_for(asyncio.gather(*requests), BURST_TIMEOUT_S)


def _assert_blocks_free(cluster) -> None:
    for server in (cluster.pe, cluster.ce):
        kv = server.wait_blocks_back()  # aborts land between steps: poll
        assert kv["free_blocks"] == kv["total_blocks"], (server.url, kv)


def test_32_requests_across_hosts_equal_one_host(cluster, prompts):
    cluster.relay.delay_s = 0.0
    relayed, handed_over = cluster.relay.bytes_to_target, _metric(cluster.pe.url, "pdinfer_kv_handoff_bytes")
    outcomes = asyncio.run(_burst(cluster.router.url, prompts))
    assert [o.result for o in outcomes] == cluster.expected
    # the K/V went PE -> wan -> CE: the relay carried at least every hand-off's bytes
    handed_over = _metric(cluster.pe.url, "pdinfer_kv_handoff_bytes") - handed_over
    assert handed_over > 0 and cluster.relay.bytes_to_target - relayed >= handed_over
    _assert_blocks_free(cluster)


def test_50ms_delay_on_the_kv_path_every_request_completes(cluster, prompts):
    relay, pe = cluster.relay, cluster.pe.url
    relay.delay_s, relay.min_hold_s = DELAY_S, math.inf
    count, seconds = _metric(pe, "pdinfer_kv_handoffs"), _metric(pe, "pdinfer_kv_handoff_seconds")
    outcomes = asyncio.run(_burst(cluster.router.url, prompts))
    assert [o.result for o in outcomes] == cluster.expected
    # a hand-off is a push and its ack: each waited DELAY_S on the way
    count, seconds = _metric(pe, "pdinfer_kv_handoffs") - count, _metric(pe, "pdinfer_kv_handoff_seconds") - seconds
    assert count == NUM_REQUESTS and seconds / count >= 2 * DELAY_S
    assert relay.min_hold_s >= DELAY_S  # each chunk, either way (the mean also counts the CE)
    _assert_blocks_free(cluster)


def test_kv_connection_reset_the_pe_reconnects_and_the_ce_knows_it(cluster, prompts):
    """The PE's side of its connection to the CE ends (a NAT or relay restarted) while the CE's
    side stays open. ZeroMQ reconnects by itself; the hand-offs after it must go through (they
    were refused for good: the CE knew the PE's session only on the old connection)."""
    relay = cluster.relay
    relay.delay_s = 0.0
    connections = relay.connections
    relay.reset()
    outcomes = asyncio.run(_burst(cluster.router.url, prompts[:8]))
    assert [o.result for o in outcomes] == cluster.expected[:8]
    assert relay.connections > connections  # the PE did reconnect
    _assert_blocks_free(cluster)


def test_kv_link_cut_during_transfers_every_request_ends_and_every_block_is_freed(cluster, prompts):
    """The CE's end of the K/V link goes down once a third of the burst's K/V went through: what
    the relay has not delivered yet stays on the wire, and no ack reaches the PE. A request whose
    K/V arrived decodes (its tokens reach the router over the LAN); the others end when the PE's
    lease runs out (the router makes one attempt: with more, each would wait a lease)."""
    relay, cut = cluster.relay, {}
    relay.delay_s = DELAY_S

    def cut_the_link() -> None:  # in the relay's writer, before it forwards another byte
        cluster.hosts.set_link(cluster.ce_ns, "wan", up=False)
        cut["at"] = time.monotonic()

    relay.trip = (int(relay.bytes_to_target + cluster.burst_kv_bytes / 3), cut_the_link)
    try:
        outcomes = asyncio.run(_burst(cluster.router.url, prompts))
    finally:
        relay.trip = None
        cluster.hosts.set_link(cluster.ce_ns, "wan", up=True)
    completed = [o for o in outcomes if o.status == 200]
    failed_s = [o.ended_s - cut["at"] for o in outcomes if o.status != 200]
    print(
        f"cut: {len(completed)} of {len(outcomes)} completed (the last {max(o.ended_s for o in outcomes) - cut['at']:.1f}"
        f" s after the cut), {len(failed_s)} failed {min(failed_s, default=0):.1f}-{max(failed_s, default=0):.1f} s after"
    )
    for outcome, want in zip(outcomes, cluster.expected):
        if outcome.status == 200:
            assert outcome.result == want
        else:
            assert outcome.status == 503 and "lease expired" in outcome.result, outcome
    assert 0 < len(completed) < len(outcomes), "the cut came before or after every transfer"
    assert max(failed_s) < LEASE_S + PREFILL_SLACK_S
    _assert_blocks_free(cluster)
    # the link is back: once TCP retransmits (its backoff grew while the link was down), new
    # requests go through
    back = time.monotonic()
    while (probe := asyncio.run(_burst(cluster.router.url, prompts[:1]))[0]).status != 200:
        assert time.monotonic() < back + 60, probe
    print(f"the first request after the link came back succeeded {time.monotonic() - back:.1f} s later")
    outcomes = asyncio.run(_burst(cluster.router.url, prompts[:8]))
    assert [o.result for o in outcomes] == cluster.expected[:8]
    _assert_blocks_free(cluster)
