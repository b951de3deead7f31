"""DeepSeek-V2 and -V3: multi-head latent attention over a latent paged cache
(``layers/attention/mla.py``) and DeepSeekMoE (shared experts plus routed experts with grouped
top-k; V2 scores by softmax, V3 by sigmoid with the correction bias), dense MLPs in the first
``first_k_dense_replace`` layers. Parameter names are the checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn

from pdinfer.layers.attention.mla import MLAPagedAttention, build_mla_metadata
from pdinfer.layers.moe import SparseMoE
from pdinfer.layers.rotary import RotaryEmbedding, apply_rotary
from pdinfer.models.decoder import DecoderLM, MoEDecoderLayer
from pdinfer.models.llama import MLP, RMSNorm
from pdinfer.models.spec import MLASpec, ModelSpec

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not rms_norm_eps


class KVUpProjection(nn.Linear):
    """``kv_b_proj``, kept unpacked (``pack_linears`` packs exact ``nn.Linear`` only): decode
    reads its weight per head as W_UK and W_UV."""


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec, mla: MLASpec, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mla = mla
        self.num_heads = heads = spec.num_heads
        hidden, qk_head = spec.hidden_size, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = spec.o_bias  # attention_bias: the a-projections and o_proj
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.backend = MLAPagedAttention(
            heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim, mla.softmax_scale
        )

    def forward(self, x, cos, sin, kv_cache, meta, keep_rows=None) -> torch.Tensor:
        mla = self.mla
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(x.shape[0], self.num_heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        rotate = rotate_interleaved if mla.rope_interleave else apply_rotary
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        entries = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)
        out = self.backend.forward(q_nope, q_rope, entries, self.kv_b_proj.weight, kv_cache[:, self.layer_idx], meta)
        if keep_rows is not None:
            out = out.index_select(0, keep_rows)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * mla.v_head_dim))


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on (even, odd) pairs of ``x`` [T, heads, rope], each pair by one frequency;
    the result is de-interleaved (rotated evens, then odds), as transformers' DeepSeek-V3 does.
    Queries and keys get the same permutation, so their dot products are the interleaved ones."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


class DeepseekForCausalLM(DecoderLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the spec carries the differences)."""

    def __init__(self, spec: ModelSpec):
        if spec.mla is None or spec.moe is None:
            raise ValueError(f"{spec.architecture} needs MLA and MoE specs")
        rope_dim = spec.mla.qk_rope_head_dim
        super().__init__(spec, RotaryEmbedding(rope_dim, spec.rope_theta, spec.rope_scaling))

    def make_layer(self, layer_idx: int) -> nn.Module:
        spec, mla, moe = self.spec, self.spec.mla, self.spec.moe
        if mla is None or moe is None:
            raise ValueError(f"{spec.architecture} needs MLA and MoE specs")
        if layer_idx in moe.sparse_layers:
            shared = MLP(spec, moe.intermediate_size * moe.num_shared_experts) if moe.num_shared_experts else None
            mlp: nn.Module = SparseMoE(moe, spec.hidden_size, shared)
        else:
            mlp = MLP(spec)
        return MoEDecoderLayer(spec, MLAttention(spec, mla, layer_idx), mlp)

    def build_attention_metadata(self, inp, kv_cache: torch.Tensor):
        """The model runner's per-step metadata, for the latent cache."""
        return build_mla_metadata(inp, kv_cache)
