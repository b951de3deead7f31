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


# --- a Qwen3-MoE step through the CUDA step path, fused experts; graph eligibility ---------------
def _tiny_moe_runner(gpu: bool = False):
    from pdinfer.config import EngineArgs
    from pdinfer.models.spec import ModelSpec
    from pdinfer.worker.cpu_runner import CpuRunner
    from pdinfer.worker.gpu_runner import GpuRunner

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        **dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=24, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2),
        **dict(norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=96),
        "max_position_embeddings": 256,
    }
    spec = ModelSpec.from_hf_config(config)
    runner_class = GpuRunner if gpu else CpuRunner  # GpuRunner: the CUDA step path on CPU tensors
    return runner_class(spec, "", "dummy", torch.float32, torch.device("cpu"), EngineArgs().runner_options, seed=3)


def test_moe_model_gpu_step_path_with_fused_experts():
    from pdinfer.worker.gpu_runner import graph_blocker
    from pdinfer.worker.step_input import SampleSpec, StepInput

    cpu, gpu = _tiny_moe_runner(), _tiny_moe_runner(gpu=True)
    layers = [m for m in gpu.model.modules() if isinstance(m, SparseMoE)]
    assert graph_blocker(gpu.model) is not None  # CPU tensors: the torch path, no graphs
    for layer in layers:
        layer.experts.use_fused = True
    assert graph_blocker(gpu.model) is None
    for r in (cpu, gpu):
        r.init_cache(num_blocks=16, block_size=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 11)]
    tables = [[3, 7], [1, 9, 4]]

    def sample(row, position):
        return SampleSpec(row=row, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=position)

    prefill = StepInput(
        step_id=0,
        is_prompt=True,
        input_ids=prompts[0] + prompts[1],
        positions=list(range(5)) + list(range(11)),
        query_lens=[5, 11],
        context_lens=[5, 11],
        block_tables=tables,
        samples=[sample(4, 5), sample(15, 11)],
    )
    decode = StepInput(
        step_id=1,
        is_prompt=False,
        input_ids=[-1, -1],
        positions=[5, 11],
        query_lens=[1, 1],
        context_lens=[6, 12],
        block_tables=tables,
        samples=[sample(0, 6), sample(1, 12)],
        pending=[(0, 0, 0), (1, 0, 1)],
    )
    for inp in (prefill, decode):
        assert gpu.execute(inp).wait().token_ids == cpu.execute(inp).token_ids, inp.step_id
    assert rel_err(gpu.cache.kv, cpu.cache.kv) < 1e-5
    layers[0].placement = ExpertPlacement.initial(8, 0, 1, 0, torch.device("cpu"))
    assert "EPLB" in str(graph_blocker(gpu.model))  # a rearrangement would swap what a graph holds


def test_float32_configs_fit_the_shared_memory_of_a_hopper_block():
    """The configs are tuned for 2-byte elements; float32 tiles are twice the bytes, and a
    32-row, 3-stage config needed 245,760 bytes of shared memory (the H200 has 232,448 a block):
    it runs with 2 stages, and 2-byte elements keep the table's stages."""
    from pdinfer.layers.triton_moe import CONFIGS, MoEKernelConfig, _fit_shared_memory

    cfg = MoEKernelConfig(32, 64, 128, 1, 4, 3)
    assert _fit_shared_memory(cfg, 4).num_stages == 2  # 3 x (32 x 128 + 2 x 128 x 64) x 4 = 245,760
    assert _fit_shared_memory(cfg, 2) == cfg
    for _, table_cfg in CONFIGS:
        fitted = _fit_shared_memory(table_cfg, 4)
        per_stage = (fitted.block_m * fitted.block_k + 2 * fitted.block_k * fitted.block_n) * 4
        assert fitted.num_stages * per_stage <= 232_448
