"""A prompt-KV pool shared by every inference server of a run, over a Mooncake store (issue 12).

After a prefill the engine puts the prompt's KV into the pool, one object per full chunk of
`chunk_tokens` tokens; a server about to prefill looks the prompt's chunks up first, loads the
longest run it finds and computes only the rest. Keys chain a hash over the chunks, so a chunk
matches only after the same tokens before it, and the chain starts from the run and the weights
version: KV computed under another version never matches (the same salt rule as the local prefix
cache). Each object is a safetensors blob holding, for every cache layer, that chunk's slice of
its per-token tensors (`prl.inference.kvcache.LAYER_TENSORS`), plus the routing the prompt's
tokens took (R3), and its own key in the header, checked on load.

Faults never fail a request: a chunk that cannot be read ends the reused run there (the rest is
computed); a store error (master or a memory owner gone) turns the pool off for `retry_s`, then it
is tried again. Puts that find the pool full are skipped (Mooncake evicts the oldest objects).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from array import array
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_blob
from safetensors.torch import save as save_blob

from prl.inference.kvcache import layer_tensors

ROUTING = "routing"


class PoolError(RuntimeError):
    pass


def chunk_keys(run: str, version: int, ids: list[int], chunk: int) -> list[str]:
    """One key per full chunk of `ids`: a hash chained over the chunks, from (run, version)."""
    h = hashlib.sha256(f"prl|{run}|v{version}".encode()).digest()
    keys = []
    for start in range(0, len(ids) - chunk + 1, chunk):
        h = hashlib.sha256(h + array("q", ids[start:start + chunk]).tobytes()).digest()
        keys.append(f"prl/{run}/v{version}/{h.hex()[:40]}")
    return keys


@dataclass
class PoolStats:
    hit_tokens: int = 0  # prompt tokens loaded from the pool instead of computed
    stored_chunks: int = 0
    full: int = 0  # puts refused: the pool was full
    errors: int = 0  # store errors (the pool was turned off for a while after each)
    dropped: int = 0  # chunks not put because the put queue was full (the store is slower than prefill)


class KvPool:
    def __init__(self, store, run: str, chunk_tokens: int, retry_s: float = 30.0, queue_depth: int = 64):
        self.store, self.run, self.chunk, self.retry_s = store, run, chunk_tokens, retry_s
        self.stats = PoolStats()
        self.off_until = 0.0
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_depth)  # prompts whose chunks wait for a put
        self.worker: threading.Thread | None = None
        self.closing = False

    @classmethod
    def connect(cls, *, master: str, metadata: str, hostname: str, segment_bytes: int, run: str,
                chunk_tokens: int, buffer_bytes: int = 64 << 20, retry_s: float = 30.0) -> "KvPool":
        """A store client contributing `segment_bytes` of this process's memory to the pool."""
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # else setup retries for ~90 s
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(hostname, metadata, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise PoolError(f"cannot join the KV pool: Mooncake master {master} (metadata {metadata}) "
                            f"answered setup with {rc}")
        return cls(store, run, chunk_tokens, retry_s=retry_s)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the put worker (queued puts are dropped) and leave the pool. The store is closed only
        once the worker is out of it; a worker stuck on a dead master is left to the process exit."""
        if self.worker is not None:
            self.closing = True
            try:
                while True:
                    self.jobs.get_nowait()
                    self.jobs.task_done()
            except queue.Empty:
                pass
            self.jobs.put_nowait(None)
            self.worker.join(timeout)
            if self.worker.is_alive():
                return
        self.store.close()

    def flush(self) -> None:
        """Wait until every queued put is done (tests; a server never waits)."""
        self.jobs.join()

    def usable(self) -> bool:
        return time.monotonic() >= self.off_until

    def failed(self) -> None:
        self.stats.errors += 1
        self.off_until = time.monotonic() + self.retry_s

    # ---- lookup ----
    def fetch(self, version: int, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """The pooled chunks of the prompt's longest cached prefix, leaving at least its last token
        to compute (its logits start the completion)."""
        if not self.usable():
            return []
        keys = chunk_keys(self.run, version, ids[:-1], self.chunk)
        if not keys:
            return []
        try:
            present = self.store.batch_is_exist(keys)
        except Exception:  # noqa: BLE001 - the pool is an optimisation: never fail the request
            self.failed()
            return []
        if any(there < 0 for there in present):  # Mooncake answers -1 per key when the master is gone
            self.failed()
            return []
        chunks = []
        for key, there in zip(keys, present):
            if there != 1:
                break
            blob = self.read(key)
            if blob is None:
                break
            chunks.append(blob)
        return chunks

    def read(self, key: str) -> dict[str, torch.Tensor] | None:
        try:
            size = self.store.get_size(key)
            if size <= 0:
                return None  # evicted since the lookup
            data = self.store.get(key)
            tensors = load_blob(data)
        except Exception:  # noqa: BLE001 - unreadable: computed instead
            self.failed()
            return None
        stored = tensors.pop("key", None)
        if len(data) != size or stored is None or bytes(stored.tolist()).decode() != key:
            return None  # not the object this key names
        return tensors

    # ---- store ----
    def put(self, version: int, ids: list[int], cache, routing: torch.Tensor | None, skip: int = 0,
            wait: bool = False) -> int:
        """Put every full chunk of the prompt after the first `skip` ones (those came from the pool).
        The chunks are copied out of the cache here; the writes are a worker thread's, so the engine
        never waits on the store (a full queue drops the prompt: counted in `dropped`). `wait`: write
        now and return how many of the prompt's chunks are in the pool (P/D's prefill server answers
        with that)."""
        if not self.usable():
            return 0
        keys = chunk_keys(self.run, version, ids, self.chunk)
        if len(keys) <= skip:
            return skip
        if not wait and self.jobs.full():  # the store is slower than prefill: drop before copying
            self.stats.dropped += len(keys) - skip
            return skip
        items = [(key, chunk_tensors(cache, routing, i * self.chunk, self.chunk))
                 for i, key in enumerate(keys) if i >= skip]
        if wait:
            return skip + self.store_chunks(items)
        if self.worker is None:
            self.worker = threading.Thread(target=self.work, name="kv-pool-put", daemon=True)
            self.worker.start()
        try:
            self.jobs.put_nowait(items)
        except queue.Full:
            self.stats.dropped += len(items)
        return skip

    def work(self) -> None:
        while True:
            items = self.jobs.get()
            try:
                if items is None:
                    return
                if self.usable() and not self.closing:
                    self.store_chunks(items)
            finally:
                self.jobs.task_done()

    def store_chunks(self, items: list[tuple[str, dict[str, torch.Tensor]]]) -> int:
        """Write the chunks in order; how many of them are now in the pool (the first failure or
        refusal ends the run, as a lookup stops at the first missing chunk)."""
        for n, (key, tensors) in enumerate(items):
            try:
                rc = self.store.put(key, save_blob({**tensors, "key": key_tensor(key)}))
            except Exception:  # noqa: BLE001 - the pool is an optimisation: never fail the request
                self.failed()
                return n
            if rc == 0:
                self.stats.stored_chunks += 1
            elif rc == -200:  # no space now: Mooncake evicts in the background
                self.stats.full += 1
                return n
            else:
                self.failed()
                return n
        return len(items)


def chunk_tensors(cache, routing: torch.Tensor | None, start: int, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for li, layer in enumerate(cache.layers):
        for attr, dim in layer_tensors(layer):
            t = getattr(layer, attr)
            out[f"{li}.{attr}"] = t.narrow(dim % t.dim(), start, n).contiguous().cpu()
    if routing is not None:
        out[ROUTING] = routing[start:start + n].contiguous()
    return out


def fill_cache(template, chunks: list[dict[str, torch.Tensor]], device) -> tuple[object, torch.Tensor | None]:
    """A cache like `template` (a one-request prefill's) holding the chunks' KV in order, and
    their routing rows."""
    from prl.inference.kvcache import clone_cache

    cache = clone_cache(template)
    for li, layer in enumerate(cache.layers):
        for attr, dim in layer_tensors(layer):
            setattr(layer, attr, torch.cat([c[f"{li}.{attr}"] for c in chunks], dim=dim).to(device))
    routing = torch.cat([c[ROUTING] for c in chunks]) if all(ROUTING in c for c in chunks) else None
    return cache, routing


def key_tensor(key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8)
