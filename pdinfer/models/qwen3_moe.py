"""Qwen3-MoE: Qwen3's attention (grouped-query, q/k RMSNorm, paged K/V) with sparse MoE
layers: softmax top-k routing, the chosen weights renormalized when ``norm_topk_prob``."""

from __future__ import annotations

from torch import nn

from pdinfer.layers.moe import SparseMoE
from pdinfer.layers.rotary import RotaryEmbedding
from pdinfer.models.checkpoint import GATE_UP, QKV
from pdinfer.models.decoder import DecoderLM, MoEDecoderLayer
from pdinfer.models.llama import MLP, Attention
from pdinfer.models.spec import ModelSpec


class Qwen3MoeForCausalLM(DecoderLM):
    FUSED = {**GATE_UP, **QKV}

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling))

    def make_layer(self, layer_idx: int) -> nn.Module:
        spec, moe = self.spec, self.spec.moe
        if moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs a MoE spec")
        mlp = SparseMoE(moe, spec.hidden_size) if layer_idx in moe.sparse_layers else MLP(spec)
        return MoEDecoderLayer(spec, Attention(spec, layer_idx, self.rotary), mlp)

    def part_rows(self) -> dict[str, tuple[int, int]]:
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
