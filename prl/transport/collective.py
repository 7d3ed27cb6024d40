"""The collective weight path: trainer rank 0 broadcasts each published bucket straight into the
inference servers' memory over one process group, beside the sealed folder, which stays the fallback.
The group is NCCL when the trainer and every server hold CUDA devices (each member on its own GPU and
CUDA stream, staging what it receives in host memory), else gloo on CPU tensors (`pick_backend`); the
protocol is the same.

The group: trainer rank 0 is rank 0 and hosts its rendezvous store (`CollectiveSink.form`); each
server brings as many ranks as it has receiving processes (`/weights/collective/members`: 1 for the
embedded engine, one per vLLM worker), numbered after the servers before it. It is formed anew (a new `epoch`) whenever the set of members may have changed: at the
trainer's start, and after any failure (a collective group cannot admit a restarted member).

One version on the wire, in bucket order (`Wire`):
- per bucket, a header (an int64 byte count, then UTF-8 JSON: each tensor's name, dtype, shape) and
  then each tensor's bytes; a version ends with a header `{"end": true, "meta": ...}`;
- the receiver checks every name and shape against its model before it allocates anything, and
  computes each size itself (a header never makes it allocate more than the model's own tensors);
- what arrives is staged whole (`prl.inference.engine.make_policy` checks it as a folder is checked)
  and applied only when the orchestrator asks for that version: the old version serves until then.
  A sender that dies or stalls mid-version fails the receive (reset connection, or the group's
  timeout); the staged part is dropped, the server keeps serving, and the folder is still there.

Trainer side: `CollectiveSink` (kind "collective") writes the folder as `FolderSink` does and
broadcasts each bucket; a failure to reach a server costs the collective for that version only
(the servers read the folder) and the group is formed again for the next.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from prl.transport.sinks import FolderSink, WeightSink, register_sink

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn)}
MAX_HEADER = 16 << 20  # bytes of one bucket's JSON header


class WireError(RuntimeError):
    """The version on the wire broke off or does not fit the model (the old version keeps serving)."""


@dataclass
class GroupInfo:
    """How a member joins: the rendezvous store on trainer rank 0's host, its rank, the group size."""

    addr: str
    port: int
    world: int
    rank: int
    epoch: int
    timeout_s: float = 120.0
    backend: str = "gloo"  # or "nccl" (`pick_backend`)


def local_device() -> str:
    """The kind of device this process's tensors would sit on: what a member tells the sender."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_backend(sender: str, members: list[str], nccl: bool | None = None) -> str:
    """NCCL when the sender and every member hold CUDA devices and this torch has NCCL; gloo otherwise
    (a CPU member, or a CUDA trainer sending to CPU servers: the buckets go through host memory)."""
    nccl = dist.is_nccl_available() if nccl is None else nccl
    return "nccl" if nccl and sender == "cuda" and members and all(m == "cuda" for m in members) else "gloo"


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_backend(backend: str) -> None:
    """Before anything connects: a backend this process can join."""
    if backend not in ("gloo", "nccl"):
        raise WireError(f"weight group backend {backend!r}: expected 'gloo' or 'nccl'")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise WireError("an NCCL weight group needs CUDA and a torch built with NCCL; this process has "
                        f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}")


def nccl_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta):
    """An NCCL group. Its waits block the calling thread and raise after `timeout` (a sender that dies
    mid-version fails the receive instead of hanging), read when the group is built; with blocking
    waits torch runs no watchdog that could kill the server the group lives in."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    with _env(TORCH_NCCL_BLOCKING_WAIT="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
        return dist.ProcessGroupNCCL(store, rank, world, opts)


def store_barrier(store: dist.Store, world: int, timeout_s: float) -> None:
    """Every member reached this point, or a WireError after `timeout_s`. NCCL connects inside its first
    collective with no timeout of its own, so a member that never comes must be found before that."""
    store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    while (n := store.add("joined", 0)) < world:
        if time.monotonic() > deadline:
            raise WireError(f"{n} of {world} weight-group members joined within {timeout_s:.0f} s")
        time.sleep(0.05)


