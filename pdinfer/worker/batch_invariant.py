"""What the batch-invariant mode (``EngineArgs(batch_invariant=True)``, ``RunnerOptions``) covers.

In this mode a request's logits, and so its tokens and log-probs, are bit-identical whatever else
shares its batch, whatever the batch size and however its prefill is chunked. Each piece of a
forward computes a row with a reduction order of its own, never one chosen by the step's shape.

On the CPU (float32, the native kernels):
- linears: one kernel per layer for every row count (``cpu_linear.PackedLinear``: AMX or the tiled
  GEMM over GGUF blocks, the panel GEMM over float weights), also inside the decode stack;
- prefill attention (``pd_prefill_attention``): per query row, its keys in order from the first,
  in fixed slices; a chunk reads the earlier chunks' K/V from the cache, so the row is the same
  however the prompt was cut (it already is in the default mode);
- decode attention (``pd_paged_decode``): a context is never cut into chunks across threads.

On CUDA (any float dtype; ``prepare_gpu_model``):
- linears, the logits projection included: the Triton GEMM of ``layers/triton_gemm.py`` (one
  tile configuration per weight shape, no split-K), in place of cuBLAS, which picks its kernel
  by the row count;
- decode attention: each context cut into splits by its length alone, merged in one fixed order;
  prefill attention: every key tile through one code path; a prompt step always a prefill
  (``layers/attention/triton_paged.py``);
- CUDA graphs stay on (``worker/cuda_graph.py`` says why that is safe).

Both: RMSNorm, rotary, SiLU-and-mul, the residual adds, the embedding and the log-softmax are row
by row already. A prompt row and a decode row of the same position go through different kernels,
so a sequence recomputed after preemption may differ in its last bits from one never preempted.
The runner refuses what the mode does not cover, here, before building anything large.
"""

from __future__ import annotations

import logging

import torch

from pdinfer.models.llama import LlamaForCausalLM

logger = logging.getLogger("pdinfer")


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """The batch-invariant mode exists on the CPU in float32 (the CPU default) and on CUDA."""
    if device.type == "cuda":
        from pdinfer.layers.triton_ops import HAS_TRITON

        if not HAS_TRITON:
            raise ValueError("batch_invariant on CUDA needs Triton (its GEMM and attention kernels)")
        return
    if device.type != "cpu":
        raise ValueError(f"batch_invariant runs on the CPU and on CUDA GPUs, not on {device.type}")
    if dtype != torch.float32:
        raise ValueError(f"batch_invariant on the CPU needs float32 (dtype auto or float32), got {dtype}")


def check_family(model) -> None:
    """The Llama family only: MoE routing and expert GEMMs are not batch-invariant."""
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"batch_invariant covers the Llama family (Llama, Qwen2/3, Mistral, SmolLM), not "
            f"{type(model).__name__}: its MoE routing and expert GEMMs are not batch-invariant yet"
        )


def check_model(model, kernels) -> None:
    """What the batch-invariant mode covers on the CPU: the Llama family through the native kernels."""
    if kernels is None:
        raise ValueError(
            "batch_invariant needs the native CPU kernels (a C++ compiler, g++): the plain torch "
            "fallback's GEMMs and attention round differently by batch shape"
        )
    check_family(model)


def prepare_gpu_model(model, num_sms: int) -> None:
    """Put the mode's linears in the model (the attention kernels follow the step metadata)."""
    from pdinfer.layers.triton_gemm import use_batch_invariant_linears

    check_family(model)
    replaced = use_batch_invariant_linears(model, num_sms)
    logger.info("batch-invariant mode: %d linears on the Triton GEMM, CUDA graphs kept", replaced)
