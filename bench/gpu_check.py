"""The checks only a GPU can answer, in one script (`bin/gpu-check`) that also runs on a CPU, where it
checks the reference paths, so it cannot rot between GPU sessions.

1. FP8 GEMMs: every GPU backend prl can pick (`torch._scaled_mm` with block scales; DeepGEMM when it
   is importable) against the exact CPU reference on the same quantised operands, for the three GEMMs
   of a training step (forward, dgrad with the 128x128 weight blocks transposed, wgrad with 1x128
   tiles along tokens), with TFLOP/s beside bf16 matmul. On a CPU: the reference against float64.
2. Collectives of the EP and CP code paths with 2 ranks: `all_to_all_single` with uneven splits
   (expert dispatch) and a differentiable all-gather (the CP exchange; its backward is a
   reduce-scatter), NCCL on a GPU (2 ranks on one GPU where NCCL allows it, else said), gloo on a CPU.
3. R3: `bench/r3_mismatch.py` on the device (`--device cuda`: the engine's and trainer's GPU kernels).

    bin/gpu-check [--quick] [--out results.json]

Exit status 1 if any check failed; every figure is printed and written as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from fp8_gemm import timed  # bench/ is this script's directory
from prl.model.fp8 import BACKENDS, Quantized, dequantize, quantize_blocks, quantize_tiles

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 2e-2  # relative Frobenius error vs the reference: wrong tilings show ~4e-2 and more


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm().clamp_min(1e-30))


def to_cpu(q: Quantized) -> Quantized:
    return Quantized(q.q.cpu(), q.scale.cpu(), q.tile)


def step_gemms(m: int, n: int, k: int, dev: str) -> dict[str, tuple[Quantized, Quantized]]:
    """The operands of a linear layer's forward, dgrad and wgrad, quantised as Fp8LinearFn does."""
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev) * 0.02
    g = torch.randn(m, n, device=dev) * 1e-3
    qw = quantize_blocks(w)
    return {"fprop": (quantize_tiles(x), qw), "dgrad": (quantize_tiles(g), qw.t()),
            "wgrad": (quantize_tiles(g.t()), quantize_tiles(x.t()))}


def fp8_section(quick: bool) -> dict:
    gpu = torch.cuda.is_available()
    shapes = [(256, 384, 512)] if quick or not gpu else [(256, 384, 512), (4096, 4096, 6144), (4096, 6144, 2048)]
    out = {}
    for m, n, k in shapes:
        for gemm, (a, b) in step_gemms(m, n, k, "cuda" if gpu else "cpu").items():
            ref = BACKENDS["reference"](to_cpu(a), to_cpu(b), torch.float32)
            row = {}
            if gpu:
                for name in ("scaled_mm", "deep_gemm"):
                    row[name] = gpu_backend(name, a, b, ref, quick)
                bf16_a, bf16_b = dequantize(a).bfloat16(), dequantize(b).bfloat16()
                s = timed(lambda: bf16_a @ bf16_b.t(), 3 if quick else 20)
                row["bf16_tflops"] = 2 * a.q.shape[0] * b.q.shape[0] * a.q.shape[1] / s / 1e12
            else:  # the reference itself, against float64 on the dequantised operands
                exact = dequantize(a).double() @ dequantize(b).double().t()
                row["reference_vs_float64"] = {"rel_err": rel_err(ref, exact), "ok": rel_err(ref, exact) < 1e-5}
            out[f"{gemm} M={m} N={n} K={k}"] = row
    return out


def gpu_backend(name: str, a: Quantized, b: Quantized, ref: torch.Tensor, quick: bool) -> dict:  # pragma: no cover - gpu
    try:
        fn = BACKENDS[name]
        got = fn(a, b, torch.float32)
        s = timed(lambda: fn(a, b, torch.bfloat16), 3 if quick else 20)
        err = rel_err(got, ref)
        return {"rel_err": err, "ok": err < TOLERANCE, "tflops": 2 * a.q.shape[0] * b.q.shape[0] * a.q.shape[1] / s / 1e12}
    except Exception as e:  # noqa: BLE001 - an unavailable backend is a finding, not a crash
        return {"unavailable": f"{type(e).__name__}: {str(e)[:200]}"}


