"""The AMX GEMM (``pd_amx_quant_gemm``) against oneDNN's float32 GEMM on one layer of the
default model: its four matrices (fused q/k/v, o, fused gate/up, down) from the GGUF blocks, at
decode-sized and prefill-sized row counts, the two alternating so that both see the machine's
same phase. Prints a table; the ratio is what to compare between sittings.

    python benchmarks/amx_gemm.py [--rows 64 1024 8192] [--rounds 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from pdinfer import env
from pdinfer.layers import cpu_kernels
from pdinfer.models.loader import default_model_path, load_quantized_blocks, resolve_model


def layer_weights(layer: int) -> list:
    """The QuantWeights of one layer of the default model, fused as the engine fuses them."""
    folder, _ = resolve_model(str(default_model_path()), env.get("PDINFER_CACHE_DIR"))
    blocks = load_quantized_blocks(folder)
    prefix = f"layers.{layer}."
    names = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    return [blocks[prefix + name + ".weight"] for name in names]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(lib, weights: list, floats: list[torch.Tensor], rows: int, rounds: int) -> str:
    """One table row: the layer's four GEMMs at ``rows`` rows, AMX and oneDNN alternating."""
    inputs = [torch.randn(rows, q.k) for q in weights]
    flops = sum(2 * rows * q.n * q.k for q in weights)

    def amx():
        return [q.linear_amx(lib, xi, None) for q, xi in zip(weights, inputs)]

    def onednn():
        return [F.linear(xi, w) for w, xi in zip(floats, inputs)]

    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(amx(), onednn()))
    amx_s, dnn_s = [], []
    for _ in range(rounds):
        amx_s.append(timed(amx))
        dnn_s.append(timed(onednn))
    a, d = statistics.median(amx_s), statistics.median(dnn_s)
    return (
        f"| {rows} | {a * 1e3:.2f} | {d * 1e3:.2f} | {flops / a / 1e9:.0f} | {flops / d / 1e9:.0f} "
        f"| {d / a:.2f} | {diff:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layer", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.load()
    if lib is None or not cpu_kernels.amx_available(lib):
        sys.exit("no AMX here (or the kernel library did not build): nothing to compare")
    weights = layer_weights(args.layer)
    floats = [q.dequantize().contiguous() for q in weights]
    for q in weights:
        _ = q.amx_tiles  # built once, as at load
    print("| rows | AMX ms | oneDNN ms | AMX GFLOP/s | oneDNN GFLOP/s | AMX x | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        print(compare(lib, weights, floats, rows, args.rounds), flush=True)


if __name__ == "__main__":
    main()
