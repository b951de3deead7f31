"""Sparse mixture-of-experts layers: routing (softmax or sigmoid top-k, DeepSeek's grouped
top-k and correction bias) and the native expert path, tokens grouped by expert.

The experts of a layer are two stacked weights, ``gate_up_proj`` [E, 2 * I, H] and
``down_proj`` [E, H, I] (transformers' layout), so one expert is a contiguous slice. A step
sorts its (token, expert) pairs by expert, runs each chosen expert once over its slice of rows
and adds the weighted results back per token with ``index_add_``: no loop over tokens, and no
work for experts nobody picked. This path reads the per-expert row counts on the host, so on
CUDA it would run eagerly; there the experts run the fused Triton path instead
(``layers/triton_moe.py``: a grouped GEMM over the same sorted rows, no host sync, so decode
steps are captured in CUDA graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdinfer.layers import cpu_kernels, triton_moe

if TYPE_CHECKING:
    from pdinfer.models.spec import MoESpec
    from pdinfer.moe.dispatch import ExpertDispatcher
    from pdinfer.moe.placement import ExpertPlacement


class TopKRouter(nn.Module):
    """Router logits in float32 and the experts each token goes to, with their weights."""

    def __init__(self, moe: MoESpec, hidden_size: int):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        # A parameter, not a buffer: loaded and initialised with the weights (it is never trained).
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.correction_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, H] -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        bias = self.e_score_correction_bias
        return select_experts(logits, self.moe, None if bias is None else bias.float())


def select_experts(
    logits: torch.Tensor, moe: MoESpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each row of router ``logits`` [T, E] and their weights.

    Scores are the softmax or the sigmoid of the logits. The choice ranks scores plus the
    correction bias (V3), restricted to the ``topk_groups`` best of ``num_groups`` expert groups
    (a group's score is its best expert, or its best two summed); the weights are the unbiased
    scores of the chosen experts, renormalized if ``norm_topk_prob``, times the routed scaling.
    """
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.topk_groups < moe.num_groups:
        grouped = choice.view(choice.shape[0], moe.num_groups, moe.num_experts // moe.num_groups)
        if moe.group_score == "top2":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = group_scores.topk(moe.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(moe.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


class Experts(nn.Module):
    """The routed experts of one layer, stacked: one slice per slot this rank holds. Without
    expert parallelism or replicas slot e holds expert e; otherwise ``slot_experts`` names the
    logical expert of each local slot (``moe/sharding.py`` sets it, the loader reads it)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.slot_experts = list(range(num_experts))
        # None: the fused Triton path on CUDA tensors when Triton is there, the torch path
        # otherwise; True/False force one (tests run the fused path on CPU in Triton's
        # interpreter, benchmarks compare the two).
        self.use_fused: bool | None = None

    def slots_of(self, expert: int) -> list[int]:
        """The local slots holding logical ``expert`` (none if another rank holds it)."""
        return [slot for slot, e in enumerate(self.slot_experts) if e == expert]

    def fused(self, x: torch.Tensor) -> bool:
        if self.use_fused is None:
            return x.is_cuda and triton_moe.HAS_TRITON
        return self.use_fused

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.fused(x):
            return triton_moe.fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return grouped_experts(x, self.gate_up_proj, self.down_proj, weights, ids)


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every row t of ``x`` [T, H].

    The T * top_k (token, expert) pairs are sorted by expert (stable: a token's rows keep their
    order); each expert with rows runs SiLU-gated gate/up and down on its contiguous slice.
    """
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync
    token_of = order // top_k
    out_rows = run_experts(x.index_select(0, token_of), gate_up, down, counts)
    out_rows.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out_rows.dtype))
    return torch.zeros_like(x).index_add_(0, token_of, out_rows)


def run_experts(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert e over the next ``counts[e]`` rows of ``rows`` (grouped by expert), unweighted."""
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        out_rows[part] = F.linear(_silu_and_mul(F.linear(rows[part], gate_up[expert])), down[expert])
        start += count
    return out_rows


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    if h.dtype == torch.float32 and not h.is_cuda and (ops := cpu_kernels.fused_ops()) is not None:
        return ops.silu_and_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class SparseMoE(nn.Module):
    """Router, routed experts and (DeepSeekMoE) shared experts that every token goes through.

    With expert parallelism or redundant experts, ``moe/sharding.py`` gives the layer a
    ``placement`` (logical expert -> physical slots), a ``dispatcher`` (the all-to-all to the
    ranks holding the slots; None when this rank holds them all) and a per-expert load counter
    that EPLB reads (``moe/balancer.py``).
    """

    def __init__(self, moe: MoESpec, hidden_size: int, shared_experts: nn.Module | None = None):
        super().__init__()
        self.gate = TopKRouter(moe, hidden_size)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)
        self.shared_experts = shared_experts
        self.placement: ExpertPlacement | None = None
        self.dispatcher: ExpertDispatcher | None = None
        self.expert_load: torch.Tensor | None = None  # [E] tokens routed to each logical expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.placement is None:
            out = self.experts(x, weights, ids)
        else:
            if self.expert_load is not None:
                flat = ids.reshape(-1)  # index_add_, not bincount: no host sync on CUDA
                self.expert_load.index_add_(0, flat, torch.ones_like(flat))
            slots = self.placement.to_slots(ids)
            if self.dispatcher is None:  # every slot is here
                out = self.experts(x, weights, slots)
            else:
                out = self.dispatcher.dispatch_combine(x, weights, slots, self.experts)
        if self.shared_experts is not None:
            out = out.add_(self.shared_experts(x))
        return out
