"""The checks only a GPU can answer, in one script (`bin/gpu-check`) that also runs on a CPU, where it
checks the reference paths, so it cannot rot between GPU sessions.

1. FP8 GEMMs: every GPU backend prl can pick (`torch._scaled_mm` with block scales; DeepGEMM) against
   the exact CPU reference on the same quantised operands, for the three GEMMs of a training step
   (forward, dgrad with the 128x128 weight blocks transposed, wgrad with 1x128 tiles along tokens),
   with TFLOP/s beside bf16 matmul. On a CPU: the reference against float64. And the FP8 expert
   dispatch's packing (quantise, pack bytes and scales, unpack) on the device against the CPU's.
2. Collectives of the EP and CP code paths with 2 ranks: `all_to_all_single` with uneven splits
   (expert dispatch) and a differentiable all-gather (the CP exchange; its backward is a
   reduce-scatter): NCCL with one GPU per rank (2 GPUs), and gloo.
3. The collective weight path (`prl.transport.collective.Wire`) between 2 processes: one version of
   bf16, fp32 and FP8 tensors arrives bit-equal, with GB/s; over NCCL (a GPU per rank, 2 GPUs) and
   gloo. `weights(..., die=True)` (the gpu test): the sender dies mid-version and the receive must raise
   within the group's timeout while the receiving process lives on.
4. R3: `bench/r3_mismatch.py` on the device (`--device cuda`: the engine's and trainer's GPU kernels).
5. The tests marked `gpu` (`pytest -m gpu`, tests/test_gpu.py): which ran, passed, failed or skipped
   and why. On a CPU every one of them must skip (saying why), so this also checks they still collect.

    bin/gpu-check [--quick] [--only fp8,collectives,weights,r3,gpu_tests] [--out results.json]

Every check ends in one of three results:
- a result (figures, and `ok`);
- `{"absent": why}`: its path is not present here (no CUDA device, a package not installed, fewer
  GPUs than the check needs, a device older than the kernels need). Listed, never a failure;
- `{"ok": False, "error": traceback}`: the path is present and raised (or gave wrong numbers). The
  run fails: exit status 1, each failure printed with its traceback.
Every figure is printed and written as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from fp8_gemm import timed  # bench/ is this script's directory
from prl.model.fp8 import BACKENDS, Quantized, backend, dequantize, quantize_blocks, quantize_tiles

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 2e-2  # relative Frobenius error vs the reference: wrong tilings show ~4e-2 and more
FP8_CAPABILITY = (9, 0)  # prl.model.fp8.backend() picks a GPU FP8 GEMM from Hopper on
ERROR_CHARS = 6000  # of a traceback kept in the results (the end: where it raised)


# ---------------------------------------------------------------- absent, failed or a result
class Absent(Exception):
    """The checked path is not present on this machine: recorded with the reason, not a failure."""


def require_cuda(gpus: int = 1, capability: tuple[int, int] | None = None) -> None:
    """Raise Absent unless this machine has `gpus` CUDA devices (of at least `capability`)."""
    if not torch.cuda.is_available():
        raise Absent("no CUDA device")
    n = torch.cuda.device_count()
    if n < gpus:
        raise Absent(f"needs {gpus} GPUs, {n} present")
    if capability and torch.cuda.get_device_capability() < capability:
        have = torch.cuda.get_device_capability()
        raise Absent(f"needs compute capability {capability[0]}.{capability[1]}, "
                     f"{torch.cuda.get_device_name()} is {have[0]}.{have[1]}")


def require_module(name: str) -> None:
    """Raise Absent unless the package is installed. An installed package whose import then fails is
    not absent: the check imports it and fails with the import's error."""
    if importlib.util.find_spec(name) is None:
        raise Absent(f"{name} is not installed")


def attempt(check, *args) -> dict:
    """Run one check: its result; `{"absent": why}` when it raised Absent; `{"ok": False, "error":
    traceback}` for anything else it raised (an ImportError included: presence is decided by
    `require_*` before the check touches the path, never guessed from an exception)."""
    try:
        return check(*args)
    except Absent as e:
        return {"absent": str(e)}
    except Exception:  # noqa: BLE001 - a present path that raised: a failure, with its traceback
        return {"ok": False, "error": traceback.format_exc()[-ERROR_CHARS:]}


def walk(results: dict):
    """(path, node) of every dict in the results, depth first."""
    stack = [("", results)]
    while stack:
        path, node = stack.pop()
        yield path, node
        for k, v in reversed(list(node.items())):
            if isinstance(v, dict):
                stack.append((f"{path}/{k}" if path else k, v))


