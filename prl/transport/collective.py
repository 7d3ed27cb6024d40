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

import concurrent.futures
import contextlib
import datetime
import json
import math
import os
import re
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


EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass
class GroupInfo:
    """How a member joins: the rendezvous store on trainer rank 0's host, its rank, the group size.
    Ranks 0..senders-1 send (trainer ranks), the rest receive (servers' workers)."""

    addr: str
    port: int
    world: int
    rank: int
    epoch: int
    timeout_s: float = 120.0
    backend: str = "gloo"  # or "nccl" (`pick_backend`)
    senders: int = 1

    @property
    def receivers(self) -> int:
        return self.world - self.senders


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


class Link:
    """One sender and every receiver: a process group of its own (and a CUDA stream under NCCL), so
    each sender streams on its own while a receiver reads every sender at once. Local ranks: the
    sender 0, receiver j at 1 + j."""

    def __init__(self, info: GroupInfo, store: dist.Store, source: int, device: torch.device):
        self.source, self.device, self.stream = source, device, None
        self.rank = 0 if info.rank == source else info.rank - info.senders + 1
        size, timeout = info.receivers + 1, datetime.timedelta(seconds=info.timeout_s)
        prefix = dist.PrefixStore(f"prl-weights-{info.epoch}-from-{source}", store)
        if info.backend == "nccl":
            self.stream = torch.cuda.Stream(device)  # its own: waits never stall the engine's stream
            store_barrier(prefix, size, info.timeout_s)
            self.pg = nccl_group(prefix, self.rank, size, timeout)
            with self.here():
                self.bcast(torch.zeros(1, device=device))  # NCCL connects here
        else:
            self.pg = dist.ProcessGroupGloo(prefix, self.rank, size, timeout)
        with self.here():
            self.connect_pairs(size)

    def connect_pairs(self, size: int) -> None:
        """One small message from the sender to each receiver: point-to-point pairs (an expert's rows go
        that way) connect now, inside the group's formation and its timeout, not lazily mid-version."""
        one = torch.zeros(1, device=self.device)
        if self.rank == 0:
            for j in range(1, size):
                self.pg.send([one], j, 1).wait()
        else:
            self.pg.recv([one], 0, 1).wait()

    @contextlib.contextmanager
    def here(self):
        """This link's GPU and its own stream for the calling thread (a receive runs on a staging thread,
        whose current device is not the worker's); nothing on CPU."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # a bucket made on the caller's stream
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def header(self, header: dict) -> None:
        raw = json.dumps(header).encode()
        self.bcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self.bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))

    def send_bucket(self, bucket: dict[str, torch.Tensor], to: dict[str, list[int]]) -> int:
        """The header to every receiver, then each tensor: broadcast, or sent only to the receivers
        `to` names for it (an expert's rows to the GPUs serving that expert)."""
        parts = {k: v.detach().to(self.device).contiguous() for k, v in bucket.items()}
        self.header({"tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape), to.get(k)]
                                 for k, v in parts.items()]})
        for k, v in parts.items():
            flat = v.reshape(-1).view(torch.uint8)
            if to.get(k) is None:
                self.bcast(flat)
            else:
                for j in to[k]:
                    self.pg.send([flat], 1 + j, 0).wait()
        return sum(v.numel() * v.element_size() for v in parts.values())

    def receive(self, out: dict, expected, on_tensor) -> dict:
        """This sender's buckets into `out` until its end header; returns the end's meta."""
        me = self.rank - 1
        while True:
            header = self.recv_header()
            if header.get("end"):
                return header.get("meta") or {}
            for name, dtype, shape, *rest in header.get("tensors", []):
                to = rest[0] if rest else None
                if to is not None and me not in to:
                    continue  # another receiver's share
                out[name] = self.recv_tensor(name, dtype, shape, expected, p2p=to is not None)
                if on_tensor:
                    on_tensor()

    def recv_header(self) -> dict:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.bcast(n)
        if not 0 < int(n) <= MAX_HEADER:
            raise WireError(f"a bucket header of {int(n)} bytes (at most {MAX_HEADER})")
        raw = torch.empty(int(n), dtype=torch.uint8, device=self.device)
        self.bcast(raw)
        try:
            return json.loads(bytes(raw.cpu().numpy()))
        except ValueError as e:
            raise WireError(f"an unreadable bucket header: {e}") from None

    def recv_tensor(self, name: str, dtype: str, shape: list[int], expected, p2p: bool) -> torch.Tensor:
        if name not in expected or dtype not in DTYPES:
            raise WireError(f"tensor {name!r} ({dtype}): not a tensor of this model, of this receiver's share, "
                            f"or a dtype prl does not take")
        want, limit = expected[name]
        t = torch.empty(0, dtype=DTYPES[dtype])
        size = int(torch.Size(shape).numel()) * t.element_size()
        if (want is not None and list(shape) != list(want)) or size > limit:
            raise WireError(f"tensor {name!r}: shape {shape}, the model's is {want} ({size} bytes, at most {limit})")
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        if p2p:
            self.pg.recv([raw], 0, 0).wait()
        else:
            self.bcast(raw)
        if raw.is_cuda:  # staged in host memory, as on gloo: a whole version need not fit the GPU's free memory
            raw = raw.cpu()
        return raw.view(DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a peer that died first: its end is gone already
            self.pg.abort()  # pending waits on the group fail now (gloo and NCCL)
        self.pg = None


class Wire:
    """One formed group: each sender streams on its own link; a receiver holds a link per sender."""

    def __init__(self, info: GroupInfo, store: dist.Store | None = None, device: torch.device | str | None = None):
        """`device`: where an NCCL member's buffers live (its model's GPU; default the current one)."""
        check_backend(info.backend)
        if not 0 < info.senders < info.world:
            raise WireError(f"a weight group of {info.world} with {info.senders} senders")
        if store is None:  # a server, or a trainer rank but 0, joins the trainer's store
            store = dist.TCPStore(info.addr, info.port, info.world, is_master=False,
                                  timeout=datetime.timedelta(seconds=info.timeout_s))
        self.info, self.store = info, store
        self.device = torch.device("cpu")
        if info.backend == "nccl":
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        sources = [info.rank] if info.rank < info.senders else range(info.senders)
        self.links: dict[int, Link] = {}
        try:
            for s in sources:  # every receiver forms the links in sender order
                self.links[s] = Link(info, store, s, self.device)
        except BaseException:
            self.close()
            raise

    def send_bucket(self, bucket: dict[str, torch.Tensor], to: dict[str, list[int]] | None = None) -> int:
        """Stream one bucket from this sender; returns its bytes. `to`: tensor name -> the receivers
        (0-based) that take it, for tensors not every receiver takes."""
        link = self.links[self.info.rank]
        with link.here():
            return link.send_bucket(bucket, to or {})

    def send_end(self, meta: dict) -> None:
        link = self.links[self.info.rank]
        with link.here():
            link.header({"end": True, "meta": meta})

    def receive(self, expected: dict[str, tuple[list[int], int]], on_tensor=None) -> tuple[dict[str, torch.Tensor], dict]:
        """One version from every sender at once: (tensors, meta). `expected`: name -> (shape, max bytes)
        this receiver may take. The first sender to fail fails the version and aborts the links, so the
        others fail at once too."""
        out: dict[str, torch.Tensor] = {}
        metas: dict[int, dict] = {}
        errors: list[BaseException] = []

        def read(link: Link) -> None:
            try:
                with link.here():
                    metas[link.source] = link.receive(out, expected, on_tensor)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                if not errors:
                    errors.append(e)
                    self.close()

        threads = [threading.Thread(target=read, args=(link,), daemon=True) for link in self.links.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        versions = {m.get("version") for m in metas.values()}
        if len(versions) != 1:
            raise WireError(f"the senders ended different versions: {sorted(map(str, versions))}")
        return out, metas[min(metas)]

    def close(self) -> None:
        for link in list(self.links.values()):
            if link.pg is not None:
                link.close()
        self.store = None


def expected_tensors(model, scale_suffix: str) -> dict[str, tuple[list[int] | None, int]]:
    """What a model's version may hold: each state tensor (its shape; up to 4 bytes an element) and
    its FP8 block scales (any shape, no larger than the tensor in fp32)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (list(v.shape), v.numel() * 4)
        out[k + scale_suffix] = (None, v.numel() * 4)
    return {**out, **adapter_entries({k: tuple(v.shape) for k, v in model.state_dict().items()})}


def adapter_entries(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[None, int]]:
    """What a LoRA adapter version may hold: for each 2-D or 3-D weight `X.weight`, `X.lora_A` and `X.lora_B` (any
    shape, no larger in fp32 than the weight: checked against the weight when merged, `prl.model.lora`)."""
    from prl.model.lora import SUFFIXES

    return {k.removesuffix(".weight") + s: (None, math.prod(shape) * 4) for k, shape in shapes.items()
            if k.endswith(".weight") and len(shape) in (2, 3) for s in SUFFIXES}


# ---------------------------------------------------------------- the trainer side
@dataclass
class Delivery:
    """What one version's stream did (logged by the trainer)."""

    version: int
    backend: str = ""  # of the group that carried it ("": none formed)
    servers: int = 0  # servers that staged it from the collective
    bytes: int = 0  # sent by this rank
    send_s: float = 0.0
    senders: int = 1
    error: str | None = None
    failed: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """The group a version goes over, as trainer rank 0 formed it and every sender follows it: where
    its store is, its epoch and backend, and each receiver's share of the experts (None: all)."""

    addr: str
    port: int
    world: int
    epoch: int
    backend: str
    shares: list[list[int] | None]


def routes(names, shares: list[list[int] | None]) -> dict[str, list[int]]:
    """Receivers (0-based) of each expert tensor not every receiver takes (`EXPERT` names: an
    expert's own tensors, as checkpoints name them); the rest is broadcast."""
    if all(s is None for s in shares):
        return {}
    held = [None if s is None else set(s) for s in shares]
    out = {}
    for name in names:
        m = EXPERT.search(name)
        if m:
            e = int(m.group(1))
            to = [j for j, h in enumerate(held) if h is None or e in h]
            if len(to) < len(held):
                out[name] = to
    return out


def over_the_trainer(device: str = "cpu", group=None):
    """(share, agree) for `CollectiveSink` over the trainer's process group (`group`, gloo: a background
    publish's; None: the default): rank 0's object on every rank; whether a flag holds on every rank."""
    device = "cpu" if group is not None else device

    def share(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return share, agree


@register_sink("collective")
class CollectiveSink(WeightSink):
    """The version streamed into the servers from `senders` trainer ranks, each bucket by its owner
    (`prl.trainer.publish`); rank 0 also writes the sealed folder (`FolderSink`), the fallback and
    what a restarted server reads, and forms the group: the servers' base URLs now (`servers()`),
    handed to the other senders by `share` (a broadcast over the trainer's ranks).
    `device`: where the trainer's buckets sit ("cuda" with CUDA servers makes the group NCCL)."""

    def __init__(self, root: Path, keep: int, servers, secret: str, host: str, timeout_s: float = 120.0,
                 device: str = "cpu", rank: int = 0, senders: int = 1, share=None, agree=None):
        """`share(obj)`: rank 0's object on every sender; `agree(ok)`: whether every sender's `ok` holds
        (both collectives over the trainer's ranks; identities for one sender)."""
        self.rank, self.senders, self.share = rank, senders, share or (lambda plan: plan)
        self.agree = agree or (lambda ok: ok)
        self.folder = FolderSink(root, keep) if rank == 0 else None
        self.servers, self.host, self.timeout_s, self.device = servers, host, timeout_s, device
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.wire: Wire | None = None
        self.store: dist.Store | None = None  # rank 0: the group's rendezvous
        self.members_now: list[str] = []  # rank 0: the servers in the group
        self.absent: list[str] = []  # rank 0: servers down when it formed (they read this version's folder)
        self.plan: Plan | None = None
        self.nccl_failed = False  # an NCCL group failed to form once: gloo from then on
        self.epoch = 0
        self.threads: list[threading.Thread] = []
        self.results: dict[str, str | None] = {}
        self.last: Delivery | None = None
        self.sending = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prl-weights")
        self.pending: concurrent.futures.Future | None = None

    def begin(self, version: int, whole: bool = True) -> None:
        """`whole` False (several senders): rank 0 writes no tensors; once every server staged the version
        it seals an empty folder marked `streamed_only`, else `missed` says it must be written whole."""
        self.last, self.t0 = Delivery(version, senders=self.senders), time.perf_counter()
        self.whole, self.missed = whole or self.senders == 1, False
        if self.folder is not None:
            self.folder.begin(version)
        joins = None
        if self.rank == 0:
            try:
                if self.wire is None:
                    self.plan, joins = self.prepare()
            except Exception as e:  # noqa: BLE001 - any failure to reach the servers: the folder serves this version
                self.broken(f"forming the group: {type(e).__name__}: {e}")
        plan = self.share(self.plan if self.wire is not None or joins is not None else None)
        try:
            self.follow(plan, joins)
        except Exception as e:  # noqa: BLE001
            self.broken(f"forming the group: {type(e).__name__}: {e}")
        # every sender streams, or none: a sender alone on a link nobody reads would wait out the timeout
        if not self.agree(self.wire is not None) and self.wire is not None:
            self.broken("another trainer rank could not join the weight group")
        if self.rank == 0 and self.wire is not None:
            self.start_receives(version)
            self.last.backend = self.wire.info.backend

    def put(self, bucket: dict[str, torch.Tensor], stream: bool = True) -> None:
        """A bucket this rank owns (`stream`: sent on the group) or, on rank 0, one for the folder only."""
        if self.folder is not None and self.whole:
            self.folder.put(bucket)
        if stream and self.wire is not None:
            self.wait_sent()  # at most one bucket queued behind the one on the wire (it may have broken it)
        if stream and self.wire is not None:
            self.pending = self.sending.submit(self.wire.send_bucket, bucket, routes(bucket, self.plan.shares))

    def seal(self, meta: dict) -> Path | None:
        self.wait_sent()
        if self.wire is not None:
            try:
                self.wire.send_end(meta)
            except Exception as e:  # noqa: BLE001
                self.broken(f"stream: {type(e).__name__}: {e}")
        self.last.send_s = time.perf_counter() - self.t0
        if self.folder is None:
            return None
        self.finish_receives()
        if not self.whole:
            if self.last.error is not None or not self.last.servers:
                self.missed = True  # a server did not stage it: the version is published again, whole
                return None
            meta = {**meta, "streamed_only": True}
        return self.folder.seal(meta)  # sealed after the servers staged it: staged comes before visible

    def wait_sent(self) -> None:
        if self.pending is None:
            return
        try:
            self.last.bytes += self.pending.result()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            self.broken(f"stream: {type(e).__name__}: {e}")
        self.pending = None

    # ---- the group ----
    def prepare(self) -> tuple[Plan, list[threading.Thread]]:
        """Rank 0: a new group over every server, its store here; the servers are asked to join (on
        threads: a join answers once every member, the senders too, joined)."""
        self.epoch += 1
        urls = self.servers()
        self.absent = [u for u in urls if not self.healthy(u)]  # down now (a join would wait out the timeout)
        urls = self.members_now = [u for u in urls if u not in self.absent]
        if not urls:
            raise WireError(f"servers not answering /health: {self.absent}")
        answers = [self.members(u) for u in urls]  # a server's ranks: its workers (vLLM: tp x dp), else 1
        counts = [len(shares) for _, shares in answers]
        backend = "gloo" if self.nccl_failed else pick_backend(self.device, [d for d, _ in answers])
        firsts = [self.senders + sum(counts[:i]) for i in range(len(urls))]
        world = self.senders + sum(counts)
        self.store = dist.TCPStore(self.host, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        plan = Plan(self.host, self.store.port, world, self.epoch, backend, [s for _, sh in answers for s in sh])
        calls = [(u, "/weights/collective/join", {"addr": self.host, "port": plan.port, "world": world, "rank": first,
                                                  "epoch": self.epoch, "timeout_s": self.timeout_s, "backend": backend,
                                                  "senders": self.senders})
                 for u, first in zip(urls, firsts)]
        return plan, self.call_all(calls)

    def follow(self, plan: Plan | None, joins: list[threading.Thread] | None) -> None:
        """Every sender: join `plan`'s group when its epoch is new (None: none this version)."""
        if plan is None:
            self.close_wire()
            return
        if self.wire is not None and self.wire.info.epoch == plan.epoch:
            return
        self.close_wire()
        self.plan = plan
        info = GroupInfo(plan.addr, plan.port, plan.world, self.rank, plan.epoch, self.timeout_s, plan.backend,
                         self.senders)
        try:
            self.wire = Wire(info, self.store if self.rank == 0 else None)
        except Exception as e:
            if plan.backend == "nccl" and "nccl" in str(e).lower():  # e.g. two members on one GPU: gloo from now on
                self.nccl_failed = True
            raise
        finally:
            for t in joins or []:
                t.join()
        failed = {u: e for u, e in self.results.items() if e} if joins else {}
        if failed:
            raise WireError(f"servers that did not join: {failed}")

    def start_receives(self, version: int) -> None:
        self.threads = self.call_all([(u, "/weights/collective/receive", {"version": version, "epoch": self.epoch})
                                      for u in self.members_now])

    def finish_receives(self) -> None:
        for t in self.threads:
            t.join()
        self.threads = []
        self.last.failed = [f"{u}: {e}" for u, e in self.results.items() if e]
        self.last.servers = sum(1 for e in self.results.values() if e is None)
        if self.last.failed and self.wire is not None:
            self.broken("; ".join(self.last.failed))
        elif self.absent:  # they get this version from the folder; the next group includes those back up
            self.last.error = self.last.error or f"servers not answering /health, not in the group: {self.absent}"
            self.close_wire()

    def members(self, url: str) -> tuple[str, list[list[int] | None]]:
        """(device kind, each member's experts) a server brings to the group: one member per receiving
        process (vLLM: its tp x dp workers, each with the experts it serves; None: all)."""
        r = httpx.get(url + "/weights/collective/members", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        body = r.json()
        n, device = body.get("members"), body.get("device", "cpu")
        if not isinstance(n, int) or not 1 <= n <= 4096 or not isinstance(device, str):
            raise WireError(f"{url}: /weights/collective/members answered {r.text[:100]}")
        shares = body.get("experts") or [None] * n
        if len(shares) != n or not all(s is None or (isinstance(s, list) and all(isinstance(e, int) for e in s))
                                       for s in shares):
            raise WireError(f"{url}: /weights/collective/members: 'experts' must list each member's experts "
                            f"(or null), got {str(body.get('experts'))[:100]}")
        return device, shares

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

    def close_wire(self) -> None:
        if self.wire is not None:
            self.wire.close()
        self.wire = None

    def broken(self, why: str) -> None:
        """This version goes by the folder; the next forms a new group."""
        if self.last is not None and self.last.error is None:
            self.last.error = why
        self.close_wire()
