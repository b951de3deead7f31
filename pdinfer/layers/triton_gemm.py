"""The batch-invariant GEMM of CUDA engines (``EngineArgs(batch_invariant=True)``), in Triton.

cuBLAS picks its kernel, tile and split-K by the shape of a call, so one row of ``x @ w.T``
rounds differently at 1 row and at 256. Here every element of the output is one program's
accumulator: its K dimension is reduced in ``BLOCK_K`` steps from the first, in float32, with no
split-K; the tile shape, warps and stages depend on (N, K) and the device only, never on the row
count M (``gemm_config``), and M is never specialized on by Triton (``do_not_specialize``), so a
row is computed by the same instructions in the same order whatever shares its call.
A row tile's other rows (masked rows: zeros) do not enter its sums. The cost: a small M wastes
most of a 128-row tile (decode steps are bound by reading the weights, so the waste is in
arithmetic that the memory system hides), and there is no split-K for small N.

``BatchInvariantLinear`` wraps an ``nn.Linear``'s parameters (shared, not copied);
``use_batch_invariant_linears`` puts it in place of every linear of a model, the tied
``lm_head`` included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdinfer.layers.triton_ops import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["m"])  # a row count of 1 must not compile other code
    def bi_matmul_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        m,
        n,
        k,
        stride_xm,
        stride_wn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(m, BLOCK_M)
        num_n = tl.cdiv(n, BLOCK_N)
        # GROUP_M row tiles take the same weight tile one after the other (it stays in L2);
        # which program computes a tile never changes how the tile is computed
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm[:, None] * stride_xm
        w_cols = w_ptr + rn[None, :] * stride_wn
        mmask = rm[:, None] < m
        nmask = rn[None, :] < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                a = tl.load(x_rows + kk[None, :], mask=mmask, other=0.0)
                b = tl.load(w_cols + kk[:, None], mask=nmask, other=0.0)
            else:
                a = tl.load(x_rows + kk[None, :], mask=mmask & (kk[None, :] < k), other=0.0)
                b = tl.load(w_cols + kk[:, None], mask=nmask & (kk[:, None] < k), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mmask & nmask)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(n: int, k: int, num_sms: int) -> GemmConfig:
    """The one configuration of an (N, K) weight on a device of ``num_sms`` multiprocessors.

    128-row tiles (prefill's efficient shape; decode pays for them in idle arithmetic only);
    128-column tiles where there are enough of them to fill the device, else 64, so that a
    decode step (one row tile) still streams the weight through most multiprocessors."""
    block_n = 128 if -(-n // 128) >= num_sms else 64
    return GemmConfig(block_m=128, block_n=block_n, block_k=64, num_warps=8, num_stages=3 if block_n == 128 else 4)


def bi_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_sms: int) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias`` in the dtype of ``x``, each row computed alike at every M."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("bi_matmul needs a weight with unit stride along K")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = gemm_config(n, k, num_sms)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    bi_matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=8,
        # float32 models: exact float32 products (Triton's default for them is tf32)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


class BatchInvariantLinear(nn.Module):
    """``nn.Linear``'s forward through ``bi_matmul``, on the same parameters."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, num_sms: int):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.num_sms = num_sms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = bi_matmul(x.reshape(-1, shape[-1]), self.weight, self.bias, self.num_sms)
        return out.view(*shape[:-1], out.shape[-1])


def use_batch_invariant_linears(model: nn.Module, num_sms: int) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``BatchInvariantLinear`` on its parameters;
    a model with tied embeddings (``lm_head`` None) gets one over the embedding, which
    ``final_logits`` then uses. Returns how many were replaced."""
    if not HAS_TRITON:
        raise RuntimeError("the batch-invariant mode on CUDA needs Triton: pip install triton")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, BatchInvariantLinear(child.weight, child.bias, num_sms))
                replaced += 1
    if getattr(model, "lm_head", False) is None:  # tied: logits through the embedding's weight
        embed = model.get_submodule("embed_tokens")
        if not isinstance(embed, nn.Embedding):
            raise ValueError(f"tied logits need an nn.Embedding, not {type(embed).__name__}")
        model.lm_head = BatchInvariantLinear(embed.weight, None, num_sms)
        replaced += 1
    return replaced
