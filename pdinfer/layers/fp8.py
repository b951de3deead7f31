"""FP8 (e4m3) for Hopper-class GPUs: the checks, the quantizers and the FP8 linear layer.

Two independent options (``EngineArgs``, docs/usage.md "FP8"):

- ``kv_cache_dtype="fp8"``: the KV cache holds ``float8_e4m3fn``. The Triton write kernel
  quantizes, the decode and prefill kernels dequantize in registers (``triton_paged``). The scale
  is static, one per layer for K and one for V, 1.0 by default (vLLM's default): a scale
  computed at the first write would differ between engines, and a PE's blocks must mean the
  same on its CE and in the KV store. Values beyond e4m3's range (+-448) are clamped.
- ``quantization="fp8"``: the decoder's linear weights are quantized at load to e4m3 with one
  scale per output channel (``amax / 448``); the activations get one scale per token, computed
  on the fly by a Triton kernel; the GEMM is ``torch._scaled_mm`` in its row-wise mode (a
  [M, 1] and a [1, N] scale), which accumulates in fp32 and writes bf16. The embedding and the
  logits projection stay in the model dtype (the logits are the most sensitive).

Both need FP8 conversions and tensor cores: CUDA compute capability 8.9 or newer. Elsewhere
``check_support`` refuses at construction with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from pdinfer.layers.triton_ops import HAS_TRITON, next_pow2, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_support(
    device: torch.device, kv_cache_dtype: str, quantization: str | None, *, latent_cache: bool, moe: bool
) -> None:
    """ValueError, with the reason, where the FP8 options cannot run (``latent_cache``: an MLA
    model; ``moe``: a model with routed experts)."""
    wanted = []
    if kv_cache_dtype == "fp8":
        wanted.append("kv_cache_dtype='fp8'")
    if quantization == "fp8":
        wanted.append("quantization='fp8'")
    if not wanted:
        return
    what = " and ".join(wanted)
    if device.type != "cuda":
        raise ValueError(
            f"{what} needs a CUDA GPU with FP8 support (compute capability 8.9 or newer, e.g. Hopper); this "
            f"engine runs on {device.type}, whose kernels read float32/bfloat16 weights and KV caches only"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"{what} needs FP8 conversions and tensor cores (compute capability 8.9 or newer, e.g. Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
    if kv_cache_dtype == "fp8" and latent_cache:
        raise ValueError("kv_cache_dtype='fp8' covers K/V caches; the MLA latent cache kernels read bf16 only")
    if quantization == "fp8" and moe:
        raise ValueError(
            "quantization='fp8' covers dense decoders (Llama, Mistral, Qwen2/3); the MoE expert kernels read bf16 only"
        )


# --- quantizers (torch: weights at load, and the reference for the kernels) ------------------------
def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R, 1]) with x ~= q * scale, scale = amax / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return q.float() * scale


if HAS_TRITON:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_row`` as one Triton kernel (one program per row: one read, one write)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = next_pow2(cols)
    _quantize_rows_kernel[(rows,)](
        x, q, scale, x.stride(0), q.stride(0), cols, BLOCK=block, num_warps=min(16, max(4, block // 1024))
    )
    return q, scale


class Fp8Linear(nn.Module):
    """A linear layer with e4m3 weights and per-output-channel scales (``from_linear``)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Parameters (frozen), so that weight-byte counts and ``.to(device)`` see them.
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K] e4m3, row-major
        self.weight_scale = nn.Parameter(weight_scale.reshape(1, -1).contiguous(), requires_grad=False)  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        n, k = linear.weight.shape
        if n % 16 or k % 16:  # _scaled_mm's alignment
            raise ValueError(f"quantization='fp8' needs linear shapes divisible by 16, got {n} x {k}")
        weight, scale = quantize_per_row(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale.reshape(-1), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        xq, x_scale = quantize_rows(x2) if x2.is_cuda else quantize_per_row(x2)
        # row-wise mode: bf16 output only; a float16/float32 model casts after
        out = torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16
        )
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replace the decoder layers' linears (``QUANTIZED_LINEARS``) by ``Fp8Linear``, layer by
    layer (the bf16 weight of one layer is freed before the next is quantized); returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in QUANTIZED_LINEARS and isinstance(child, nn.Linear):
                setattr(module, name, Fp8Linear.from_linear(child))
                count += 1
    return count
