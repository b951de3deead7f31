"""CPU linear layers through oneDNN with weights reordered once at load ("packed").

oneDNN with a weight reordered once for it beats the default MKL ``sgemm`` that ``F.linear``
calls at every batch size the engine runs; the tied 49k-row vocabulary projection gains the
most (figures in docs/performance.md). For a few rows (batch-1 decode) the native
``pd_small_gemm`` (``cpu_kernels``) streams the plain weights faster still. Only float32 on
CPU is packed; anything else keeps ``nn.Linear``.

Weights that came from a GGUF file as Q4_0/Q4_1/Q8_0 blocks also keep those blocks
(``QuantWeight``): up to ``QuantWeight.max_rows`` rows ``pd_quant_gemm`` reads them instead of
the floats, streaming the blocks past the input rows up to ``cpu_kernels.quant_stream_rows``
rows (4 with AVX-512, 8 with AVX2); above that ``pd_quant_gemm_tiled`` reads a second copy of the blocks laid out by tiles of 32 weight
rows (``QuantWeight.tiles``, built at load) and de-quantizes 256 input positions of a tile at a
time into an L1 panel for a register kernel (8 x 32 with AVX-512, 6 x 16 with AVX2). The
de-quantized values are bit-identical to the float weights (checked when the blocks are
attached), so the result differs from the float path only in the rounding of the sums (their
order; with AVX-512 and up to 4 rows, each block's scale is applied to its sum); a batch-1 step
reads ~115 MB instead of 538 MB for SmolLM2-135M.

On CPUs with AMX (Sapphire Rapids and later; ``PDINFER_CPU_AMX``), steps from
``cpu_kernels.amx_min_rows`` rows (32) take ``pd_amx_quant_gemm`` instead, prefill included:
the quants, small integers, are exact in bfloat16, and each input value is split into three
bfloat16 parts, so AMX's bfloat16 products are exact and its float32 sums give float32 accuracy
(error against float64 below the float32 GEMM's). It reads a third copy of the quants, two
bytes a weight (``QuantWeight.amx_tiles``, built at load).

The batch-invariant mode (``EngineArgs(batch_invariant=True)``, ``PackedLinear(batch_invariant=
True)``) gives up that choice by row count: a row's result must not depend on how many rows
share its call, and each kernel above rounds differently (and oneDNN picks its own blocking by
the row count). Every linear then runs one kernel for every row count, one whose sum for an
output is a fixed chain over K: GGUF blocks on AMX tiles where the CPU has them (per output,
the blocks in order, each block's three tile products then its scale), else the tiled quantized
GEMM (an in-order FMA chain); float weights (no blocks) ``pd_gemm_panels`` over a copy packed
in panels of 32 rows (the same register tile, an in-order FMA chain). The cost is the small
steps' speed (batch-1 decode) where the row-streaming GEMMs were faster; docs/performance.md.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from pdinfer.layers import cpu_kernels

logger = logging.getLogger("pdinfer")

# oneDNN picks a weight layout for this many rows; that one layout serves steps of 1 to 4096 rows.
PACK_BATCH_HINT = 64
# Up to this many rows, the native small GEMM (when built) beats oneDNN.
SMALL_GEMM_MAX_ROWS = 4
# Rows up to which the tiled GEMM (above the row-streaming one's ``cpu_kernels.quant_stream_rows``)
# beats oneDNN on the de-quantized floats, with AVX-512 and AVX2 alike; from 256 rows oneDNN is
# as fast or faster. Q8_0 blocks cost more to de-quantize and save fewer bytes, so the Q8_0
# vocabulary projection goes to oneDNN above 64 rows. Timings: docs/performance.md.
QUANT_TILED_MAX_ROWS = {"q4": 192, "q8": 64}
# Weight rows per tile of the tiled GEMM's layout (``QuantWeight.tiles``).
QUANT_TILE = 32
# Bytes per 32-weight block: a float16 scale (Q4_1: and a float16 minimum) and the quants.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class QuantWeight:
    """A [n, k] weight as 32-weight blocks, in the layout of ``pd_quant_gemm``.

    ``kind`` "q4": w = d * q + mn with 4-bit q (GGUF nibble order); "q8": w = d * q, int8 q.
    """

    kind: str
    qs: torch.Tensor  # uint8: q4 [n, k/32, 16], q8 [n, k]
    d: torch.Tensor  # float32 [n, k/32]
    mn: torch.Tensor | None  # float32 [n, k/32], q4 only
    n: int
    k: int

    @classmethod
    def from_gguf(cls, gguf_type: str, raw: torch.Tensor) -> QuantWeight:
        """From GGUF blocks ``raw`` (uint8 [n, row bytes]) of type Q4_0, Q4_1 or Q8_0."""
        size = _BLOCK_BYTES[gguf_type]
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, size)
        nb = blocks.shape[1]
        d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, nb).float()
        if gguf_type == "Q8_0":
            return cls("q8", blocks[..., 2:].contiguous().reshape(n, nb * 32), d, None, n, nb * 32)
        if gguf_type == "Q4_1":
            mn = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, nb).float()
            qs = blocks[..., 4:]
        else:  # Q4_0: w = d * (q - 8), i.e. a minimum of -8 d (exact: d is a float16)
            mn, qs = -8.0 * d, blocks[..., 2:]
        return cls("q4", qs.contiguous(), d, mn, n, nb * 32)

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight | None:
        """Row-wise concatenation (fused q/k/v, gate/up); None if the kinds or widths differ."""
        if len({(p.kind, p.k) for p in parts}) != 1:
            return None
        mns = [p.mn for p in parts if p.mn is not None]  # all or none: one kind
        mn = torch.cat(mns) if mns else None
        return QuantWeight(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.d for p in parts]),
            mn,
            sum(p.n for p in parts),
            parts[0].k,
        )

    def quants(self, rows: slice = slice(None)) -> torch.Tensor:
        """The integer quants of weight rows ``rows``, [rows, k] (q4: uint8 0..15, q8: int8)."""
        qs = self.qs[rows]
        if self.kind == "q8":
            return qs.view(torch.int8)
        return torch.cat([qs & 15, qs >> 4], dim=-1).flatten(1)  # GGUF order: low nibbles, then high

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight rows ``rows`` (for checks; the kernels never build it)."""
        d = self.d[rows, :, None]
        q = self.quants(rows).reshape(d.shape[0], -1, 32).float()
        if self.kind == "q8":
            return (d * q).flatten(1)
        return (d * q + self.minimums[rows, :, None]).flatten(1)

    def matches(self, weight: torch.Tensor, rows: int = 8) -> bool:
        """Whether the first and last ``rows`` rows de-quantize to exactly ``weight``'s."""
        if tuple(weight.shape) != (self.n, self.k):
            return False
        head, tail = slice(0, rows), slice(max(0, self.n - rows), self.n)
        return bool(
            torch.equal(self.dequantize(head), weight[head]) and torch.equal(self.dequantize(tail), weight[tail])
        )

    @property
    def minimums(self) -> torch.Tensor:
        if self.mn is None:
            raise RuntimeError("q8 blocks have no minimums")
        return self.mn

    @property
    def max_rows(self) -> int:
        """The most input rows for which ``linear`` beats oneDNN on the float weights."""
        return QUANT_TILED_MAX_ROWS[self.kind]

    @functools.cached_property
    def tiles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The same blocks in the tiled GEMM's layout (``quant_gemm.cpp``): rows in tiles of
        ``QUANT_TILE`` (the last padded with zero rows), each tile's quants position by position
        (q4: byte j holds rows j and j + 16, low and high nibble; q8: 32 bytes), and each block's
        scales (minimums) for the tile's rows side by side. Built once, on first use."""
        pad = -self.n % QUANT_TILE
        tiles = (self.n + pad) // QUANT_TILE

        def by_tile(t: torch.Tensor) -> torch.Tensor:  # [n, w] -> [tiles, w, QUANT_TILE]
            t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
            return t.reshape(tiles, QUANT_TILE, -1).transpose(1, 2).contiguous()

        if self.kind == "q8":
            return by_tile(self.qs), by_tile(self.d), None
        half = QUANT_TILE // 2
        q = by_tile(self.quants())
        return (q[..., :half] | (q[..., half:] << 4)).contiguous(), by_tile(self.d), by_tile(self.minimums)

    @functools.cached_property
    def amx_tiles(self) -> torch.Tensor:
        """The quants as bfloat16 (exact: small integers) in ``pd_amx_quant_gemm``'s layout
        (``amx_gemm.cpp``): per tile of ``QUANT_TILE`` rows (the last padded with zero rows) and
        block, two AMX B tiles of 16 rows each, two adjacent positions side by side. Two bytes a
        weight; the scales and minimums are ``tiles``'."""
        pad = -self.n % QUANT_TILE
        q = torch.cat([self.quants().float(), torch.zeros(pad, self.k)])
        tiles, nb = (self.n + pad) // QUANT_TILE, self.k // 32
        # [tiles, 2, 16 rows, nb, 16 pairs, 2] -> [tiles, nb, 2, 16 pairs, 16 rows, 2]
        q = q.reshape(tiles, 2, 16, nb, 16, 2).permute(0, 3, 1, 4, 2, 5)
        return q.to(torch.bfloat16).contiguous().view(torch.int16)

    def linear_amx(self, lib, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, dequantize(), bias)`` on AMX tiles (``pd_amx_quant_gemm``; only where
        ``cpu_kernels.amx_available(lib)``), for any number of rows."""
        _, d, mn = self.tiles
        return self._run(lib.pd_amx_quant_gemm, x, self.amx_tiles, d, mn, bias)

    def linear(self, lib, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, dequantize(), bias)``: row-streaming up to ``quant_stream_rows(lib)``
        rows of ``x``, tiled above (callers send at most ``max_rows``)."""
        if x.shape[0] <= cpu_kernels.quant_stream_rows(lib):
            return self._run(lib.pd_quant_gemm, x, self.qs, self.d, self.mn, bias)
        return self.linear_tiled(lib, x, bias)

    def linear_tiled(self, lib, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, dequantize(), bias)`` through the tiled GEMM, for any number of rows."""
        return self._run(lib.pd_quant_gemm_tiled, x, *self.tiles, bias)

    def _run(self, gemm, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, mn, bias) -> torch.Tensor:
        """One of the native GEMMs (they share one signature) over quants ``q`` in its layout."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        ptr = [None if t is None else t.data_ptr() for t in (x, q, d, mn, bias, out)]
        gemm(*ptr, x.shape[0], self.n, self.k)
        return out


