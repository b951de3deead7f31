"""P/D with expert-parallel groups as real processes (issue 27): ``pdinfer launch`` starts the
router, a PE and a CE, either of which is a DP group with expert parallelism behind one front,
on the tiny random Qwen3-MoE checkpoint of test_moe_models; requests go through the real
``openai`` client and transformers' greedy tokens are the oracle. Both clusters use a KV store.

- PE (EP 1) -> CE group (DP 2 / EP 2, two redundant experts, EPLB every 5 steps): prompts sent
  at once, both CE ranks decode (each reservation names its own rank's K/V port), the CE group
  saves to the store;
- PE group (DP 2 / EP 2) -> CE (EP 1): both PE ranks prefill; a prompt sent again is prefilled
  on the rank that never saw it, from the blocks the CE stored, with equal tokens.
Afterwards every rank's KV blocks are free.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from servers import free_port
from test_launch import start_launch, stop, wait_ready
from test_moe_models import NEW_TOKENS, Case, _prompts

from pdinfer.kv_store.directory import SUFFIX

ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "512"]
WAIT_S = 120  # for the engines' background work (block frees, store writes) on a loaded machine


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    return Case("qwen3-moe", tmp_path_factory.mktemp("qwen3-moe"))


@pytest.fixture()
def cluster(case, tmp_path, request):
    """A launched cluster with the role flags of ``request.param`` and a KV store."""
    store = tmp_path / "store"
    port = free_port()
    args = ["--prefill", "1", "--decode", "1", "--model", case.folder, "--port", str(port), *ENGINE]
    proc = start_launch([*args, "--kv-store", str(store), *request.param], tmp_path)
    try:
        children = wait_ready(proc, port, tmp_path)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        yield {"client": client, "children": children, "store": store}
    finally:
        stop(proc)


def complete(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    answer = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return answer.choices[0].model_extra["token_ids"]


def complete_all(client: openai.OpenAI, prompts: list[list[int]]) -> list[list[int]]:
    """All at once, so the ranks of a group share them."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p), prompts))


def debug_kv(cluster, name: str) -> dict:
    return httpx.get(f"{cluster['children'][name]['url']}/debug/kv", timeout=30).json()


def wait_for(what: str, condition, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def all_blocks_free(cluster) -> None:
    """Every engine's blocks, and every rank's, come back (a PE frees them on the CE's ack)."""

    def free(name: str) -> dict | None:
        kv = debug_kv(cluster, name)
        return kv if kv["free_blocks"] == kv["total_blocks"] else None

    for name in ("prompt-0", "completion-0"):
        kv = wait_for(f"{name}'s blocks", lambda name=name: free(name))
        assert all(r["free_blocks"] == r["total_blocks"] for r in kv.get("ranks", [])), kv


def stored_blocks(store: Path) -> int:
    return sum(1 for _ in store.rglob(f"*{SUFFIX}")) if store.exists() else 0


DECODE_EP2 = ["--decode-dp", "2", "--decode-ep", "2", "--num-redundant-experts", "2", "--eplb-interval", "5"]
# the shared flags make every engine a DP-2/EP-2 group; the CE's own flags make it one engine
PREFILL_EP2 = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--decode-dp", "1", "--decode-ep", "1"]


@pytest.mark.parametrize("cluster", [DECODE_EP2], indirect=True, ids=["pe-ep1-ce-dp2-ep2"])
def test_a_pe_hands_off_to_both_ranks_of_an_ep2_ce_group(case, cluster):
    prompts = _prompts((5, 23, 70, 41, 17, 33), seed=11)
    tokens = complete_all(cluster["client"], prompts)
    assert tokens == [case.reference(p)[0] for p in prompts]
    ce = debug_kv(cluster, "completion-0")
    ranks = ce["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["num_finished"] > 0 for r in ranks), ranks  # both ranks decoded
    assert sum(r["num_finished"] for r in ranks) == len(prompts)
    assert ranks[0]["kv_address"] != ranks[1]["kv_address"]  # a K/V port per rank
    assert "ranks" not in debug_kv(cluster, "prompt-0")  # the PE is one engine
    wait_for("the CE group's saves", lambda: stored_blocks(cluster["store"]) > 0)
    all_blocks_free(cluster)


@pytest.mark.parametrize("cluster", [PREFILL_EP2], indirect=True, ids=["pe-dp2-ep2-ce-ep1"])
def test_an_ep2_pe_group_hands_off_and_loads_the_kv_store(case, cluster):
    client = cluster["client"]
    prompts = _prompts((9, 30, 64, 21), seed=12)
    assert complete_all(client, prompts) == [case.reference(p)[0] for p in prompts]
    ranks = debug_kv(cluster, "prompt-0")["ranks"]
    assert all(r["num_finished"] > 0 and r["num_handoffs"] > 0 for r in ranks), ranks  # both prefilled
    assert "ranks" not in debug_kv(cluster, "completion-0")  # the CE is one engine
    all_blocks_free(cluster)
    # A new prompt: its 4 full prompt blocks and 1 of its output are saved by the CE...
    (repeated,) = _prompts((70,), seed=13)
    before = stored_blocks(cluster["store"])
    first = complete(client, repeated)
    wait_for("the CE to store the prompt", lambda: stored_blocks(cluster["store"]) >= before + 5)
    once = debug_kv(cluster, "prompt-0")["ranks"]
    # ...and sent again it goes to the other PE rank (the front's tie-break is round robin),
    # which has never seen it: its prefix comes from the store.
    second = complete(client, repeated)
    assert first == second == case.reference(repeated)[0]
    twice = debug_kv(cluster, "prompt-0")["ranks"]
    ran = [b["num_finished"] - a["num_finished"] for a, b in zip(once, twice)]
    hits = [b["num_prefix_hit_tokens"] - a["num_prefix_hit_tokens"] for a, b in zip(once, twice)]
    assert sorted(ran) == [0, 1]
    assert hits[ran.index(1)] == 64, hits
    all_blocks_free(cluster)
