"""Longest-prefix KV reuse for the embedded engine, salted by the weights version.

A multi-turn agent sends, at turn k+1, its whole history as token ids: the prompt, every earlier
completion and the environment's tokens. The engine keeps the KV of what it computed (a prompt after
its prefill, a whole sequence, prompt and generated tokens, when it finishes) as entries here; a new
prompt reuses the KV of the entry sharing its longest prefix, token by token, and the engine
computes only the rest.

- Entries hold, for their token ids: a batch-1 Hugging Face cache (every per-token tensor of every
  layer, GLM-5's DSA indexer keys included: `prl.inference.kvcache.LAYER_TENSORS`), the routed
  experts of those tokens (R3, so a reused prefix's routing comes back as a fresh prefill's would),
  and the next-token logits at prompt boundaries (an exact repeat, a GRPO group's next member,
  computes nothing).
- Lookup: keys chained over the prefixes of lengths `SHORT_LEVELS` (1, 2, 4, 8), then every `BLOCK`-token
  block, from a root that is the weights version (the salt: another version's chain never meets this
  one's, and each entry's version is checked too). The deepest key the prompt reaches names the
  candidates, the entries sharing at least that prefix, so the best is among them; each is extended
  token by token and the best one's tokens are compared in full (a hash collision is a miss, never a
  wrong reuse). The short levels keep a lookup of a short prompt (a GRPO group's, under one block)
  from scanning every entry of the version.
- An entry whose tokens a newer entry extends (the turn-k sequence, once turn k+1's prompt reused
  all of it) is replaced, so a conversation holds one entry, not one per turn.
- Eviction: least recently used, past `max_entries` entries or `max_tokens` held tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per hashed block: lookups walk len/BLOCK keys, then compare < BLOCK tokens per candidate
SHORT_LEVELS = (1, 2, 4, 8)  # prefix lengths keyed below the first block
KEEP_LOGITS = 4  # prompt boundaries whose logits an entry keeps (the newest)


@dataclass(eq=False)
class Entry:
    version: int
    ids: tuple[int, ...]  # the tokens whose KV `cache` holds, in order
    cache: object  # batch-1 HF cache of len(ids) tokens; its tensors are never changed in place
    routing: torch.Tensor | None  # [len(ids), MoE layers, k] when the engine captures routing
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # next-token logits after ids[:n]
    pooled: int = 0  # leading tokens already offered to the KV pool (not put again)
    id: int = field(default_factory=itertools.count().__next__)
    keys: list[int] = field(default_factory=list)  # its block keys, to unregister it
    ahead: bool = False  # computed for a request still waiting, which has not used it yet


@dataclass
class Hit:
    entry: Entry
    tokens: int  # leading prompt tokens whose KV (and routing) the entry gives
    logits: torch.Tensor | None  # the prompt's last logits when it covers all of it: nothing to compute
    shared: int  # tokens the entry and the prompt share (tokens, or one more when the last is computed)


def chain_keys(version: int, ids: tuple[int, ...]):
    """(prefix length, key) pairs: the root (0, the version), then one key per level the ids reach, the
    short levels and then every full block, each chained over all before it."""
    h, done = hash(("prl-prefix", version)), 0
    yield 0, h
    for n in levels(len(ids)):
        h, done = hash((h, ids[done:n])), n
        yield n, h


def levels(n: int):
    """The prefix lengths keyed for `n` tokens: the short levels, then multiples of BLOCK."""
    yield from (k for k in SHORT_LEVELS if k <= n)
    yield from range(BLOCK, n + 1, BLOCK)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...], start: int = 0) -> int:
    """Length of the longest common prefix of `a` and `b`, given that the first `start` tokens agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_entries: int, max_tokens: int | None = None):
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.index: dict[int, dict[int, Entry]] = {}  # block key -> entries whose ids reach it
        self.tokens = 0  # held tokens, over all entries

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, entry: Entry) -> bool:
        return entry.id in self.entries

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.tokens = 0

    def lookup(self, version: int, ids: tuple[int, ...], touch: bool = True) -> Hit | None:
        """The entry of `version` sharing the longest prefix with `ids`, leaving at least the last
        token to compute unless the entry knows the logits after all of `ids`."""
        found, start = None, 0
        for length, key in chain_keys(version, ids):
            bucket = self.index.get(key)
            if not bucket:
                break
            found, start = bucket, length  # every candidate shares these tokens (checked below for the best)
        if not found:
            return None
        best = max((self._usable(e, ids, start) for e in reversed(found.values()) if e.version == version),
                   key=lambda hit: hit.tokens, default=None)
        if best is None or best.tokens == 0 or best.entry.ids[:start] != ids[:start]:
            return None  # nothing shared, or a hash collision: a miss
        if touch:  # a probe that will not use the entry leaves its place in the eviction order
            self.entries.move_to_end(best.entry.id)
        return best

    def _usable(self, e: Entry, ids: tuple[int, ...], start: int) -> Hit:
        shared = common_prefix(e.ids, ids, start)
        if shared >= len(ids) and len(ids) in e.logits:
            return Hit(e, len(ids), e.logits[len(ids)], shared)
        return Hit(e, min(shared, len(ids) - 1), None, shared)

    def insert(self, version: int, ids: tuple[int, ...], cache, routing: torch.Tensor | None,
               logits: dict[int, torch.Tensor] | None = None, pooled: int = 0,
               replaces: Entry | None = None) -> Entry | None:
        """Keep `ids`' KV. `replaces`: an entry whose ids `ids` extends (its logits carry over, it
        goes). An entry with the same ids already there only takes the new logits."""
        if self.max_entries <= 0 or not ids:
            return None
        logits = dict(logits or {})
        if replaces is not None and replaces in self:
            logits = {**replaces.logits, **logits}
            self.remove(replaces)
        same = self._same(version, ids)
        if same is not None:
            self._add_logits(same, logits)
            self.entries.move_to_end(same.id)
            return same
        entry = Entry(version, ids, cache, routing, pooled=pooled)
        self._add_logits(entry, logits)
        entry.keys = [key for _, key in chain_keys(version, ids)]
        for key in entry.keys:
            self.index.setdefault(key, {})[entry.id] = entry
        self.entries[entry.id] = entry
        self.tokens += len(ids)
        self._evict()
        return entry if entry in self else None

    def _same(self, version: int, ids: tuple[int, ...]) -> Entry | None:
        *_, (_, last) = chain_keys(version, ids)
        for e in (self.index.get(last) or {}).values():
            if e.version == version and e.ids == ids:
                return e
        return None

    @staticmethod
    def _add_logits(entry: Entry, logits: dict[int, torch.Tensor]) -> None:
        entry.logits.update((n, t) for n, t in logits.items() if n <= len(entry.ids))
        for n in sorted(entry.logits)[:-KEEP_LOGITS]:
            del entry.logits[n]

    def add_logits(self, entry: Entry, n: int, logits: torch.Tensor) -> None:
        """Record the next-token logits after `entry.ids[:n]` (a prompt the entry covers)."""
        if entry in self:
            self._add_logits(entry, {n: logits})

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(entry.id, None) is None:
            return
        for key in entry.keys:
            bucket = self.index.get(key)
            if bucket is not None:
                bucket.pop(entry.id, None)
                if not bucket:
                    del self.index[key]
        self.tokens -= len(entry.ids)

    def _evict(self) -> None:
        while self.entries and (len(self.entries) > self.max_entries
                                or (self.max_tokens is not None and self.tokens > self.max_tokens)):
            self.remove(next(iter(self.entries.values())))
