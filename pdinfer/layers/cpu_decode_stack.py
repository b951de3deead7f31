"""A CPU decode step's decoder layers in one native call (``csrc/decode_stack.cpp``).

At batch 1 a small model's decode step spends a large share of its time in Python: ~15 calls a
layer (module calls, tensor views, ``ctypes`` argument conversion) around kernels of microseconds.
``DecodeStack`` hands the whole stack to one C++ function that calls the same kernels in the
same order (RMSNorm, the Q/K/V GEMM, rotary, the K/V write, paged decode attention, the output
projection, the residual add, RMSNorm, gate/up, SiLU-and-mul, down, the residual add; Qwen3's
per-head RMSNorm of q and k after the Q/K/V GEMM), so its
output equals the torch modules' bit for bit: the CPU counterpart of replaying a CUDA graph.

It covers what those kernels cover: float32 Llama-family layers (QK-norm included), decode steps
(one query token per sequence) on the native attention path, and as many rows as every linear's
native GEMM takes: any step up to ``SMALL_GEMM_MAX_ROWS`` rows, and up to the tiled GEMM's limit when
every linear has GGUF blocks. Anything else (prefill, a larger batch, no kernels) runs
the modules, which stay the reference. In the batch-invariant mode it takes every decode step:
its linears and attention then run the one kernel per layer that the modules run in that mode.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from pdinfer.layers.cpu_linear import SMALL_GEMM_MAX_ROWS, PackedLinear


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("wp", ctypes.c_void_p),  # PackedLinear.panels (the batch-invariant mode's float GEMM)
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("mn", ctypes.c_void_p),
        ("qt", ctypes.c_void_p),
        ("dt", ctypes.c_void_p),
        ("mt", ctypes.c_void_p),
        ("aq", ctypes.c_void_p),  # QuantWeight.amx_tiles where the layer runs AMX, else None
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Stack(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("rot", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("batch_invariant", ctypes.c_int64),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(layer: PackedLinear) -> _Linear:
    q = layer.quant
    qs, d, mn = (q.qs, q.d, q.mn) if q is not None else (None, None, None)
    qt, dt, mt = q.tiles if q is not None else (None, None, None)
    return _Linear(
        _ptr(layer.weight),
        _ptr(layer.panels),
        _ptr(qs),
        _ptr(d),
        _ptr(mn),
        _ptr(qt),
        _ptr(dt),
        _ptr(mt),
        _ptr(q.amx_tiles if q is not None and layer.amx else None),
        _ptr(layer.bias),
        layer.weight.shape[0],
        layer.weight.shape[1],
    )


class DecodeStack:
    """The decoder layers of ``model`` (a ``LlamaForCausalLM`` with packed linears) for
    ``run``; ``build`` returns None for a model the native stack does not cover."""

    def __init__(self, model, lib: ctypes.CDLL, max_rows: int, batch_invariant: bool = False):
        spec = model.spec
        layers = list(model.layers)
        self._layers = (_Layer * len(layers))(
            *[
                _Layer(
                    _ptr(la.input_layernorm.weight),
                    _ptr(la.post_attention_layernorm.weight),
                    _ptr(la.self_attn.q_norm and la.self_attn.q_norm.weight),
                    _ptr(la.self_attn.k_norm and la.self_attn.k_norm.weight),
                    _linear(la.self_attn.qkv_proj),
                    _linear(la.self_attn.o_proj),
                    _linear(la.mlp.gate_up_proj),
                    _linear(la.mlp.down_proj),
                )
                for la in layers
            ]
        )
        self._stack = _Stack(
            self._layers,
            len(layers),
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            model.rotary.rotary_dim,
            layers[0].input_layernorm.eps,
            layers[0].self_attn.backend.scale,
            int(batch_invariant),
        )
        self._lib = lib
        self.max_rows = max_rows

    @classmethod
    def build(cls, model, lib: ctypes.CDLL | None, batch_invariant: bool = False) -> DecodeStack | None:
        """``batch_invariant``: the linears run as ``PackedLinear`` does in that mode (one GEMM for
        every row count, so the stack takes any decode step) and attention never cuts a context."""
        if lib is None or not hasattr(model, "layers"):
            return None
        linears = []
        for la in model.layers:
            attn = la.self_attn
            mods = [attn.qkv_proj, attn.o_proj, la.mlp.gate_up_proj, la.mlp.down_proj]
            if not all(isinstance(m, PackedLinear) and m.kernels is not None for m in mods):
                return None
            linears += mods
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
            return None
        if batch_invariant:
            if not all(m.batch_invariant for m in linears):
                return None
            return cls(model, lib, sys.maxsize, batch_invariant=True)
        if all(m.quant is not None for m in linears):
            return cls(model, lib, min(m.quant.max_rows for m in linears))
        return cls(model, lib, SMALL_GEMM_MAX_ROWS)  # the row-streaming GEMM takes at least as many

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """The decoder layers over the embeddings ``x`` [T, hidden] (updated in place and
        returned) of a decode step with ``meta.native`` set."""
        native = meta.native
        if cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.shape[-1] != self._stack.rot:
            raise ValueError("the native decode stack needs unit-stride cos/sin [T, rotary_dim] of one layout")
        x = x.contiguous()
        self._lib.pd_decode_stack(
            ctypes.byref(self._stack),
            x.data_ptr(),
            x.shape[0],
            kv_cache.data_ptr(),
            kv_cache.stride(1),
            native.kv_strides.data_ptr(),
            meta.slot_rows.data_ptr(),
            native.block_tables.data_ptr(),
            native.context_lens.data_ptr(),
            native.block_tables.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
        )
        return x
