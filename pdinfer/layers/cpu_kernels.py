"""Small native CPU kernels (float32 arithmetic), each with a plain-torch fallback.

The attention kernels also read a bfloat16 KV cache (a bfloat16 model's), widening each value
to float32 exactly as they load it; everything else here takes float32 tensors only.

- ``pd_write_kv``: the new tokens' K/V into the cache, one call instead of two ``index_copy_``.
- ``pd_paged_decode``: decode attention straight from the paged KV blocks. Plain torch must
  first gather each sequence's blocks into a padded buffer (a write and a second read of the
  whole context, every layer); this reads K and V once. A lone long sequence is cut into
  context chunks across threads (each chunk's softmax alone, merged after).
- ``pd_prefill_attention``: causal prefill attention of a whole step (every sequence, with or
  without a cached prefix) through the block tables, on the same FMA register tile as the
  quantized GEMM (Q K^T, exact softmax, P V): faster than torch's CPU SDPA, which the engine
  would call once per sequence, on prompts of a few hundred tokens.
- ``pd_small_gemm``: a decode step of a few sequences is a matrix-vector product per weight,
  bound by how fast the weights stream from memory; eight weight rows at a time, with the few
  input rows in L1, it streams them faster than oneDNN/MKL do.
- ``pd_quant_gemm``: the same for a GGUF model's Q4_0/Q4_1/Q8_0 blocks, de-quantized in
  registers (bit-identical weights, a fifth to a quarter of the bytes), so a batch-1 decode
  step reads that much less memory than the float path. ``pd_quant_gemm_tiled``, for more rows
  (large decode batches), reads a copy of the blocks laid out by tiles of 32 weight rows and
  de-quantizes 256 input positions of a tile at a time into an L1 panel for an FMA register
  kernel (8 x 32 with AVX-512, 6 x 16 with AVX2).
- ``pd_amx_quant_gemm``: the same blocks for steps of 32 rows or more on AMX tiles, where
  the CPU has them: each input value split into three bfloat16 parts, the quants exact in
  bfloat16, float32 sums, so the result keeps float32 accuracy (``amx_gemm.cpp``).
- ``pd_gemm_panels``: the batch-invariant mode's float GEMM (``cpu_linear``), the tiled GEMM's
  register tile over a copy of the weights packed in panels of 32 rows: each output is one
  in-order chain of FMAs whatever the number of rows, where oneDNN and the small GEMM pick
  their blocking (and rounding) by the row count.
- ``pd_rms_norm``, ``pd_rotary_qk``, ``pd_silu_and_mul``: one pass each instead of 3-8 small
  torch ops (``FusedOps``, the CPU twin of ``triton_ops``); they matter at small batches, where
  per-op overhead rivals the arithmetic.
- ``pd_decode_stack``: all of the above for every decoder layer of a decode step, in one call
  (``cpu_decode_stack``).

~1,300 lines of C++ in ``csrc/`` (one file per concern: decode and prefill attention, the
quantized GEMMs, the AMX GEMM, the decoder stack, the rest; AVX-512 or AVX2 through one small wrapper,
``simd.h``, and one FMA register tile, ``tile.h``; plain loops otherwise; ``-march=native``
picks), compiled with
the system ``g++`` against ATen's threading header only (``at::parallel_for`` shares torch's
OpenMP pool), in a few seconds, once per machine: the library is cached under
``PDINFER_CACHE_DIR`` keyed by source, flags, torch version and CPU flags, and loaded with
``ctypes``. Without a compiler, or when building or loading fails, ``load()`` returns None and
callers use plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("pdinfer")

# The C++ sources, compiled together into one library, and the headers they share.
_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_kernels.cpp",
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "quant_gemm.cpp",
        "amx_gemm.cpp",
        "decode_stack.cpp",
    )
]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("simd.h", "tile.h", "parallel.h", "kernel_common.h")]

# Compiled with fast math, linked without it: g++ links crtfastmath.o into a library linked with
# -ffast-math, and loading that switches on flush-to-zero for the whole process (every thread's
# denormals, the user's own numpy and torch code included).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-std=c++17", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_ops: dict[str, FusedOps] = {}


def load(cache_dir: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use, then cached), or None."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = lib = build(cache_dir)
            if lib is not None:
                _ops["ops"] = FusedOps(lib)
        return _loaded["lib"]


def fused_ops() -> FusedOps | None:
    """The fused elementwise ops once ``load()`` has built the library (a CPU model runner does)."""
    return _ops.get("ops")


def build(cache_dir: str | None = None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library compiled (or found cached) and loaded, or None. ``load()`` keeps one for the
    process; a call with ``extra_flags`` (e.g. ``-mno-avx512f`` for the AVX2 code on an AVX-512
    machine) gives a separate copy and leaves that one alone."""
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    torch_dir = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    compile_flags = [*_FLAGS, *extra_flags, f"-I{torch_dir / 'include'}", abi]
    link_flags = [*_LINK_FLAGS, f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    texts = [src.read_text() for src in _SOURCES + _HEADERS]
    parts = [*texts, *compile_flags, "link", *link_flags, torch.__version__, _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    root = Path(cache_dir or os.path.expanduser("~/.cache/pdinfer")) / "kernels"
    path = root / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            _compile(path, compile_flags, link_flags)
        lib = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        for name, argtypes in [
            ("pd_paged_decode", [ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, f32, i64, i64]),
            (
                "pd_prefill_attention",
                [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i64],
            ),
            ("pd_write_kv", [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]),
            ("pd_small_gemm", [ptr, ptr, ptr, ptr, i64, i64, i64]),
            ("pd_gemm_panels", [ptr, ptr, ptr, ptr, i64, i64, i64]),
            ("pd_quant_gemm", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]),
            ("pd_quant_gemm_tiled", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]),
            ("pd_amx_quant_gemm", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]),
            ("pd_rms_norm", [ptr, i64, ptr, ptr, i64, i64, f32]),
            ("pd_rotary_qk", [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64]),
            ("pd_silu_and_mul", [ptr, i64, ptr, i64, i64]),
            ("pd_decode_stack", [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64]),
        ]:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.pd_quant_stream_rows.argtypes, lib.pd_quant_stream_rows.restype = [], i64
        lib.pd_amx_enable.argtypes, lib.pd_amx_enable.restype = [], ctypes.c_int
        lib.pd_amx_min_rows.argtypes, lib.pd_amx_min_rows.restype = [], i64
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable (%s); using plain torch", exc)
        return None
    return lib