def collectives_worker(rank: int, world: int, backend: str, port: int, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    checks = {}
    # EP dispatch: rank r sends (r + 1) * (d + 1) rows to rank d, every row tagged with (sender, receiver)
    send = [(rank + 1) * (d + 1) for d in range(world)]
    recv = [(s + 1) * (rank + 1) for s in range(world)]
    rows = torch.cat([torch.tensor([[rank, d]] * c, dtype=torch.float32) for d, c in enumerate(send)]).to(dev)
    got = torch.empty(sum(recv), 2, device=dev)
    dist.all_to_all_single(got, rows, output_split_sizes=recv, input_split_sizes=send)
    want = torch.cat([torch.tensor([[s, rank]] * c, dtype=torch.float32) for s, c in enumerate(recv)]).to(dev)
    checks["all_to_all_uneven"] = bool(torch.equal(got, want))
    # CP exchange: all-gather of each rank's KV slice; the gradient comes back to the owner summed
    kv = torch.full((3, 4), float(rank + 1), device=dev, requires_grad=True)
    gathered = torch.cat(dnn.all_gather(kv))
    checks["all_gather_values"] = bool(torch.equal(gathered.detach()[:, 0].cpu(),
                                                   torch.repeat_interleave(torch.arange(1.0, world + 1), 3)))
    (gathered * (torch.arange(gathered.shape[0], device=dev)[:, None] + 1.0)).sum().backward()
    rows_of_mine = torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32) + 1.0
    checks["all_gather_backward"] = bool(torch.allclose(kv.grad[:, 0].cpu(), world * rows_of_mine))
    if rank == 0:
        Path(result).write_text(json.dumps({"backend": backend, "device": str(dev), **checks}))
    dist.destroy_process_group()


def collectives_section() -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from prl.recipe.resolve import free_port

    tried = ["nccl", "gloo"] if torch.cuda.is_available() else ["gloo"]
    out = {}
    for backend in tried:
        result = tempfile.mktemp(suffix=".json")
        try:
            mp.start_processes(collectives_worker, args=(2, backend, free_port("127.0.0.1"), result), nprocs=2,
                               start_method="spawn")
            r = json.loads(Path(result).read_text())
            r["ok"] = all(v for k, v in r.items() if k.startswith("all_"))
            out[backend] = r
        except Exception as e:  # noqa: BLE001 - e.g. NCCL refusing two ranks on one GPU: reported
            out[backend] = {"unavailable": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def r3_section(quick: bool) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = ["--device", dev] + (["--layers", "2", "--experts", "8", "--top-k", "2", "--prompts", "4", "--group", "2",
                                 "--warm-steps", "5"] if quick else [])
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "r3_mismatch.py"), *args], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode:
        return {"ok": False, "error": (p.stdout + p.stderr)[-1500:]}
    report = json.loads(p.stdout.strip().splitlines()[-1])
    keep = ("model", "mismatch_kl_no_replay", "mismatch_kl_replay", "ratio", "routing_agreement")
    return {"ok": True, "device": dev, **{k: report[k] for k in keep}}


def failed(results: dict) -> list[str]:
    bad = []

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            if node.get("ok") is False:
                bad.append(prefix)
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)

    walk("", results)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes and a small R3 run (the CPU test uses it)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU present)"
    results = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__}
    for name, section in (("fp8", lambda: fp8_section(args.quick)), ("collectives", collectives_section),
                          ("r3", lambda: r3_section(args.quick))):
        try:
            results[name] = section()
        except Exception:  # noqa: BLE001 - one broken section must not hide the others
            results[name] = {"ok": False, "error": traceback.format_exc()[-1500:]}
        print(f"## {name}\n{json.dumps(results[name], indent=1)}", flush=True)
    bad = failed(results)
    results["failed"] = bad
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"gpu-check on {device}: {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