def failed(results: dict) -> list[str]:
    """Paths of every check that failed (`ok` is False)."""
    return [path for path, node in walk(results) if node.get("ok") is False]


def absent(results: dict) -> dict[str, str]:
    """Path -> reason of every check whose path is not present here."""
    return {path: node["absent"] for path, node in walk(results) if isinstance(node.get("absent"), str)}


# ---------------------------------------------------------------- 1. FP8 GEMMs
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


def dispatch_rows(dev: str) -> dict:
    """The FP8 expert dispatch's packing (`prl.trainer.ep_dispatch.pack`/`unpack`: E4M3 bytes and 1x128
    scales in one byte row) on `dev` against the CPU's: the bytes that would travel, and the rows the
    experts would see. On a CPU it checks the packing against quantize_tiles -> dequantize."""
    from prl.model.fp8 import quantize_tiles
    from prl.trainer.ep_dispatch import pack, unpack

    rows = (torch.randn(300, 640, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    want = dequantize(quantize_tiles(rows)).bfloat16()
    buf = pack(rows.to(dev))
    got = unpack(buf, rows.shape[1], rows.dtype)
    same_bytes = float((buf.cpu() == pack(rows)).float().mean())
    err = rel_err(got, want)
    return {"device": dev, "bytes_equal_to_cpu": same_bytes, "rel_err_vs_cpu": err,
            "ok": same_bytes > 0.999 and err < 1e-3}


def fp8_section(quick: bool) -> dict:
    gpu = torch.cuda.is_available()
    shapes = [(256, 384, 512)] if quick or not gpu else [(256, 384, 512), (4096, 4096, 6144), (4096, 6144, 2048)]
    out: dict = {"prl_backend": backend(), "dispatch_packing": attempt(dispatch_rows, "cuda" if gpu else "cpu")}
    for m, n, k in shapes:
        for gemm, (a, b) in step_gemms(m, n, k, "cuda" if gpu else "cpu").items():
            ref = BACKENDS["reference"](to_cpu(a), to_cpu(b), torch.float32)
            row = {name: attempt(gpu_backend, name, a, b, ref, quick) for name in ("scaled_mm", "deep_gemm")}
            if gpu:
                bf16_a, bf16_b = dequantize(a).bfloat16(), dequantize(b).bfloat16()
                s = timed(lambda x=bf16_a, y=bf16_b: x @ y.t(), 3 if quick else 20)
                row["bf16_tflops"] = 2 * a.q.shape[0] * b.q.shape[0] * a.q.shape[1] / s / 1e12
            else:  # the reference itself, against float64 on the dequantised operands
                exact = dequantize(a).double() @ dequantize(b).double().t()
                row["reference_vs_float64"] = {"rel_err": rel_err(ref, exact), "ok": rel_err(ref, exact) < 1e-5}
            out[f"{gemm} M={m} N={n} K={k}"] = row
    return out


def gpu_backend(name: str, a: Quantized, b: Quantized, ref: torch.Tensor, quick: bool) -> dict:
    """One GPU FP8 GEMM backend against the reference. Absent without a Hopper-or-later device (prl
    does not pick one there) or, for DeepGEMM, without the package; on such a device, a backend that
    raises is a failure (prl would fall back to a slower GEMM without saying so)."""
    require_cuda(capability=FP8_CAPABILITY)
    if name == "deep_gemm":
        require_module("deep_gemm")
    fn = BACKENDS[name]
    got = fn(a, b, torch.float32)
    s = timed(lambda: fn(a, b, torch.bfloat16), 3 if quick else 20)
    err = rel_err(got, ref)
    return {"rel_err": err, "ok": err < TOLERANCE, "tflops": 2 * a.q.shape[0] * b.q.shape[0] * a.q.shape[1] / s / 1e12}


# ---------------------------------------------------------------- 2. EP / CP collectives
def collectives_worker(rank: int, world: int, backend: str, port: int, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
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


def collectives(backend: str) -> dict:
    """2 ranks of `backend`. NCCL needs a GPU per rank (it refuses two ranks on one GPU)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from prl.recipe.resolve import free_port

    if backend == "nccl":
        require_cuda(gpus=2)
        if not dist.is_nccl_available():
            raise Absent("this torch is built without NCCL")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        mp.start_processes(collectives_worker, args=(2, backend, free_port("127.0.0.1"), str(result)), nprocs=2,
                           start_method="spawn")
        r = json.loads(result.read_text())
    r["ok"] = all(v for k, v in r.items() if k.startswith("all_"))
    return r


def collectives_section() -> dict:
    return {name: attempt(collectives, name) for name in ("nccl", "gloo")}


# ---------------------------------------------------------------- 3. the collective weight path
def weight_version(mb: float, dev: str) -> dict[str, torch.Tensor]:
    """A version both ranks can build alike: bf16, fp32 and FP8 tensors (with a scale), ~`mb` MB."""
    g = torch.Generator().manual_seed(0)
    n = max(int(mb * 2**20 / 2 / 3 / 1024), 1)  # rows of 1024 bf16 in each third
    w = torch.randn(n, 1024, generator=g)
    return {"a.weight": w.bfloat16().to(dev), "b.weight": w[: n // 2].to(dev),
            "c.weight": w.clamp(-448, 448).to(torch.float8_e4m3fn).to(dev), "c.weight_scale_inv": torch.ones(n, 8).to(dev)}


def weights_worker(rank: int, backend: str, port: int, result: str, mb: float, die: bool) -> None:
    from prl.transport.collective import GroupInfo, Wire

    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                                       timeout=datetime.timedelta(seconds=60))
    wire = Wire(GroupInfo("127.0.0.1", port, 2, rank, 1, 20.0, backend), store)
    version = weight_version(mb, dev)
    if rank == 0:
        t0 = time.perf_counter()
        if die:  # the first bucket only, then gone mid-version
            wire.send_bucket({k: version[k] for k in list(version)[:2]})
            os._exit(0)
        n = wire.send_bucket(version)
        wire.send_end({"version": 1})
        Path(result + ".sender").write_text(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
        store.wait(["received"])  # the receiver may still read this process's buffers
        return
    expected = {k: (list(v.shape), v.numel() * 4) for k, v in version.items()}
    t0 = time.perf_counter()
    try:
        got, meta = wire.receive(expected)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        equal = all(torch.equal(got[k].view(torch.uint8), version[k].view(torch.uint8)) for k in version)
        row = {"equal": equal, "meta": meta, "device": str(next(iter(got.values())).device)}
    except Exception as e:  # noqa: BLE001 - what the die variant expects
        row = {"raised": f"{type(e).__name__}: {str(e)[:300]}"}
    Path(result).write_text(json.dumps({**row, "receive_s": time.perf_counter() - t0}))
    if not die:
        store.set("received", "1")


def weights(backend: str, mb: float = 64, die: bool = False) -> dict:
    """One version over a 2-rank weight group of `backend` (NCCL: a GPU per rank)."""
    import torch.multiprocessing as mp

    from prl.recipe.resolve import free_port

    if backend == "nccl":
        require_cuda(gpus=2)
        if not torch.distributed.is_nccl_available():
            raise Absent("this torch is built without NCCL")
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "result.json")
        ctx = mp.start_processes(weights_worker, args=(backend, free_port("127.0.0.1"), result, mb, die), nprocs=2,
                                 start_method="spawn", join=False)
        deadline = time.monotonic() + 300  # a hang (a group that never forms, a wait that never times out) fails
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise RuntimeError(f"the {backend} weight check hung for 300 s")
        r = json.loads(Path(result).read_text())
        if not die:
            sent = json.loads(Path(result + ".sender").read_text())
            r["gb_per_s"] = sent["bytes"] / max(r["receive_s"], 1e-9) / 1e9
    # dying: the receive fails on the group's error (reset connection, or NCCL's 20 s timeout), not on the protocol
    r["ok"] = "raised" in r and "WireError" not in r["raised"] if die else r.get("equal") is True
    return {"backend": backend, **r}


def weights_section(quick: bool) -> dict:
    return {name: attempt(weights, name, 8 if quick else 256) for name in ("nccl", "gloo")}


# ---------------------------------------------------------------- 4. R3
def r3_section(quick: bool) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = ["--device", dev] + (["--layers", "2", "--experts", "8", "--top-k", "2", "--prompts", "4", "--group", "2",
                                 "--warm-steps", "5"] if quick else [])
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "r3_mismatch.py"), *args], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode:
        return {"ok": False, "error": (p.stdout + p.stderr)[-ERROR_CHARS:]}
    report = json.loads(p.stdout.strip().splitlines()[-1])
    keep = ("model", "mismatch_kl_no_replay", "mismatch_kl_replay", "ratio", "routing_agreement")
    return {"ok": True, "device": dev, **{k: report[k] for k in keep}}


# ---------------------------------------------------------------- 5. the tests marked gpu
def junit_outcomes(xml: str) -> dict[str, dict]:
    """node id -> {"outcome": passed|failed|skipped, "reason"/"error"} from pytest's JUnit XML."""
    out = {}
    for case in ET.fromstring(xml).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}" if module else case.get("name", "?")
        row = {"outcome": "passed", "seconds": round(float(case.get("time") or 0), 1)}
        for child in case:
            if child.tag == "skipped":
                row = {**row, "outcome": "skipped", "reason": child.get("message", "")}
            elif child.tag in ("failure", "error"):
                text = f"{child.get('message', '')}\n{child.text or ''}".strip()
                row = {**row, "outcome": "failed" if child.tag == "failure" else "error", "error": text[-ERROR_CHARS:]}
        out[name] = row
    return out


def gpu_tests_section(timeout_s: float) -> dict:
    """`pytest -m gpu` over tests/: every test's outcome. On a CUDA machine each must pass or skip
    with a reason; on a CPU each must skip (a GPU test that does not skip there is broken)."""
    require_module("pytest")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "gpu-tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={xml}", str(ROOT / "tests")]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        tests = junit_outcomes(xml.read_text()) if xml.exists() else {}
    by = {o: [t for t, r in tests.items() if r["outcome"] == o] for o in ("passed", "failed", "error", "skipped")}
    out: dict = {"command": "pytest -m gpu tests/", "exit_status": p.returncode, "collected": len(tests),
                 "ran": by["passed"] + by["failed"] + by["error"], "passed": by["passed"],
                 "skipped": {t: tests[t]["reason"] for t in by["skipped"]}}
    for t in by["failed"] + by["error"]:
        out[t] = {"ok": False, "error": tests[t]["error"]}
    if not torch.cuda.is_available() and out["ran"]:
        out["ran_without_cuda"] = {"ok": False, "error": f"tests marked gpu ran on a CPU: {out['ran']}"}
    if p.returncode not in (0, 1) or not tests:  # 1: some test failed (listed above); else pytest itself broke
        out["pytest"] = {"ok": False, "error": (p.stdout + p.stderr)[-ERROR_CHARS:]}
    return out


# ---------------------------------------------------------------- the run
SECTIONS = {
    "fp8": lambda args: fp8_section(args.quick),
    "collectives": lambda args: collectives_section(),
    "weights": lambda args: weights_section(args.quick),
    "r3": lambda args: r3_section(args.quick),
    "gpu_tests": lambda args: attempt(gpu_tests_section, args.tests_timeout),
}


def report(results: dict) -> list[str]:
    """Print what was not present here and every failure with its traceback; the failed paths."""
    bad = failed(results)
    missing = absent(results)
    if missing:
        print("## not present here (not failures)")
        for path, why in missing.items():
            print(f"  {path}: {why}")
    tests = results.get("gpu_tests")
    if isinstance(tests, dict) and "ran" in tests:
        print(f"## tests marked gpu: {tests['collected']} collected, {len(tests['ran'])} ran, "
              f"{len(tests['passed'])} passed, {len(tests['skipped'])} skipped")
        for t in tests["ran"]:
            print(f"  {'PASSED' if t in tests['passed'] else 'FAILED'} {t}")
        for t, why in tests["skipped"].items():
            print(f"  SKIPPED {t}: {why}")
    nodes = dict(walk(results))
    for path in bad:
        print(f"## FAILED {path}\n{nodes[path].get('error') or json.dumps(nodes[path], indent=1)}")
    return bad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes and a small R3 run (the CPU test uses it)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    ap.add_argument("--tests-timeout", type=float, default=1800, help="seconds for `pytest -m gpu`")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU present)"
    results: dict = {"date": time.strftime("%Y-%m-%d"), "device": device, "gpus": torch.cuda.device_count(),
                     "torch": torch.__version__}
    for name in only:
        try:
            results[name] = SECTIONS[name](args)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others
            results[name] = {"ok": False, "error": traceback.format_exc()[-ERROR_CHARS:]}
        print(f"## {name}\n{json.dumps(results[name], indent=1)}", flush=True)
    bad = report(results)
    results["failed"], results["absent"] = bad, absent(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    n_absent = len(results["absent"])
    print(f"gpu-check on {device}: {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'}"
          f"{f' ({n_absent} not present here)' if n_absent else ''}")
    print(json.dumps({"device": device, "failed": bad, "not_present": n_absent, "sections": only}))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