def _compile(path: Path, compile_flags: list[str], link_flags: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "compiling the native CPU kernels into %s (once for this CPU, torch and kernel source; ~10-30 s)", path.parent
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in _SOURCES]
        jobs = [
            subprocess.Popen(["g++", *compile_flags, "-c", str(src), "-o", str(obj)], stderr=subprocess.PIPE)
            for src, obj in zip(_SOURCES, objects)
        ]
        errors = [job.communicate(timeout=300)[1] for job in jobs]
        for job, err in zip(jobs, errors):
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=err)
        out = Path(tmp) / "cpu_kernels.so"
        subprocess.run(
            ["g++", *map(str, objects), "-o", str(out), *link_flags], check=True, capture_output=True, timeout=120
        )
        os.replace(out, path)  # atomic: concurrent engines never load a half-written file
    logger.info("compiled the native CPU kernels in %.1f s", time.perf_counter() - start)


@functools.cache
def quant_stream_rows(lib: ctypes.CDLL) -> int:
    """Input rows up to which this build's row-streaming quantized GEMM (``pd_quant_gemm``)
    beats its tiled one (``pd_quant_gemm_tiled``): 4 with AVX-512, 8 with AVX2."""
    return int(lib.pd_quant_stream_rows())


@functools.cache
def amx_available(lib: ctypes.CDLL) -> bool:
    """Whether this build has the AMX GEMM (``pd_amx_quant_gemm``: compiled on a CPU with AMX
    and AVX512-BF16) and Linux lets this process use the tiles."""
    return bool(lib.pd_amx_enable())


