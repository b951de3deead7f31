"""DeepSeek-V3's multi-token-prediction (MTP) module, run as a drafter (``worker/mtp_drafter.py``).

The checkpoint numbers its MTP layers after the main stack: ``model.layers.{N}.*`` with N from
``num_hidden_layers`` (transformers drops them; ``checkpoint.load_checkpoint`` skips them for
the main model). One MTP layer at position i reads the target's hidden state h_i (after the
main model's final norm, as vLLM and SGLang feed it) and the embedding of the token at i + 1:

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])      (Linear 2H -> H, no bias)
    h'_i = block(x)                                       (a full decoder layer: MLA + MoE/dense)
    logits = head(shared_head.norm(h'_i))                 (predicts t_{i+2})

``embed_tokens`` is the main model's (DeepSeek-V3 stores a copy per MTP layer; vLLM loads it
shared too). ``shared_head.head`` is loaded where the checkpoint has it, else the main model's
``lm_head`` serves. Only the first MTP layer is run (DeepSeek-V3 has one; more layers would each
predict one token further, and drafting k tokens reuses the first k times, as vLLM does).
The block's attention is MLA over its own latent cache (one layer, indexed by the main cache's
block ids), so its parameter names are a main layer's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from pdinfer.layers.moe import SparseMoE
from pdinfer.models.checkpoint import GATE_UP, load_checkpoint
from pdinfer.models.decoder import DecoderLM, MoEDecoderLayer
from pdinfer.models.deepseek import MLAttention
from pdinfer.models.llama import MLP, RMSNorm
from pdinfer.models.spec import ModelSpec

# Tensors of an MTP layer outside its decoder block.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class SharedHead(nn.Module):
    def __init__(self, spec: ModelSpec, has_head: bool):
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if has_head else None


class DeepseekMTP(nn.Module):
    """One MTP layer. ``layers[0]`` is its decoder block (attention reads cache layer 0 of the
    drafter's own latent cache)."""

    def __init__(self, spec: ModelSpec, has_head: bool = True):
        super().__init__()
        mla, moe = spec.mla, spec.moe
        if mla is None or moe is None:
            raise ValueError(f"{spec.architecture} has no MLA/MoE specs: no DeepSeek MTP layer")
        hidden = spec.hidden_size
        self.spec = spec
        self.enorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # The MTP layer follows the main stack, past first_k_dense_replace: sparse where layers are.
        if moe.sparse_layers:
            shared = MLP(spec, moe.intermediate_size * moe.num_shared_experts) if moe.num_shared_experts else None
            mlp: nn.Module = SparseMoE(moe, hidden, shared)
        else:
            mlp = MLP(spec)
        self.layers = nn.ModuleList([MoEDecoderLayer(spec, MLAttention(spec, mla, 0), mlp)])
        self.shared_head = SharedHead(spec, has_head)

    def forward(self, embeds, prev_hidden, cos, sin, kv_cache, meta, keep_rows=None) -> torch.Tensor:
        """h' of every row (or of ``keep_rows``): ``embeds`` are the next tokens' embeddings,
        ``prev_hidden`` the target's normed hidden states (or the previous MTP step's h')."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return self.layers[0](x, cos, sin, kv_cache, meta, keep_rows)

    def compute_logits(self, hidden: torch.Tensor, main: DecoderLM) -> torch.Tensor:
        """Float32 logits through the shared head (or the main model's output projection)."""
        hidden = self.shared_head.norm(hidden)
        head = self.shared_head.head
        if head is not None:
            return head(hidden).float()
        if main.lm_head is not None:
            return main.lm_head(hidden).float()
        return nn.functional.linear(hidden, main.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors already renamed by ``mtp_weights`` (block tensors as layer 0)."""
        load_checkpoint(self, weights, GATE_UP, {}, 1)


def mtp_weights(weights: Iterable[tuple[str, torch.Tensor]], first_mtp_layer: int):
    """The first MTP layer's tensors, renamed for ``DeepseekMTP``: its block's as ``layers.0.``,
    its own (enorm, hnorm, eh_proj, shared_head) as they are; its copy of the embedding is
    skipped (the main model's serves)."""
    prefix = re.compile(rf"^(model\.)?layers\.{first_mtp_layer}\.")
    for name, tensor in weights:
        match = prefix.match(name)
        if match is None:
            continue
        rest = name[match.end() :]
        if rest.startswith("embed_tokens."):
            continue
        yield (rest if rest.startswith(_OWN) else f"layers.0.{rest}"), tensor


def has_shared_head(names: Iterable[str], first_mtp_layer: int) -> bool:
    pattern = re.compile(rf"^(model\.)?layers\.{first_mtp_layer}\.shared_head\.head\.weight$")
    return any(pattern.match(name) for name in names)


def build_mtp(
    spec: ModelSpec, folder: str, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> DeepseekMTP:
    """The checkpoint's first MTP layer (``num_nextn_predict_layers`` >= 1), or random weights
    for ``load_format="dummy"``."""
    from pdinfer.models.loader import init_dummy_weights

    first = spec.num_layers
    files = sorted(Path(folder).glob("*.safetensors")) if load_format != "dummy" else []
    names = [name for file in files for name in _keys(file)]
    if files and not any(re.match(rf"^(model\.)?layers\.{first}\.", name) for name in names):
        raise ValueError(
            f"the config names an MTP layer (num_nextn_predict_layers) but the checkpoint in {folder} has "
            f"no tensors model.layers.{first}.* (transformers drops them when it saves a DeepSeek-V3)"
        )
    with torch.device("meta"):
        mtp = DeepseekMTP(spec, has_head=has_shared_head(names, first))
    mtp = mtp.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        init_dummy_weights(mtp.named_parameters(), 1, seed + 1)
    else:
        mtp.load_weights(mtp_weights(_tensors(files, first, dtype), first))
    return mtp.eval().requires_grad_(False)


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def _tensors(files: list[Path], first_mtp_layer: int, dtype: torch.dtype):
    """Only the MTP layer's tensors are read (not the whole checkpoint again)."""
    from safetensors import safe_open

    prefix = re.compile(rf"^(model\.)?layers\.{first_mtp_layer}\.")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if prefix.match(name):
                    yield name, f.get_tensor(name).to(dtype)
