"""What the batch-invariant mode (``EngineArgs(batch_invariant=True)``, ``RunnerOptions``) covers.

In this mode a request's logits, and so its tokens and log-probs, are bit-identical whatever else
shares its batch, whatever the batch size and however its prefill is chunked. Each piece of a
forward computes a row with a reduction order of its own, never one chosen by the step's shape:
- linears: one kernel per layer for every row count (``cpu_linear.PackedLinear``: AMX or the tiled
  GEMM over GGUF blocks, the panel GEMM over float weights), also inside the decode stack;
- prefill attention (``pd_prefill_attention``): per query row, its keys in order from the first,
  in fixed slices; a chunk reads the earlier chunks' K/V from the cache, so the row is the same
  however the prompt was cut (it already is in the default mode);
- decode attention (``pd_paged_decode``): a context is never cut into chunks across threads;
- RMSNorm, rotary, SiLU-and-mul, the residual adds, the embedding and the log-softmax are row by
  row already.
The runner refuses what it does not cover, here, before building anything large.
"""

from __future__ import annotations

import torch

from pdinfer.models.llama import LlamaForCausalLM


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """The batch-invariant mode exists on the CPU, in float32 (the CPU default), only."""
    if device.type != "cpu":
        raise ValueError(
            "batch_invariant runs on the CPU only for now: the GPU kernels (Triton attention, "
            "cuBLAS GEMMs) pick their reduction order by batch shape"
        )
    if dtype != torch.float32:
        raise ValueError(f"batch_invariant on the CPU needs float32 (dtype auto or float32), got {dtype}")


def check_model(model, kernels) -> None:
    """What the batch-invariant mode covers: the Llama family through the native kernels."""
    if kernels is None:
        raise ValueError(
            "batch_invariant needs the native CPU kernels (a C++ compiler, g++): the plain torch "
            "fallback's GEMMs and attention round differently by batch shape"
        )
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"batch_invariant covers the Llama family (Llama, Qwen2/3, Mistral, SmolLM), not "
            f"{type(model).__name__}: its MoE routing and expert GEMMs are not batch-invariant yet"
        )