@functools.cache
def amx_min_rows(lib: ctypes.CDLL) -> int:
    """Input rows from which ``pd_amx_quant_gemm`` beats the tiled quantized GEMM."""
    return int(lib.pd_amx_min_rows())


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), e.g. ``{"avx2", "avx512f", ...}``."""
    return set(_cpu_id().split())


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


# The KV cache dtypes the attention kernels read (their arithmetic is float32 either way).
KV_DTYPES = (torch.float32, torch.bfloat16)


def _kv_bf16(layer_cache: torch.Tensor) -> int:
    if layer_cache.dtype not in KV_DTYPES:
        raise ValueError(f"the native attention kernels read float32 or bfloat16 KV caches, not {layer_cache.dtype}")
    return int(layer_cache.dtype == torch.bfloat16)


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    strides: torch.Tensor,
    scale: float,
    split_context: bool = True,
) -> torch.Tensor:
    """q [B, H, D] (rows may be strided) -> out [B, H, D] in q's dtype; ``strides`` from
    ``kv_strides``. A bfloat16 q is widened to float32 for the kernel, and its output rounded
    back. ``split_context=False`` (the batch-invariant mode) never cuts a long context into
    chunks across threads: how it would be cut depends on the batch size."""
    batch, heads, dim = q.shape
    kv_heads, kv_bf16 = layer_cache.shape[3], _kv_bf16(layer_cache)
    q32, out = _float32_io(q)
    lib.pd_paged_decode(
        layer_cache.data_ptr(),
        q32.data_ptr(),
        out.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        batch,
        block_tables.shape[1],
        strides.data_ptr(),
        kv_heads,
        heads // kv_heads,
        dim,
        q32.stride(0),
        scale,
        kv_bf16,
        int(split_context),
    )
    return out.to(q.dtype)


def write_kv(
    lib: ctypes.CDLL, layer_cache: torch.Tensor, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``torch_paged``'s two ``index_copy_`` of the new tokens' K/V [T, KVH, D] (rows may be
    strided) into the layer's cache, in one native call (K/V cast to the cache's dtype first)."""
    _kv_bf16(layer_cache)
    row = k.shape[1] * k.shape[2]
    k, v = _head_rows(k.to(layer_cache.dtype)), _head_rows(v.to(layer_cache.dtype))
    lib.pd_write_kv(
        layer_cache.data_ptr(),
        slot_rows.data_ptr(),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k.shape[0],
        row,
        layer_cache.shape[2],
        layer_cache.element_size(),
    )


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    strides: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a prefill step's queries q [T, H, D] (rows may be strided) over each
    sequence's context in the cache, its new K/V already written -> out [T, H, D] in q's dtype
    (float32 arithmetic, as ``paged_decode``)."""
    _, heads, dim = q.shape
    kv_heads, kv_bf16 = layer_cache.shape[3], _kv_bf16(layer_cache)
    q32, out = _float32_io(q)
    lib.pd_prefill_attention(
        layer_cache.data_ptr(),
        strides.data_ptr(),
        q32.data_ptr(),
        q32.stride(0),
        out.data_ptr(),
        out.stride(0),
        block_tables.data_ptr(),
        query_starts.data_ptr(),
        query_lens.data_ptr(),
        context_lens.data_ptr(),
        len(query_lens),
        block_tables.shape[1],
        heads,
        kv_heads,
        dim,
        scale,
        kv_bf16,
    )
    return out.to(q.dtype)


def _float32_io(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernels' float32 queries (head rows, as ``_head_rows``) and a float32 output
    of q's shape; the callers round the output back to q's dtype."""
    return _head_rows(q.float()), torch.empty(q.shape, dtype=torch.float32, device=q.device)


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] with each token's heads side by side (any token stride), as the
    kernels read it: a view when it already is, else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def kv_strides(layer_cache: torch.Tensor) -> torch.Tensor:
    """[block, k->v, token, head, block_size] of a ``[blocks, 2, block_size, KVH, D]`` view."""
    s = layer_cache.stride()
    if s[4] != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    return torch.tensor([s[0], s[1], s[2], s[3], layer_cache.shape[2]], dtype=torch.int64)


def small_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a few float32 rows; ``weight`` [N, K] must be contiguous."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    lib.pd_small_gemm(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
    )
    return out


# Weight rows per panel of ``pd_gemm_panels``' layout (``pack_panels``).
PANEL_ROWS = 32


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] in ``pd_gemm_panels``' layout: [ceil(N / 32), K, 32], weight rows
    side by side by panels of 32 (the last padded with zero rows)."""
    n, k = weight.shape
    pad = -n % PANEL_ROWS
    w = torch.cat([weight.detach().float(), weight.new_zeros(pad, k, dtype=torch.float32)])
    return w.reshape(-1, PANEL_ROWS, k).transpose(1, 2).contiguous()


def panel_linear(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` for float32 rows over ``pack_panels(weight)`` (``n``: the weight's rows):
    the batch-invariant float GEMM, each output one in-order chain of FMAs over K whatever the
    number of rows."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    lib.pd_gemm_panels(
        x.data_ptr(),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n,
        x.shape[1],
    )
    return out


class FusedOps:
    """The CPU twins of ``triton_ops``' fused RMSNorm, rotary and SiLU-and-mul (float32)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape, dtype=x.dtype)
        self.lib.pd_rms_norm(
            x2.data_ptr(), x2.stride(0), weight.data_ptr(), out.data_ptr(), x2.shape[0], x2.shape[1], eps
        )
        return out.view(x.shape)

    def rotary_qk_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate q [T, H, D] and k [T, KVH, D] in place (they may be strided views); (q, k)."""
        if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rotary_qk_ needs unit stride in the last dim and matching cos/sin")
        self.lib.pd_rotary_qk(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            q.shape[1],
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            k.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            q.shape[0],
            cos.shape[-1],
        )
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dim."""
        n = x.shape[-1] // 2
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], n), dtype=x.dtype)
        self.lib.pd_silu_and_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], n)
        return out.view(*x.shape[:-1], n)
