"""A batched, left-padded KV cache over Hugging Face cache objects, for continuous batching.

Rows join (after their own prefill) and leave between decode steps. All rows are right-aligned:
row i holds `pad_i` masked slots, then its real tokens, so one decode step appends one column
for every row. The per-layer tensors are reached through `LAYER_TENSORS`, the one place that
knows the internals of transformers' cache layers; an unknown layer type fails loudly.

Simplified: joining or leaving copies the cache (torch.cat / index_select); a paged cache would
avoid that copy but cannot be expressed through the HF model classes.
"""

from __future__ import annotations

import torch

# cache layer class name -> (attribute, sequence dim) of every per-token tensor it holds
LAYER_TENSORS = {
    "DynamicLayer": (("keys", -2), ("values", -2)),
    "DynamicIndexedLayer": (("keys", -2), ("values", -2), ("indexer_keys", 1)),
}


def layer_tensors(layer) -> tuple[tuple[str, int], ...]:
    name = type(layer).__name__
    if name not in LAYER_TENSORS:
        raise NotImplementedError(
            f"prl's embedded engine does not know cache layers of type {name}; "
            f"add its tensors to prl.inference.kvcache.LAYER_TENSORS"
        )
    return LAYER_TENSORS[name]


def _pad_left(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class BatchCache:
    """One HF cache whose batch rows are the running requests, plus a [B, T] validity mask."""

    def __init__(self):
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, T] bool, True at real tokens

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def add_rows(self, rows: list[tuple[object, int]]) -> None:
        """Append rows in order, each a batch-1 cache of its request's `length` tokens: every tensor
        is widened and concatenated once for all of them (one copy of the batch, not one per row)."""
        if not rows:
            return
        width = max([self.width, *(n for _, n in rows)])
        parts = [] if self.cache is None else [(self.cache, self.width)]
        parts += rows
        for cache, n in parts:
            self._widen(cache, n, width)
        target = parts[0][0]
        for i, layer in enumerate(target.layers):
            for attr, _ in layer_tensors(layer):
                setattr(layer, attr, torch.cat([getattr(c.layers[i], attr) for c, _ in parts], dim=0))
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for r, (_, n) in enumerate(rows):
            mask[r, width - n:] = True
        old = [] if self.mask is None else [_pad_left(self.mask, 1, width - self.width)]
        self.cache, self.mask = target, torch.cat([*old, mask], dim=0)

    def _widen(self, cache, old: int, new: int) -> None:
        for layer in cache.layers:
            for attr, dim in layer_tensors(layer):
                setattr(layer, attr, _pad_left(getattr(layer, attr), dim, new - old))

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order), then drop columns that are padding in every row."""
        if not rows:
            self.cache, self.mask = None, None
            return
        idx = torch.tensor(rows, dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).float().argmax())  # leading all-padding columns
        for layer in self.cache.layers:
            for attr, dim in layer_tensors(layer):
                t = getattr(layer, attr)
                t = t.index_select(0, idx.to(t.device))
                setattr(layer, attr, t.narrow(dim % t.dim(), first, t.shape[dim] - first).contiguous())
        self.mask = mask[:, first:].contiguous()

    def step_mask(self) -> torch.Tensor:
        """The attention mask for one decode step: the cache plus the new column."""
        return torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.bool)], dim=1)

    def advance(self) -> None:
        """Record that a decode step appended one real token to every row."""
        self.mask = self.step_mask()

    def row(self, i: int, n: int):
        """A batch-1 cache holding row `i`'s last `n` tokens (its real ones: rows are right-aligned),
        copied out, so the prefix cache keeps a finished sequence's KV without pinning the batch's."""
        return cache_row(self.cache, i, n)


def cache_row(cache, i: int, n: int):
    """Row `i` of a right-aligned batched cache, its last `n` tokens, copied out as a batch-1 cache."""
    new = clone_cache(cache)
    for layer in new.layers:
        for attr, dim in layer_tensors(layer):
            t = getattr(layer, attr)
            d = dim % t.dim()
            setattr(layer, attr, t[i : i + 1].narrow(d, t.shape[d] - n, n).clone())
    return new


def narrow_cache(cache, n: int):
    """A new cache object viewing the first `n` tokens of `cache` (a longest-prefix reuse).

    Views are safe for the same reason as in `clone_cache`: nothing grows a cache tensor in place."""
    new = clone_cache(cache)
    for layer in new.layers:
        for attr, dim in layer_tensors(layer):
            t = getattr(layer, attr)
            if t.shape[dim] != n:
                setattr(layer, attr, t.narrow(dim % t.dim(), 0, n))
    return new


def clone_cache(cache):
    """A new cache object sharing the (never mutated in place) tensors of `cache`.

    HF cache layers grow by torch.cat, so sharing tensors is safe; sharing the layer objects is not.
    """
    import copy

    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    return new