class Wire:
    """One formed group: rank 0 broadcasts, every other rank receives."""

    def __init__(self, info: GroupInfo, store: dist.Store | None = None, device: torch.device | str | None = None):
        """`device`: where an NCCL member's buffers live (its model's GPU; default the current one)."""
        check_backend(info.backend)
        timeout = datetime.timedelta(seconds=info.timeout_s)
        if store is None:  # a server joins the trainer's store
            store = dist.TCPStore(info.addr, info.port, info.world, is_master=False, timeout=timeout)
        self.info, self.store = info, store
        prefix = dist.PrefixStore(f"prl-weights-{info.epoch}", store)
        self.device, self.stream = torch.device("cpu"), None
        if info.backend == "nccl":
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
            self.stream = torch.cuda.Stream(self.device)  # its own: waits never stall the engine's stream
            store_barrier(prefix, info.world, info.timeout_s)
            self.pg = nccl_group(prefix, info.rank, info.world, timeout)
            with self._here():
                self._bcast(torch.zeros(1, device=self.device))  # NCCL connects here
        else:
            self.pg = dist.ProcessGroupGloo(prefix, info.rank, info.world, timeout)

    @contextlib.contextmanager
    def _here(self):
        """This group's GPU and its own stream for the calling thread (a receive runs on a staging thread,
        whose current device is not the worker's); nothing on CPU."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # a bucket made on the caller's stream
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def _header(self, header: dict) -> None:
        raw = json.dumps(header).encode()
        self._bcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self._bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))

    def send_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        """Broadcast one bucket; returns its bytes."""
        with self._here():
            return self._send_bucket(bucket)

    def _send_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        parts = {k: v.detach().to(self.device).contiguous() for k, v in bucket.items()}
        self._header({"tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in parts.items()]})
        for v in parts.values():
            self._bcast(v.reshape(-1).view(torch.uint8))
        return sum(v.numel() * v.element_size() for v in parts.values())

    def send_end(self, meta: dict) -> None:
        with self._here():
            self._header({"end": True, "meta": meta})

    def receive(self, expected: dict[str, tuple[list[int], int]], on_tensor=None) -> tuple[dict[str, torch.Tensor], dict]:
        """One version: (tensors, meta). `expected`: name -> (shape, max bytes) it may have."""
        with self._here():
            return self._receive(expected, on_tensor)

    def _receive(self, expected, on_tensor) -> tuple[dict[str, torch.Tensor], dict]:
        out: dict[str, torch.Tensor] = {}
        while True:
            header = self._recv_header()
            if header.get("end"):
                return out, header.get("meta") or {}
            for name, dtype, shape in header.get("tensors", []):
                out[name] = self._recv_tensor(name, dtype, shape, expected)
                if on_tensor:
                    on_tensor()

    def _recv_header(self) -> dict:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(n)
        if not 0 < int(n) <= MAX_HEADER:
            raise WireError(f"a bucket header of {int(n)} bytes (at most {MAX_HEADER})")
        raw = torch.empty(int(n), dtype=torch.uint8, device=self.device)
        self._bcast(raw)
        try:
            return json.loads(bytes(raw.cpu().numpy()))
        except ValueError as e:
            raise WireError(f"an unreadable bucket header: {e}") from None

    def _recv_tensor(self, name: str, dtype: str, shape: list[int], expected) -> torch.Tensor:
        if name not in expected or dtype not in DTYPES:
            raise WireError(f"tensor {name!r} ({dtype}): not a tensor of this model, or a dtype prl does not take")
        want, limit = expected[name]
        t = torch.empty(0, dtype=DTYPES[dtype])
        size = int(torch.Size(shape).numel()) * t.element_size()
        if (want is not None and list(shape) != list(want)) or size > limit:
            raise WireError(f"tensor {name!r}: shape {shape}, the model's is {want} ({size} bytes, at most {limit})")
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._bcast(raw)
        if raw.is_cuda:  # staged in host memory, as on gloo: a whole version need not fit the GPU's free memory
            raw = raw.cpu()
        return raw.view(DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        if self.stream is not None and self.pg is not None:
            self.pg.abort()  # NCCL: its communicator goes now, not when collected
        self.pg = self.store = None


def expected_tensors(model, scale_suffix: str) -> dict[str, tuple[list[int] | None, int]]:
    """What a model's version may hold: each state tensor (its shape; up to 4 bytes an element) and
    its FP8 block scales (any shape, no larger than the tensor in fp32)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (list(v.shape), v.numel() * 4)
        out[k + scale_suffix] = (None, v.numel() * 4)
    return out


# ---------------------------------------------------------------- the trainer side
@dataclass
class Delivery:
    """What one version's broadcast did (logged by the trainer)."""

    version: int
    backend: str = ""  # of the group that carried it ("": none formed)
    servers: int = 0  # servers that staged it from the collective
    bytes: int = 0
    send_s: float = 0.0
    error: str | None = None
    failed: list[str] = field(default_factory=list)


