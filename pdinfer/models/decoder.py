"""The decoder-only frame the MoE families share: embedding, a stack of layers, final norm and
vocabulary projection. A family supplies its layer (``make_layer``), its rotary embedding and
how its checkpoint names map onto fused parameters.

Same calling convention as ``LlamaForCausalLM``: per-step metadata is an argument of
``forward``, the model holds no step state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdinfer.layers.rotary import RotaryEmbedding
from pdinfer.models.checkpoint import GATE_UP, load_checkpoint
from pdinfer.models.llama import RMSNorm, final_logits
from pdinfer.models.spec import ModelSpec


class DecoderLM(nn.Module):
    # checkpoint projection -> (fused parameter, part); see models/checkpoint.py
    FUSED: dict[str, tuple[str, str]] = GATE_UP

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.spec = spec
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def make_layer(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids, positions, kv_cache, meta, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every input token, or only of ``keep_rows`` (the last
        layer then skips the other rows after attention); the cache written for all."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, meta, keep_rows if i == last else None)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_logits(self, hidden)

    def part_rows(self) -> dict[str, tuple[int, int]]:
        """Row ranges of the fused parts that are not halves (q, k, v of a fused qkv)."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, self.FUSED, self.part_rows(), self.spec.num_layers)


class MoEDecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the MLP is
    sparse (``layers/moe.py``) or dense, by layer."""

    def __init__(self, spec: ModelSpec, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, kv_cache, meta, keep_rows=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, keep_rows)
        x = (x if keep_rows is None else x.index_select(0, keep_rows)) + h
        return x.add_(self.mlp(self.post_attention_layernorm(x)))
