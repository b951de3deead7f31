"""The decode step's kernels alone, with the alternatives each could run as (one device call).

    python benchmarks/gpu_decode_kernels.py [--attention-only]
    python benchmarks/gpu_decode_kernels.py --batch 256   # one batch's attention variants

On the Llama-3.1-8B shapes at batch 64 and 256 (and at the 8,192 and 8,191 rows of a prefill
step): each linear layer through cuBLAS, cuBLASLt and
PyTorch's TunableOp (which times every algorithm the BLAS library offers for the shape and keeps
the fastest), and the decode attention kernel at mean context 640 under several launch
settings. Every time is the median of CUDA-graph replays, as a decode step runs them; GB/s
counts the weight (or K/V) bytes a kernel must read.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_micro import graph_timed, log  # noqa: E402
from pdinfer.layers.attention import triton_paged as tp  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def linear_variants(batch: int, tflops: bool = False) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        times = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            times[lib] = graph_timed(lambda w=w, x=x: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            F.linear(x, w)  # tunes this shape
            torch.cuda.synchronize()
            times["tunableop"] = graph_timed(lambda w=w, x=x: F.linear(x, w))
        except Exception as e:  # noqa: BLE001 - not offered on this build: a result too
            log(f"  tunableop: {type(e).__name__}: {str(e)[:100]}")
        finally:
            torch.cuda.tunable.enable(False)
        if tflops:
            cells = ", ".join(
                f"{lib} {t * 1e6:7.1f} us ({2 * batch * n * k / t / 1e12:.0f} TFLOP/s)" for lib, t in times.items()
            )
        else:
            cells = ", ".join(f"{lib} {t * 1e6:6.1f} us ({2 * n * k / t / 1e12:.2f} TB/s)" for lib, t in times.items())
        log(f"  B={batch} {name:8s} {cells}")
        for lib, t in times.items():
            totals[lib] = totals.get(lib, 0.0) + t
    return totals


def attention_variants(batch: int, ctx: int = 640) -> None:
    kvh, heads, dim, bs = 8, 32, 128, 16
    per = -(-ctx // bs)
    kv = torch.randn(batch * per, 1, 2, bs, kvh, dim, device="cuda", dtype=torch.bfloat16)
    layer = kv[:, 0]
    tables = torch.randperm(batch * per, device="cuda").view(batch, per)
    lens = torch.full((batch,), ctx, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = batch * ctx * kvh * dim * 2 * 2
    splits = tp.decode_num_splits(batch, kvh, None)
    saved = dict(tp.DECODE_CONFIG)
    for cfg in (
        {},
        {"block_n": 32},
        {"block_n": 128},
        {"num_stages": 3},
        {"num_stages": 4},
        {"block_n": 128, "num_stages": 3},
        {"num_warps": 8, "block_n": 128, "num_stages": 3},
        {"num_warps": 2},
    ):
        tp.DECODE_CONFIG.update(cfg)
        try:
            t = graph_timed(lambda: tp.decode_attention(q, layer, tables, lens, dim**-0.5, splits))
            log(f"  attention B={batch} {tp.DECODE_CONFIG}: {t * 1e6:6.1f} us ({kv_bytes / t / 1e12:.2f} TB/s)")
        except Exception as e:  # noqa: BLE001
            log(f"  attention B={batch} {cfg}: FAIL {type(e).__name__}: {str(e)[:100]}")
        tp.DECODE_CONFIG.clear()
        tp.DECODE_CONFIG.update(saved)
    # more splits: more, shorter programs (a smaller last wave) for the merge kernel's cost
    for more in (2 * splits, 4 * splits):
        t = graph_timed(lambda more=more: tp.decode_attention(q, layer, tables, lens, dim**-0.5, more))
        log(
            f"  attention B={batch} {more} splits (default {splits}): {t * 1e6:6.1f} us ({kv_bytes / t / 1e12:.2f} TB/s)"
        )


def main() -> None:
    if "--batch" in sys.argv:  # one batch's attention variants, in a process of its own
        attention_variants(int(sys.argv[sys.argv.index("--batch") + 1]))
        return
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    # First (an error TunableOp leaves behind would fail every later launch), each batch in a
    # process of its own. Batch 256 after batch 64 in one process once met an illegal memory
    # access: the timer did not wait for the inputs (``gpu_micro.graph_timed``, fixed since).
    for batch in (64, 256):
        subprocess.run([sys.executable, __file__, "--batch", str(batch)], check=False)
    if "--attention-only" in sys.argv:
        return
    for rows in (8192, 8191):  # a 4 x 2048 and a 1 x 8191 prefill step
        totals = linear_variants(rows, tflops=True)
        log(f"  M={rows} one layer's linears: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in totals.items()))
    for batch in (64, 256):
        totals = linear_variants(batch)
        log(f"  B={batch} one layer's linears: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in totals.items()))


if __name__ == "__main__":
    main()
