"""Expert parallelism and EPLB without processes: the placement algorithm and the rearrangement
timer by hand, the role defaults and the role-sized MoE workspace, and two expert-parallel
ranks as two threads (each with its own gloo group) against one layer holding every expert:
dispatch and combine, an empty rank, redundant replicas and a rearrangement that moves weights
between the ranks. Engine-level and multi-process tests are in test_expert_parallel.py.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pdinfer import EngineArgs
from pdinfer.config import MoEConfig
from pdinfer.distributed.ep_group import TorchExpertGroup
from pdinfer.engine_type import EngineType
from pdinfer.layers.moe import SparseMoE
from pdinfer.models.spec import MoESpec
from pdinfer.moe.balancer import ExpertLoadBalancer, RearrangementTimer
from pdinfer.moe.placement import ExpertPlacement
from pdinfer.moe.rebalance import rank_loads, rebalance
from pdinfer.moe.sharding import shard_experts


# --- the placement algorithm ------------------------------------------------------------------------
def test_rebalance_by_hand():
    # 4 experts, 2 spare slots, 2 ranks of 3 slots. Replicate: expert 0 (load 10) gets a second
    # replica (10 > 4); a third would put two on one rank, so expert 3 (4 > 1) gets the other.
    # Pack (heaviest first, least loaded rank without that expert): 0 -> r0, 0 -> r1, 3 -> r0,
    # 3 -> r1, 1 -> r0, 2 -> r1: ranks carry 5+2+1 = 8 and 5+2+1 = 8.
    loads = [10, 1, 1, 4]
    assert rebalance(loads, 6, 2) == [0, 1, 3, 0, 2, 3]
    # From the initial placement [0 1 2 | 3 0 1]: pack {0,3,1} shares three experts with rank 1,
    # pack {0,3,2} goes to rank 0; only rank 0's slot 1 changes (1 -> 3).
    assert rebalance(loads, 6, 2, [0, 1, 2, 3, 0, 1]) == [0, 3, 2, 3, 0, 1]
    # Balanced loads: the new packing ({0,2} {1,3}) is no better than what is there; nothing moves.
    assert rebalance([4, 4, 4, 4], 4, 2, [2, 3, 0, 1]) == [2, 3, 0, 1]


def test_rebalance_spreads_a_skewed_load():
    gen = torch.Generator().manual_seed(0)
    loads = (1000 / torch.arange(1, 33).float() ** 1.2)[torch.randperm(32, generator=gen)].tolist()
    for num_ranks, spare in ((4, 0), (4, 8), (8, 8)):
        slots = rebalance(loads, 32 + spare, num_ranks)
        counts = Counter(slots)
        assert set(counts) == set(range(32)) and len(slots) == 32 + spare
        per_rank = (32 + spare) // num_ranks
        for r in range(num_ranks):  # no rank holds two replicas of one expert
            assert len(set(slots[r * per_rank : (r + 1) * per_rank])) == per_rank
        balanced = rank_loads([loads[e] / counts[e] for e in slots], num_ranks)
        naive = rank_loads(loads, num_ranks)  # expert e on rank e // (32 / N)
        ratio = max(balanced) / (sum(balanced) / num_ranks)
        assert ratio < max(naive) / (sum(naive) / num_ranks)
        # Without replicas the hottest expert alone is 1.29x a rank's mean (4 ranks); with
        # 8 spare slots the hot experts split and every rank carries the mean within 1%.
        assert ratio < (1.5 if spare == 0 else 1.01)


def test_replicas_share_tokens_round_robin():
    # expert 1 in slots 1, 3, 5 (three replicas), expert 0 in 0 and 4, expert 2 in 2
    placement = ExpertPlacement([0, 1, 2, 1, 0, 1], 3, 2, rank=0, device=torch.device("cpu"))
    ids = torch.tensor([[1, 0], [1, 2], [1, 0], [1, 2], [1, 0], [1, 2], [1, 0]])
    slots = placement.to_slots(ids)
    assert slots[:, 0].tolist() == [1, 3, 5, 1, 3, 5, 1]  # expert 1's j-th pair -> replica j mod 3
    assert slots[:, 1].tolist() == [0, 2, 4, 2, 0, 2, 4]
    other = ExpertPlacement([0, 1, 2, 1, 0, 1], 3, 2, rank=1, device=torch.device("cpu"))
    assert other.to_slots(ids)[:, 0].tolist() == [3, 5, 1, 3, 5, 1, 3]  # rank 1 starts one later
    assert torch.equal(placement.to_slots(ids), slots)  # deterministic


# --- when to rearrange (the seed's _update_rearrangement) --------------------------------------------
def _fired(timer: RearrangementTimer, kinds: str) -> list[int]:
    return [step for step, kind in enumerate(kinds, 1) if timer.update(kind == "P")]


def test_rearrangement_steps_by_role():
    kinds = "PDDDDDPDDPPD"
    # NORMAL: a prefill sets the counter to interval - 1, so the next decode step rearranges;
    # prefill steps are never counted. 1 P -> 2; 2 D -> 3 fires; 3, 4, 5 D -> fires at 5;
    # 6 D -> 1; 7 P -> 2; 8 D fires; 9 D -> 1; 10, 11 P -> 2; 12 D fires.
    assert _fired(RearrangementTimer(3, is_normal_engine=True), kinds) == [2, 5, 8, 12]
    # NORMAL with PDINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE=0: prefills are skipped only:
    # the decode steps 2 3 4 | 5 6 8 | 9 12 -> fires at the 3rd and 6th decode step.
    assert _fired(RearrangementTimer(3, True, rearrange_after_prefill=False), kinds) == [4, 8]
    # PROMPT and COMPLETION count every step, whatever its kind.
    assert _fired(RearrangementTimer(3, is_normal_engine=False), kinds) == [3, 6, 9, 12]
    assert _fired(RearrangementTimer(3, is_normal_engine=False), "P" * 7) == [3, 6]
    assert _fired(RearrangementTimer(0, is_normal_engine=True), kinds) == []  # 0: never


def test_eplb_interval_role_defaults(monkeypatch):
    monkeypatch.delenv("PDINFER_EPLB_INTERVAL", raising=False)
    assert EngineArgs(engine_type="prompt").eplb_interval == 1000
    assert EngineArgs(engine_type="completion").eplb_interval == 10000
    assert EngineArgs(engine_type="normal").eplb_interval == 10000
    monkeypatch.setenv("PDINFER_EPLB_INTERVAL", "7")  # an operator's value wins over the role's
    assert EngineArgs(engine_type="prompt").eplb_interval == 7
    assert EngineArgs(engine_type="prompt", eplb_interval=5).eplb_interval == 5  # the argument wins
    with pytest.raises(ValueError, match="must divide data_parallel_size"):
        EngineArgs(data_parallel_size=3, expert_parallel_size=2).create_parallel_config()


# --- the role-sized MoE workspace (seed 7.5) --------------------------------------------------------
def test_moe_workspace_sizes_by_role():
    def config(role: str, **kw) -> MoEConfig:
        args = EngineArgs(engine_type=role, max_num_seqs=8, num_draft_tokens=2, max_num_batched_tokens=4096, **kw)
        return args.create_moe_config(args.create_scheduler_config(4096))

    prompt = config("prompt", context_parallel_size=2)
    # decoding: 8 sequences x (1 + 2 draft tokens) = 24; prefilling: 4096 // 2 CP ranks = 2048
    assert (prompt.max_num_decoding_tokens, prompt.max_num_prefilling_tokens) == (24, 2048)
    assert prompt.workspace_tokens == 2048  # a PE only prefills
    completion = config("completion")
    assert (completion.max_num_decoding_tokens, completion.max_num_prefilling_tokens) == (24, 4096)
    assert completion.workspace_tokens == 24  # a CE only decodes
    normal = config("normal")
    assert normal.workspace_tokens == 4096  # both kinds: the prefill bound
    assert (normal.max_tokens_per_rank(is_prompt=True), normal.max_tokens_per_rank(is_prompt=False)) == (4096, 24)


# --- two expert-parallel ranks as threads ------------------------------------------------------------
MOE = MoESpec(
    num_experts=8,
    top_k=2,
    intermediate_size=16,
    sparse_layers=(0,),
    scoring="sigmoid",
    norm_topk_prob=True,
    num_groups=4,
    topk_groups=2,
    group_score="top2",
    routed_scaling_factor=2.5,
    correction_bias=True,
)
HIDDEN = 32


def _full_layer() -> SparseMoE:
    torch.manual_seed(0)
    layer = SparseMoE(MOE, HIDDEN)
    for param in layer.parameters():
        nn.init.normal_(param, 0.0, 0.3)
    return layer.eval().requires_grad_(False)


def _rank_layer(full: SparseMoE, config: MoEConfig, group: TorchExpertGroup | None) -> SparseMoE:
    """``full`` sharded for this rank: its slots filled with the experts they name."""
    holder = nn.Module()
    with torch.device("meta"):
        holder.layer = SparseMoE(MOE, HIDDEN)
    shard_experts(holder, config, group, torch.float32, torch.device("cpu"))
    holder.to_empty(device="cpu")
    layer = holder.layer
    with torch.no_grad():
        layer.gate.load_state_dict(full.gate.state_dict())
        _fill_slots(layer, full)
    return layer.eval().requires_grad_(False)


def _fill_slots(layer: SparseMoE, full: SparseMoE) -> None:
    picks = torch.tensor(layer.experts.slot_experts)
    layer.experts.gate_up_proj.copy_(full.experts.gate_up_proj[picks])
    layer.experts.down_proj.copy_(full.experts.down_proj[picks])


def _on_ranks(fn, size: int = 2) -> list:
    """``fn(group)`` on ``size`` threads, each a rank of one connected gloo expert group."""
    store = dist.HashStore()
    results: list = [None] * size
    errors: list = []

    def run(rank: int) -> None:
        try:
            group = TorchExpertGroup(rank, size, timeout_s=30)
            group.connect(dist.PrefixStore("ep/", store))
            results[rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _moe_config(role: EngineType = EngineType.NORMAL, redundant: int = 2, tokens: int = 16) -> MoEConfig:
    return MoEConfig(role.value, tokens, tokens, expert_parallel_size=2, num_redundant_experts=redundant)


def test_two_ranks_dispatch_and_combine_equal_one_layer_with_every_expert():
    full = _full_layer()
    inputs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)) for n in (5, 0, 11, 3)]
    config = _moe_config()

    def rank(group: TorchExpertGroup):
        layer = _rank_layer(full, config, group)
        assert layer.dispatcher is not None
        # buffers sized by the workspace: 16 tokens x top-2 sent, twice that received
        assert layer.dispatcher.send_buffer.shape[0] == 32 and layer.dispatcher.recv_buffer.shape[0] == 64
        assert layer.experts.gate_up_proj.shape[0] == 5  # (8 + 2) / 2 slots
        mine = inputs[group.rank :: 2]  # rank 0: 5 then 11 tokens; rank 1: 0 (an empty step) then 3
        with layer.dispatcher.step(is_prompt=False):
            outputs = [layer(x) for x in mine]
            load = layer.expert_load.clone()
            with pytest.raises(RuntimeError, match="exceeds this step's MoE workspace bound"):
                layer(torch.zeros(17, HIDDEN))  # raises before any exchange: the peer is not left waiting
        return outputs, load

    (out0, load0), (out1, load1) = _on_ranks(rank)
    with torch.no_grad():
        want = [full(x) for x in inputs]
    for got, ref in zip(out0 + out1, want[0::2] + want[1::2]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    routed = torch.cat([full.gate(x)[1].reshape(-1) for x in inputs if len(x)])
    assert torch.equal(load0 + load1, torch.bincount(routed, minlength=8))  # each rank counts its own tokens


def test_a_rearrangement_moves_weights_between_ranks_and_changes_no_output():
    full = _full_layer()
    x = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + n)) for n in (9, 4)]
    config = _moe_config(redundant=0)

    def rank(group: TorchExpertGroup):
        layer = _rank_layer(full, config, group)
        balancer = ExpertLoadBalancer([layer], config, group)
        mine = x[group.rank]
        with layer.dispatcher.step(is_prompt=True):
            before = layer(mine)
            first = list(layer.placement.slot_experts)
            # experts 0-3 (all on rank 0 at first) carry the load: two of them must move
            balancer.rearrange(torch.tensor([[9, 9, 9, 9, 1, 1, 1, 1]]))
            after = layer(mine)
        slots = layer.experts.slot_experts
        moved_in = balancer.stats.num_slots_received
        for slot, e in enumerate(slots):  # every slot holds its expert's weights
            assert torch.equal(layer.experts.gate_up_proj[slot], full.experts.gate_up_proj[e])
            assert torch.equal(layer.experts.down_proj[slot], full.experts.down_proj[e])
        return before, after, first, list(layer.placement.slot_experts), moved_in

    results = _on_ranks(rank)
    for (before, after, first, placed, _), mine in zip(results, x):
        assert first == list(range(8))
        assert sorted(placed[:4]) != [0, 1, 2, 3]  # experts moved between the ranks
        assert sum(e < 4 for e in placed[:4]) == 2  # two hot experts a rank (9+9+1+1 each)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(after, full(mine), rtol=1e-5, atol=1e-5)
    assert results[0][4] == 2 and results[1][4] == 2  # two slots' weights crossed each way