@register_sink("collective")
class CollectiveSink(WeightSink):
    """`FolderSink` plus a broadcast of every bucket to the servers (`servers()`: their base URLs now).
    `device`: where the trainer's buckets sit ("cuda" with CUDA servers makes the group NCCL)."""

    def __init__(self, root: Path, keep: int, servers, secret: str, host: str, timeout_s: float = 120.0,
                 device: str = "cpu"):
        self.folder = FolderSink(root, keep)
        self.servers, self.host, self.timeout_s, self.device = servers, host, timeout_s, device
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.wire: Wire | None = None
        self.nccl_failed = False  # an NCCL group failed to form once: gloo from then on
        self.epoch = 0
        self.threads: list[threading.Thread] = []
        self.results: dict[str, str | None] = {}
        self.last: Delivery | None = None

    def begin(self, version: int) -> None:
        self.folder.begin(version)
        self.last, self.t0 = Delivery(version), time.perf_counter()
        try:
            if self.wire is None:
                self.form()
            self.start_receives(version)
            self.last.backend = self.wire.info.backend
        except Exception as e:  # noqa: BLE001 - any failure to reach the servers: the folder serves this version
            self.broken(f"forming the group: {type(e).__name__}: {e}")

    def put(self, bucket: dict[str, torch.Tensor]) -> None:
        self.folder.put(bucket)
        if self.wire is not None:
            try:
                self.last.bytes += self.wire.send_bucket(bucket)
            except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses
                self.broken(f"broadcast: {type(e).__name__}: {e}")

    def seal(self, meta: dict) -> Path:
        if self.wire is not None:
            try:
                self.wire.send_end(meta)
            except Exception as e:  # noqa: BLE001
                self.broken(f"broadcast: {type(e).__name__}: {e}")
        self.finish_receives()
        self.last.send_s = time.perf_counter() - self.t0
        return self.folder.seal(meta)  # sealed after the servers staged it: staged comes before visible

    # ---- the group ----
    def form(self) -> None:
        """A new group over every server (rank 0 here, hosting the store)."""
        self.epoch += 1
        urls = self.servers()
        down = [u for u in urls if not self.healthy(u)]
        if down:  # known now: no group can form (a join would wait out the timeout)
            raise WireError(f"servers not answering /health: {down}")
        answers = [self.members(u) for u in urls]  # a server's ranks: its workers (vLLM: tp x dp), else 1
        counts = [n for n, _ in answers]
        backend = "gloo" if self.nccl_failed else pick_backend(self.device, [d for _, d in answers])
        try:
            self.wire = self.join_all(urls, counts, backend)
        except Exception as e:
            if backend == "nccl" and "nccl" in str(e).lower():  # e.g. two members on one GPU: gloo from now on
                self.nccl_failed = True
            raise

    def join_all(self, urls: list[str], counts: list[int], backend: str) -> Wire:
        firsts = [1 + sum(counts[:i]) for i in range(len(urls))]
        world = 1 + sum(counts)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        calls = [(u, "/weights/collective/join", {"addr": self.host, "port": store.port, "world": world, "rank": first,
                                                  "epoch": self.epoch, "timeout_s": self.timeout_s, "backend": backend})
                 for u, first in zip(urls, firsts)]
        threads = self.call_all(calls)
        wire = Wire(GroupInfo(self.host, store.port, world, 0, self.epoch, self.timeout_s, backend), store)
        for t in threads:
            t.join()
        failed = {u: e for u, e in self.results.items() if e}
        if failed:
            raise WireError(f"servers that did not join: {failed}")
        return wire

    def start_receives(self, version: int) -> None:
        self.threads = self.call_all([(u, "/weights/collective/receive", {"version": version, "epoch": self.epoch})
                                      for u in self.servers()])

    def finish_receives(self) -> None:
        for t in self.threads:
            t.join()
        self.threads = []
        self.last.failed = [f"{u}: {e}" for u, e in self.results.items() if e]
        self.last.servers = sum(1 for e in self.results.values() if e is None)
        if self.last.failed and self.wire is not None:
            self.broken("; ".join(self.last.failed))

    def members(self, url: str) -> tuple[int, str]:
        """(ranks, device kind) a server brings to the group."""
        r = httpx.get(url + "/weights/collective/members", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        n, device = r.json().get("members"), r.json().get("device", "cpu")
        if not isinstance(n, int) or not 1 <= n <= 4096 or not isinstance(device, str):
            raise WireError(f"{url}: /weights/collective/members answered {r.text[:100]}")
        return n, device

    def healthy(self, url: str) -> bool:
        try:
            return httpx.get(url + "/health", headers=self.headers, timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def call_all(self, calls: list[tuple[str, str, dict]]) -> list[threading.Thread]:
        """POST each call on its own thread (each blocks until the server is done); errors land in `results`."""
        self.results = {}

        def one(url: str, path: str, body: dict) -> None:
            try:
                r = httpx.post(url + path, json=body, headers=self.headers,
                               timeout=httpx.Timeout(self.timeout_s + 30, connect=10))
                self.results[url] = None if r.status_code < 400 else f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                self.results[url] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=one, args=c, daemon=True) for c in calls]
        for t in threads:
            t.start()
        return threads

    def broken(self, why: str) -> None:
        """This version goes by the folder; the next forms a new group."""
        if self.last is not None and self.last.error is None:
            self.last.error = why
        if self.wire is not None:
            self.wire.close()
        self.wire = None
