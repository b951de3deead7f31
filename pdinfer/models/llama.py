"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch modules.

Per-step metadata is an argument of ``forward``; the model holds no step state. Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger kernels).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdinfer.layers import cpu_kernels, triton_gate_up, triton_linear
from pdinfer.layers.attention.metadata import AttentionMetadata
from pdinfer.layers.attention.torch_paged import TorchPagedAttention
from pdinfer.layers.attention.triton_paged import GpuAttentionMetadata, TritonPagedAttention
from pdinfer.layers.rotary import RotaryEmbedding, apply_rotary
from pdinfer.models.spec import ModelSpec

if TYPE_CHECKING:
    from pdinfer.layers.cpu_decode_stack import DecodeStack

MLP_CHUNK_ROWS = 1024  # CPU: rows per MLP chunk of a large prefill


def _fused_ops(x: torch.Tensor):
    """Fused RMSNorm/rotary/SiLU-and-mul: Triton (pdinfer/layers/triton_ops.py) for CUDA tensors,
    the native CPU kernels (pdinfer/layers/cpu_kernels.py) for float32 CPU ones once a CPU model
    runner has built them; None: the plain torch code below."""
    if x.is_cuda:
        from pdinfer.layers import triton_ops

        return triton_ops if triton_ops.HAS_TRITON else None
    return cpu_kernels.fused_ops() if x.dtype == torch.float32 else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := _fused_ops(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # the same arithmetic, without no-op casts or extra buffers
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))).mul_(self.weight)
        dtype = x.dtype
        if not x.is_cuda and (ops := cpu_kernels.fused_ops()) is not None:  # a bfloat16 CPU model
            # The float32 kernel between two casts (3 passes instead of 8), rounded once at the
            # end, as the Triton kernel does on GPUs.
            return ops.rms_norm(x.float(), self.weight.float(), self.eps).to(dtype)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        # the Triton backend replaces it on CUDA engines (``triton_paged.use_triton_attention``)
        self.backend: TorchPagedAttention | TritonPagedAttention = TorchPagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(
        self, x, cos, sin, kv_cache, meta: AttentionMetadata | GpuAttentionMetadata, keep_rows=None
    ) -> torch.Tensor:
        """``keep_rows``: only these rows of the output are needed (K/V are still written for all)."""
        qkv = triton_linear.linear(self.qkv_proj, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        backend = self.backend
        if (
            isinstance(backend, TritonPagedAttention)
            and isinstance(meta, GpuAttentionMetadata)
            and backend.fuses_rotary
            and cos.shape[-1] == self.head_dim
        ):
            # the Triton backend rotates q and k in the kernel that writes K/V: one launch fewer
            out = backend.forward(q, k, v, kv_cache[:, self.layer_idx], meta, rotary=(cos, sin))
        else:
            out = self._rotate_and_attend(qkv, q, k, v, cos, sin, kv_cache, meta)
        if keep_rows is not None:
            out = out.index_select(0, keep_rows)
        return triton_linear.linear(self.o_proj, out.reshape(-1, self.q_size))

    def _rotate_and_attend(self, qkv, q, k, v, cos, sin, kv_cache, meta) -> torch.Tensor:
        if (ops := _fused_ops(q)) is not None:
            q, k = ops.rotary_qk_(q, k, cos, sin)  # in place, one kernel for both
        elif self.q_norm is None:  # q and k side by side in qkv: rotate both with one set of ops
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.backend.forward(q, k, v, kv_cache[:, self.layer_idx], meta)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate = intermediate_size or spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MLP_CHUNK_ROWS and not x.is_cuda:
            # Large prefills in row chunks: each chunk's [rows, 2 * intermediate] temporary stays
            # small enough for glibc to reuse (32 MiB and up is a fresh, page-faulting mmap).
            return torch.cat([self(part) for part in x.split(MLP_CHUNK_ROWS)])
        if (ops := _fused_ops(x)) is not None:
            if triton_gate_up.applies(self.gate_up_proj, x):
                return self.down_proj(triton_gate_up.mlp_gate_up_silu(self.gate_up_proj, x))
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, kv_cache, meta, keep_rows=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, keep_rows)
        x = (x if keep_rows is None else x.index_select(0, keep_rows)) + h
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