def onednn_packing_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with a oneDNN-reordered copy of ``weight``.

    Float32 weights also take the native small GEMM (a few rows) and a GGUF model's quantized
    blocks; bfloat16 weights run oneDNN's bf16 GEMM (float32 accumulation) for every row count.

    Holds the original parameters under the same names (state dicts are unchanged); the packed
    copy is not a parameter, so it must be rebuilt (``repack``) if the weights change.
    """

    # weight, bias: nn.Parameters (typed Tensor, as torch's own modules declare them)
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels=None,
        quant: QuantWeight | None = None,
        amx: bool = False,
        batch_invariant: bool = False,
    ):
        super().__init__()
        self.weight = weight
        self.bias = bias
        # ``cpu_kernels.load()``: the native GEMMs take float32 rows only
        self.kernels = kernels if weight.is_contiguous() and weight.dtype == torch.float32 else None
        self.quant = quant if self.kernels is not None else None
        # from cpu_kernels.amx_min_rows rows, the blocks on AMX tiles (prefill and large batches)
        self.amx = self.quant is not None and amx and cpu_kernels.amx_available(self.kernels)
        # One kernel for every row count (module docstring); it needs the native kernels.
        self.batch_invariant = batch_invariant
        if batch_invariant and self.kernels is None:
            raise ValueError(
                "the batch-invariant mode runs float32 linears through the native CPU kernels; "
                f"this layer is {weight.dtype}, or the kernels are not built"
            )
        if self.quant is not None:
            _ = self.quant.tiles  # built at load, not in the first large step
            if self.amx:
                _ = self.quant.amx_tiles
        self.panels: torch.Tensor | None = None  # the batch-invariant float GEMM's weight copy
        self.repack()

    def repack(self) -> None:
        if self.batch_invariant:
            # Float weights: the panels instead of oneDNN's copy, which this mode never runs.
            self.panels = cpu_kernels.pack_panels(self.weight) if self.quant is None else None
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return self._invariant(x)
        rows = x.shape[0]
        if self.amx and self.quant is not None and rows >= cpu_kernels.amx_min_rows(self.kernels):
            return self.quant.linear_amx(self.kernels, x, self.bias)
        if self.quant is not None and rows <= self.quant.max_rows:
            return self.quant.linear(self.kernels, x, self.bias)
        if self.kernels is not None and rows <= SMALL_GEMM_MAX_ROWS:
            return cpu_kernels.small_linear(self.kernels, x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The batch-invariant mode's one kernel for this layer, whatever ``x``'s row count."""
        if self.quant is not None:
            if self.amx:
                return self.quant.linear_amx(self.kernels, x, self.bias)
            return self.quant.linear_tiled(self.kernels, x, self.bias)
        if self.panels is None or self.kernels is None:  # both set in this mode (__init__, repack)
            raise RuntimeError("a batch-invariant float layer without its panels")
        return cpu_kernels.panel_linear(self.kernels, x, self.panels, self.weight.shape[0], self.bias)


