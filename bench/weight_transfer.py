"""The weight path between hosts, side by side with a plain copy on one filesystem.

    .venv/bin/python bench/weight_transfer.py [--mb 64 256] [--repeats 3]

For a sealed version of S MB (random fp32 tensors, safetensors + manifest):
  http   `HttpFetch.fetch`: download from a real trainer endpoint on loopback into a temporary folder,
         verify every size and sha256, rename (what a server on another host does per version)
  copy   `shutil.copytree` of the same folder + the same verification (what a shared filesystem
         would cost at best)
  verify the sha256 verification alone
  collective  the same tensors broadcast by `prl.transport.collective.Wire` over gloo to a receiver
         process that checks and stages them (what trainer.weight_transfer = "collective" sends
         beside the folder), timed until the receiver has the whole version
  stream the same tensors from 2 sender processes (trainer.weight_transfer = "stream": tensor i from
         sender i % 2, each on its own link) into one receiver reading both links at once
  raw    one in-memory copy of the same bytes (`torch.Tensor.clone`): the floor of any path
Loopback has no wire limit, so this measures prl's own overhead; on real hosts the NIC bounds http
and the collective alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
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
    tensors = {f"w{i}": torch.randn(n // 8, 4096) for i in range(8)}
    out["collective"] = collective(tensors, repeats)
    out["stream"] = stream(tensors, repeats, senders=2)
    out["raw"] = best(lambda: [t.clone() for t in tensors.values()], repeats)
    return out


RECEIVER = """
import sys, torch
from prl.transport.collective import GroupInfo, Wire
port, repeats, shape = int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
wire = Wire(GroupInfo("127.0.0.1", port, 2, 1, 1, 120.0))
expected = {f"w{i}": (shape, shape[0] * shape[1] * 4) for i in range(8)}
for _ in range(repeats):
    tensors, meta = wire.receive(expected)
    assert len(tensors) == 8 and all(torch.isfinite(t).all() for t in tensors.values())
    wire.links[0].pg.barrier().wait()
"""


def collective(tensors: dict[str, torch.Tensor], repeats: int) -> float:
    """Median seconds from the first bucket sent to the receiver holding the checked version."""
    import torch.distributed as dist

    from prl.transport.collective import GroupInfo, Wire

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    shape = ",".join(map(str, next(iter(tensors.values())).shape))
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, str(store.port), str(repeats), shape])
    wire = Wire(GroupInfo("127.0.0.1", store.port, 2, 0, 1, 120.0), store)

    def send():
        for name, t in tensors.items():  # one tensor a bucket, as a decoder layer would be
            wire.send_bucket({name: t})
        wire.send_end({"version": 1})
        wire.links[0].pg.barrier().wait()

    took = best(send, repeats)
    assert rx.wait(60) == 0
    return took


MEMBER = """
import sys, torch
from prl.transport.collective import GroupInfo, Wire
port, rank, senders, repeats = (int(x) for x in sys.argv[1:5])
shape = [int(x) for x in sys.argv[5].split(",")]
wire = Wire(GroupInfo("127.0.0.1", port, senders + 1, rank, 1, 120.0, "gloo", senders))
links = [wire.links[s] for s in sorted(wire.links)]
names = [f"w{i}" for i in range(8)]
g = torch.Generator().manual_seed(0)
tensors = {n: torch.randn(*shape, generator=g) for n in names}
for _ in range(repeats):
    for link in links:  # start together
        link.pg.barrier().wait()
    if rank < senders:
        for i, n in enumerate(names):
            if i % senders == rank:
                wire.send_bucket({n: tensors[n]})
        wire.send_end({"version": 1})
    else:
        got, _ = wire.receive({n: (shape, shape[0] * shape[1] * 4) for n in names})
        assert sorted(got) == names
    for link in links:  # the receiver holds the whole version
        link.pg.barrier().wait()
"""


def stream(tensors: dict[str, torch.Tensor], repeats: int, senders: int) -> float:
    """Median seconds, seen from sender 0, from the start to the receiver holding the version that
    `senders` processes streamed (tensor i from sender i % senders)."""
    import torch.distributed as dist

    from prl.transport.collective import GroupInfo, Wire

    store = dist.TCPStore("127.0.0.1", 0, senders + 1, is_master=True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    shape = ",".join(map(str, next(iter(tensors.values())).shape))
    procs = [subprocess.Popen([sys.executable, "-c", MEMBER, str(store.port), str(r), str(senders), str(repeats), shape])
             for r in range(1, senders + 1)]
    wire = Wire(GroupInfo("127.0.0.1", store.port, senders + 1, 0, 1, 120.0, "gloo", senders), store)
    link, names = wire.links[0], sorted(tensors)

    def send():
        link.pg.barrier().wait()
        for i, n in enumerate(names):
            if i % senders == 0:
                wire.send_bucket({n: tensors[n]})
        wire.send_end({"version": 1})
        link.pg.barrier().wait()

    took = best(send, repeats)
    assert all(p.wait(60) == 0 for p in procs)
    wire.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    line = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.mb:
            t = one_size(Path(tmp), mb, args.repeats)
            line.update({f"http_MBps_{mb}MB": round(mb / t["http"]), f"http_over_copy_{mb}MB": round(t["http"] / t["copy"], 2),
                         f"collective_MBps_{mb}MB": round(mb / t["collective"]),
                         f"http_over_collective_{mb}MB": round(t["http"] / t["collective"], 2),
                         f"collective_over_raw_{mb}MB": round(t["collective"] / t["raw"], 1),
                         f"stream2_MBps_{mb}MB": round(mb / t["stream"]),
                         f"collective_over_stream2_{mb}MB": round(t["collective"] / t["stream"], 2)})
            print(f"{mb:5d} MB: http {t['http']:.3f}s ({mb / t['http']:6.0f} MB/s)   copy+verify {t['copy']:.3f}s "
                  f"({mb / t['copy']:6.0f} MB/s)   verify alone {t['verify']:.3f}s   http/copy "
                  f"{t['http'] / t['copy']:.2f}x   collective {t['collective']:.3f}s ({mb / t['collective']:6.0f} MB/s)"
                  f"   stream (2 senders) {t['stream']:.3f}s ({mb / t['stream']:6.0f} MB/s)   raw copy {t['raw']:.3f}s",
                  flush=True)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
