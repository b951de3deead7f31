"""The fused MoE (``layers/triton_moe.py``) on the CPU, in Triton's interpreter (TRITON_INTERPRET=1).

The device-side alignment is checked against a hand-computed list; the fused experts against
a float64 reference of the routed MLP (route, each chosen expert's SiLU-gated MLP, weighted
sum) for several token counts, expert counts and shapes that do and do not fill the blocks;
the whole layer against the torch path, EPLB replicas included. bfloat16 dots are wrong in the
interpreter, so the half-precision case runs in float16; ``benchmarks/gpu_moe.py`` checks
bfloat16 on the GPU. Skipped only where Triton is missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from pdinfer.layers import triton_moe as tm  # noqa: E402
from pdinfer.layers.moe import SparseMoE  # noqa: E402
from pdinfer.models.spec import MoESpec  # noqa: E402
from pdinfer.moe.placement import ExpertPlacement  # noqa: E402

if not tm.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs Triton's interpreter", allow_module_level=True)

SMALL = tm.MoEKernelConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def ref_moe(x, gate_up, down, weights, ids) -> torch.Tensor:
    """float64: sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]."""
    inter = down.shape[2]
    h = torch.einsum("tkoh,th->tko", gate_up.double()[ids], x.double())  # [T, k, 2I]
    act = F.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("tkhi,tki->tkh", down.double()[ids], act)
    return (weights.double().unsqueeze(-1) * y).sum(dim=1)


def random_moe(tokens, experts, top_k, hidden, inter, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids


# --- alignment -----------------------------------------------------------------------------------
def test_align_block_size_by_hand():
    # pairs 0..5 go to slots 0 2 | 2 3 | 0 2; four slots, blocks of 4 rows
    ids = torch.tensor([[0, 2], [2, 3], [0, 2]])
    sorted_ids, block_slot, num_padded = tm.align_block_size(ids, num_slots=4, block_m=4)
    pad = 6
    assert num_padded.tolist() == [12]  # slot 0: 2 -> 4 rows, slot 1: none, slot 2: 3 -> 4, slot 3: 1 -> 4
    assert sorted_ids[:12].tolist() == [0, 4, pad, pad, 1, 2, 5, pad, 3, pad, pad, pad]
    assert block_slot[:3].tolist() == [0, 2, 3]
    # the grid's size comes from the shape alone: 6 pairs + 4 slots * 3 padding rows -> 5 blocks
    assert sorted_ids.numel() == 20 and block_slot.numel() == 5
    assert sorted_ids[12:].eq(pad).all()


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (50, 16, 4, 16), (33, 4, 3, 8)])
def test_align_block_size_random(tokens, experts, top_k, block_m):
    _, _, _, _, ids = random_moe(tokens, experts, top_k, 4, 4, seed=tokens)
    sorted_ids, block_slot, num_padded = tm.align_block_size(ids, experts, block_m)
    flat, n = ids.reshape(-1), ids.numel()
    used = int(num_padded)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    real = sorted_ids[:used][sorted_ids[:used] < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n].long()
        assert flat[rows].eq(int(block_slot[b])).all()  # one slot per block
        assert rows.tolist() == sorted(rows.tolist())  # token order within a slot


# --- fused experts against float64 --------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("hidden,inter", [(32, 16), (40, 24)])  # fills the 16-blocks, or does not
def test_fused_experts_match_reference(tokens, experts, top_k, hidden, inter):
    x, gate_up, down, weights, ids = random_moe(tokens, experts, top_k, hidden, inter, seed=tokens + experts)
    out = tm.fused_experts(x, gate_up, down, weights, ids, SMALL)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref_moe(x, gate_up, down, weights, ids)) < 1e-5


def test_idle_expert_and_one_crowded_expert():
    x, gate_up, down, weights, ids = random_moe(20, 8, 2, 40, 24, seed=3)
    ids[:, 0] = 5  # 20 rows for slot 5: two M-blocks, the second part padding
    ids[:, 1] = torch.where(ids[:, 1] == 5, 1, ids[:, 1])
    ids[ids == 3] = 2  # slot 3 gets no rows
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    assert not (ids == 3).any() and ids[:, 0].eq(5).all()
    gate_up[3].fill_(float("nan"))  # an idle slot's weights are never read
    out = tm.fused_experts(x, gate_up, down, weights, ids, SMALL)
    assert rel_err(out, ref_moe(x, gate_up, down, weights, ids)) < 1e-5


def test_default_configs_and_no_tokens():
    x, gate_up, down, weights, ids = random_moe(5, 8, 2, 40, 24, seed=4)
    out = tm.fused_experts(x, gate_up, down, weights, ids)  # pick_config's decode tiles
    assert rel_err(out, ref_moe(x, gate_up, down, weights, ids)) < 1e-5
    empty = tm.fused_experts(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, 40)


def test_float16_close_to_reference():
    x, gate_up, down, weights, ids = random_moe(17, 8, 2, 40, 24, seed=5, dtype=torch.float16)
    out = tm.fused_experts(x, gate_up, down, weights, ids, SMALL)
    assert out.dtype == torch.float16
    assert rel_err(out, ref_moe(x, gate_up, down, weights, ids)) < 5e-3


# --- the layer: fused vs torch path, EPLB replicas ----------------------------------------------
def make_layer(experts=8, top_k=2, hidden=40, inter=24, seed=6) -> SparseMoE:
    moe = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=inter, sparse_layers=())
    layer = SparseMoE(moe, hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer


def test_layer_fused_matches_torch_path():
    layer = make_layer()
    x = torch.randn(13, 40, generator=torch.Generator().manual_seed(7))
    layer.experts.use_fused = False
    want = layer(x)
    layer.experts.use_fused = True
    assert rel_err(layer(x), want) < 1e-5


def test_layer_fused_over_eplb_replica_slots():
    """Redundant experts: the stack is indexed by physical slot; the fused kernel takes the
    slots the placement maps each pair to, and the output equals the layer without replicas."""
    experts, redundant = 8, 4
    plain = make_layer(experts)
    x = torch.randn(21, 40, generator=torch.Generator().manual_seed(8))
    plain.experts.use_fused = False
    want = plain(x)
    layer = make_layer(experts)
    placement = ExpertPlacement.initial(experts, redundant, 1, 0, torch.device("cpu"))
    slots = placement.slot_experts  # slot p holds expert p mod 8
    with torch.no_grad():
        layer.experts.gate_up_proj = torch.nn.Parameter(plain.experts.gate_up_proj[slots].clone())
        layer.experts.down_proj = torch.nn.Parameter(plain.experts.down_proj[slots].clone())
    layer.experts.slot_experts = slots
    layer.placement = placement
    layer.expert_load = torch.zeros(experts, dtype=torch.int64)
    layer.experts.use_fused = True
    assert rel_err(layer(x), want) < 1e-5
    assert int(layer.expert_load.sum()) == 21 * 2
    assert placement.to_slots(plain.gate(x)[1]).ge(experts).any()  # some pairs did take a replica