def pack_linears(
    model: nn.Module,
    kernels=None,
    quantized: dict[str, QuantWeight] | None = None,
    amx: bool = False,
    batch_invariant: bool = False,
) -> int:
    """Replace every float32 (and, where oneDNN has bf16 GEMMs, bfloat16) CPU ``nn.Linear`` of
    ``model`` by a ``PackedLinear``; the count.

    A model whose ``lm_head`` is None ties it to ``embed_tokens`` (see models/llama.py); it gets
    a packed head over the embedding weight, so call this only after the weights are loaded.
    ``quantized`` maps weight names (``layers.0.mlp.gate_up_proj.weight``) to their blocks; a
    block set that does not de-quantize to the loaded weight is dropped with a warning. ``amx``:
    layers with blocks run steps from ``cpu_kernels.amx_min_rows`` rows on AMX tiles, where
    ``cpu_kernels.amx_available``. ``batch_invariant``: every layer runs one kernel for every
    row count (module docstring).
    """
    if not batch_invariant and not onednn_packing_available():
        logger.info("oneDNN weight packing is not available; linear layers use F.linear")
        return 0
    quantized = quantized or {}

    def quant_for(name: str, weight: torch.Tensor) -> QuantWeight | None:
        quant = quantized.get(name)
        if quant is not None and not quant.matches(weight):
            logger.warning("the quantized blocks of %s do not match its weights; not used", name)
            return None
        return quant

    dtypes = {torch.float32} | ({torch.bfloat16} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set())
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding):
        weight = embed.weight
        if weight.device.type == "cpu" and weight.dtype in dtypes:
            quant = quant_for("embed_tokens.weight", weight)
            model.lm_head = PackedLinear(weight, None, kernels, quant, amx, batch_invariant)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in dtypes
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quant = quant_for(f"{name}.weight", module.weight)
        setattr(parent, attr, PackedLinear(module.weight, module.bias, kernels, quant, amx, batch_invariant))
    return len(targets)