def final_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of the final norm's output, in the model's dtype: through ``lm_head``, or the
    embedding where they are tied (``lm_head`` None; on CPU it may be a packed copy of the tied
    weight). Not upcast here: a greedy step needs only their argmax, which is the same in any
    float dtype, and a batch-256 step of a 128k vocabulary would move 0.26 GB more for the
    float32 copy; ``Sampler`` and ``score_prompt`` upcast when they compute more than that."""
    hidden = model.norm(hidden)
    if model.lm_head is None:
        return F.linear(hidden, model.embed_tokens.weight)
    return triton_linear.linear(model.lm_head, hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.rotary) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # CPU decode steps: the layers in one native call (layers/cpu_decode_stack.py), set by
        # the model runner once the linears are packed; None: the modules.
        self.decode_stack: DecodeStack | None = None
        # The CUDA step runner turns this on: residual adds fused into the next norm (Triton).
        self.fused_residual = False
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self, input_ids, positions, kv_cache, meta: AttentionMetadata, keep_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of every input token, or only of ``keep_rows`` (the last
        layer then skips the other rows after attention); K/V written to ``kv_cache``."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        stack = self.decode_stack
        if (
            stack is not None
            and keep_rows is None
            and isinstance(meta, AttentionMetadata)
            and not meta.is_prompt
            and meta.native is not None
            and x.shape[0] <= stack.max_rows
        ):
            return stack.run(x, cos, sin, kv_cache, meta)
        if self.fused_residual:
            return self._forward_fused_residual(x, cos, sin, kv_cache, meta, keep_rows)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, meta, keep_rows if i == last else None)
        return x

    def _forward_fused_residual(self, x, cos, sin, kv_cache, meta, keep_rows):
        """The same layers with each residual add fused into the norm that follows it (Triton's
        ``add_rms_norm_``): two fewer kernels a layer. ``x`` is the residual stream, updated in
        place; the arithmetic and its rounding are the unfused loop's."""
        from pdinfer.layers import triton_ops as ops

        layers = self.layers
        last = len(layers) - 1
        normed = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            keep = keep_rows if i == last else None
            h = layer.self_attn(normed, cos, sin, kv_cache, meta, keep)
            if keep is not None:
                x = x.index_select(0, keep)
            post = layer.post_attention_layernorm
            normed = ops.add_rms_norm_(h, x, post.weight, post.eps)
            h = layer.mlp(normed)
            if i < last:
                nxt = layers[i + 1].input_layernorm
                normed = ops.add_rms_norm_(h, x, nxt.weight, nxt.eps)
            else:
                x.add_(h)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_logits(self, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = map_checkpoint_name(name)
            if target is None or (target == "lm_head.weight" and self.lm_head is None):
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in {self.spec.architecture}")
            param = params[target]
            with torch.no_grad():
                dest = param if shard is None else self._shard_view(target, param, shard)
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}:{shard}")
        self._check_complete(loaded)

    def _shard_view(self, target: str, param: torch.Tensor, shard: str) -> torch.Tensor:
        s = self.spec
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        bounds = {
            "q": (0, q),
            "k": (q, q + kv),
            "v": (q + kv, q + 2 * kv),
            "gate": (0, inter),
            "up": (inter, 2 * inter),
        }
        start, end = bounds[shard]
        return param[start:end]

    def _check_complete(self, loaded: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected |= {f"{name}:{p}" for p in ("q", "k", "v")}
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                expected |= {f"{name}:{p}" for p in ("gate", "up")}
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")


# The shards of each fused weight, in row order (``LlamaForCausalLM._shard_view``).
SHARD_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def map_checkpoint_name(name: str) -> tuple[str | None, str | None]:
    """Hugging Face tensor name -> (our parameter name, shard of a fused parameter)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None, None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            parts[i] = fused
            return ".".join(parts), shard
    return name, None
