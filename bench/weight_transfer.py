"""The weight path between hosts, side by side with a plain copy on one filesystem.

    .venv/bin/python bench/weight_transfer.py [--mb 64 256] [--repeats 3]

For a sealed version of S MB (random fp32 tensors, safetensors + manifest):
  http   `HttpFetch.fetch`: download from a real trainer endpoint on loopback into a temporary folder,
         verify every size and sha256, rename (what a server on another host does per version)
  copy   `shutil.copytree` of the same folder + the same verification (what a shared filesystem
         would cost at best)
  verify the sha256 verification alone
Loopback has no wire limit, so this measures prl's own overhead; on real hosts the NIC bounds http.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prl.model.weights import verify_dir, write_weights
from prl.transport.endpoint import TrainerEndpoint
from prl.transport.weights import HttpFetch


def best(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_size(root: Path, mb: int, repeats: int) -> dict[str, float]:
    trainer = root / f"trainer{mb}"
    n = mb * 2**20 // 4 // 4096
    write_weights(trainer / "weights" / "v1", {f"w{i}": torch.randn(n // 8, 4096) for i in range(8)}, {"version": 1})
    ep = TrainerEndpoint(trainer, "bench", "127.0.0.1", 0).start()
    dest = root / f"server{mb}" / "weights"
    try:
        def http():
            shutil.rmtree(dest, ignore_errors=True)
            HttpFetch(f"http://127.0.0.1:{ep.port}", "bench", dest).fetch(1)

        def copy():
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(trainer / "weights" / "v1", dest / "v1")
            verify_dir(dest / "v1")

        out = {"http": best(http, repeats), "copy": best(copy, repeats),
               "verify": best(lambda: verify_dir(trainer / "weights" / "v1"), repeats)}
    finally:
        ep.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    line = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.mb:
            t = one_size(Path(tmp), mb, args.repeats)
            line.update({f"http_MBps_{mb}MB": round(mb / t["http"]), f"http_over_copy_{mb}MB": round(t["http"] / t["copy"], 2)})
            print(f"{mb:5d} MB: http {t['http']:.3f}s ({mb / t['http']:6.0f} MB/s)   copy+verify {t['copy']:.3f}s "
                  f"({mb / t['copy']:6.0f} MB/s)   verify alone {t['verify']:.3f}s   http/copy "
                  f"{t['http'] / t['copy']:.2f}x", flush=True)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
