"""GLM-5's DSA indexer with a deterministic top-k: ties broken by position, lower first.

The indexer scores every earlier key with ReLU'd dot products, so many scores tie (often at exactly
0), and transformers' `topk` leaves the order of ties to the kernel: the engine (one query against
its KV cache) and the trainer (a packed row, other samples masked) can then keep different keys for
the same token, a train/inference mismatch unrelated to RL. prl's engine, trainer and
context-parallel attention all select with `stable_topk` on the same scores, so they keep the same
keys, and tiny recipes can set `index_topk` below the sequence length.

While `index_topk` is at least the number of keys (every sequence shorter than GLM-5's 2,048, and
tiny recipes' short samples), the indexer keeps every key whatever its scores, so no score is
computed: the forward returns every key's index (only the set matters: attention turns it into a
mask), and with a cache it still computes this step's indexer keys and appends them, for later,
longer steps. On reverse-tiny's trainer batch that is 16 ms of a 108 ms forward.

`install(model)` swaps each DSA indexer's class (the family spec's `indexer_class`, GLM-5's
`GlmMoeDsaIndexer`) for one whose forward is transformers' computation with that selection
(state-dict keys unchanged); models without one (other families, or no spec) are left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prl.model import families


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """GLM-5's interleaved rope (pairs (x0, x1), (x2, x3), ...), as transformers applies it."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(dim)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def indexer_keys(ix, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
    """The indexer's keys [B, S, D] (what its cache holds)."""
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    return torch.cat([rotate_interleaved(k_rot, cos, sin, 2), k_pass], dim=-1).squeeze(2)


@torch.no_grad()
def indexer_queries(ix, hidden: torch.Tensor, q_resid: torch.Tensor, cos, sin):
    """The indexer's queries [B, S, H, D] and head weights [B, S, H]."""
    B, S, _ = hidden.shape
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q = torch.cat([rotate_interleaved(q_rot, cos, sin, 2), q_pass], dim=-1)
    w = ix.weights_proj(hidden.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    return q, w


def indexer_parts(ix, hidden: torch.Tensor, q_resid: torch.Tensor, cos, sin):
    """Per-token parts of the indexer: queries [B, S, H, D], keys [B, S, D], head weights [B, S, H]."""
    q, w = indexer_queries(ix, hidden, q_resid, cos, sin)
    return q, indexer_keys(ix, hidden, cos, sin), w


ALL_HEADS_BYTES = 64 << 20  # below this, every head's scores at once (decode steps, short rows)


@torch.no_grad()
def index_scores(ix, q: torch.Tensor, k_all: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B, S, T]: per query, the head-weighted ReLU scores of every key, summed head by head in head
    order (the engine and the trainer alike). Where all heads' scores would be large (a block of 1024
    queries over 131k keys and 32 heads: 17 GB) they are computed one head at a time; below
    `ALL_HEADS_BYTES` in one product (a decode step), then summed in the same order."""
    keys = k_all.transpose(-1, -2).float()
    B, S, H, _ = q.shape
    if B * S * H * keys.shape[-1] * 4 <= ALL_HEADS_BYTES:
        every = F.relu(torch.matmul(q.float(), keys.unsqueeze(1)) * ix.softmax_scale)  # [B, S, H, T]
        head = lambda h: every[:, :, h]  # noqa: E731
    else:
        head = lambda h: F.relu(torch.matmul(q[:, :, h].float(), keys) * ix.softmax_scale)  # noqa: E731
    out = None
    for h in range(H):
        part = head(h) * w[:, :, h, None]
        out = part if out is None else out.add_(part)
    return out


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; equal scores: the lower index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def every_key(B: int, S: int, T: int, device) -> torch.Tensor:
    """[B, S, T] int32: each query's selection when it is every key (0..T-1)."""
    return torch.arange(T, dtype=torch.int32, device=device).expand(B, S, T)


class StableIndexer:
    """Mixin placed before transformers' GlmMoeDsaIndexer: its forward, with `stable_topk`; every key
    without scoring while `index_topk` covers them all."""

    @torch.no_grad()
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                past_key_values=None):
        B, S = hidden_states.shape[:2]
        if past_key_values is None and self.index_topk >= S:  # the trainer's short rows: every key
            return every_key(B, S, S, hidden_states.device)
        cos, sin = position_embeddings
        k = indexer_keys(self, hidden_states, cos, sin)
        if past_key_values is not None:
            k = past_key_values.update_indexer(k, self.layer_idx)
        if self.index_topk >= k.shape[1]:  # every key is kept, whatever the scores
            return every_key(B, S, k.shape[1], k.device)
        q, w = indexer_queries(self, hidden_states, q_resid, cos, sin)
        scores = index_scores(self, q, k, w)
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
        return stable_topk(scores, self.index_topk).to(torch.int32)


def install(model) -> None:
    fam = families.FAMILIES.get(getattr(model.config, "model_type", None))
    for m in families.modules_of(model, fam.indexer_class if fam else None):
        if not isinstance(m, StableIndexer):  # installing twice is a no-op
            m.__class__ = type(f"Stable{type(m).__name__}", (StableIndexer, type(m)), {})
