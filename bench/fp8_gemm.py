"""Block-scaled FP8 GEMM against bf16 matmul at GLM-5 expert shapes (hidden 6144, expert dim 2048).

On a GPU: TFLOP/s of torch bf16 matmul and of prl's FP8 path (DeepGEMM, else torch._scaled_mm with
block-wise scales), the quantisation of the activations included, side by side in one process.
On a CPU: only the cost of the exact reference (dequantise, then fp32 matmul), and a note that no
GPU was present: the reference exists to be right, not fast.

    .venv/bin/python bench/fp8_gemm.py [--tokens 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prl.model.fp8 import backend, gemm_nt, quantize_blocks, quantize_tiles

SHAPES = {"up (gate+up)": (2 * 2048, 6144), "down": (6144, 2048)}  # (N, K) of one GLM-5 expert


def timed(fn, repeats: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    m = args.tokens if gpu else min(args.tokens, 256)
    print(f"device: {torch.cuda.get_device_name() if gpu else 'CPU (no GPU present)'}; FP8 backend: {backend()}; M={m}")
    line = {"device": torch.cuda.get_device_name() if gpu else "cpu", "m": m}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        qw = quantize_blocks(w)
        flops = 2 * m * n * k
        fp8_s = timed(lambda x=x, qw=qw: gemm_nt(quantize_tiles(x), qw, torch.bfloat16), args.repeats if gpu else 2)
        if gpu:
            bf16_s = timed(lambda x=x, w=w: x @ w.t(), args.repeats)
            print(f"{name:14s} N={n} K={k}: bf16 {flops / bf16_s / 1e12:7.1f} TFLOP/s   "
                  f"fp8 {flops / fp8_s / 1e12:7.1f} TFLOP/s   ratio {bf16_s / fp8_s:.2f}x")
            line[f"{name}_fp8_over_bf16"] = round(bf16_s / fp8_s, 3)
        else:
            print(f"{name:14s} N={n} K={k}: reference {fp8_s * 1e3:8.1f} ms ({flops / fp8_s / 1e9:.1f} GFLOP/s); "
                  f"no GPU present, no TFLOP/s to report")
            line[f"{name}_reference_ms"] = round(fp8_s * 1e3, 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
