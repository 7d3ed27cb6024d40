"""Context parallelism for GLM-5's DSA attention: one all-gather per attention layer, issued as soon
as the layer's keys are computed and landed once its queries are (`trainer.parallel.overlap`).

Each of the `cp` ranks of a group holds part of the packed micro-batch
(`prl.transport.batch.shard_positions`). The default layout, `trainer.parallel.cp_layout = "zigzag"`,
cuts the row into 2 x cp chunks and rank c holds chunk c and its mirror 2cp-1-c: under causal
attention every rank then has the same number of (query, key) pairs to score, where contiguous
slices (rank c: tokens c*S .. (c+1)*S) leave the last rank about 2cp/(cp+1) of the mean
(`bench/cp_scaling.py`). Everything per token (embeddings, norms, projections, experts, the loss) stays
local. Attention needs, for its local queries, the keys of every earlier token of the same sample,
wherever it lives: each rank computes its tokens' compressed KV latent (normed), rope key (rotated
at the token's own position) and DSA indexer key, concatenates them, and one differentiable
all-gather gives every rank all of them (its backward sums the key gradients back to the ranks that
own the tokens; the indexer keys carry no gradient, as the indexer is not trained by the loss).
Queries, the indexer's queries and weights, the top-k selection and the attention itself stay
local, with global positions: a key is allowed for a query when both are in the same packed sample
and the key is not later (`Sequence.allowed`). The gathered keys arrive in rank order and are put
back in row order, then cut after the rank's last query (no later key is ever allowed); each block
of local queries (never straddling the zigzag's two chunks) scores only the keys up to its own last
query, so a rank's work follows the causal mask and the layout decides its balance.

The top-k selection breaks ties by position (`prl.model.dsa`, as the engine and the unsplit trainer
do), so it picks the same keys however the sequence is split. This adapter replaces the forward of
the family spec's attention class (`prl.model.families`: GLM-5's `GlmMoeDsaAttention`; batch of one
packed row, no KV cache: training only) and fails loudly on other families.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from prl.model import families
from prl.model.dsa import index_scores, indexer_keys, indexer_queries, rotate_interleaved, stable_topk
from prl.model.mla import absorbed_weights
from prl.trainer.overlap import Exchange, Flight, issue, land
from prl.transport.batch import MicroBatch, cp_multiple, pad_row, shard_positions, shard_sequence
from prl.transport.trees import has_branches, sample_ids


@dataclass
class Sequence:
    """The packed row this rank holds part of: sample id of every row token, the row index of each
    local token, and what follows from them (`sequence`)."""

    group: object
    size: int
    rank: int
    layout: str = "zigzag"
    overlap: bool = True  # the gather in flight while the queries are computed (else landed at once)
    segments: torch.Tensor | None = None  # [T] sample id per row token
    positions: torch.Tensor | None = None  # [S] row index of each local token
    order: torch.Tensor | None = None  # [T] gathered index of each row token (None: gathered in row order)
    keys: int = 0  # keys any local query may see: up to the last local token
    blocks: list[tuple[int, int, int]] | None = None  # (start, end, keys it may see) per block of local queries
    rows: list[int] | None = None  # `positions` as a list (no device read per block)

    def allowed(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """[S, keys] bool: local query i (row index positions[i]) may see key j; of queries first..end-1 alone."""
        seg, q = self.segments, self.positions[first:end]
        k = torch.arange(self.keys, device=seg.device)
        return (seg[q][:, None] == seg[None, : self.keys]) & (k[None, :] <= q[:, None])


def install(model, group, size: int, rank: int, layout: str = "zigzag", overlap: bool = True) -> Sequence:
    """Swap the model's attention (its family spec's `attention_class`) for the adapter over `group`."""
    fam = families.spec(model.config.model_type, "trainer.parallel.cp > 1")
    attns = families.modules_of(model, fam.attention_class)
    if not attns:
        raise NotImplementedError(f"trainer.parallel.cp > 1: {type(model).__name__} has no "
                                  f"{fam.attention_class or 'attention prl can split'}; context parallelism is built "
                                  f"for {families.with_feature('cp')} (GLM-5's DSA attention) only")
    seq = Sequence(group, size, rank, layout, overlap)
    for a in attns:
        if not isinstance(a, ContextParallelAttention):
            a.__class__ = type(f"CP{type(a).__name__}", (ContextParallelAttention, type(a)), {})
        a._prl_seq = seq
    return seq


@contextlib.contextmanager
def sequence(seq: Sequence, segments: torch.Tensor, positions: torch.Tensor, block: int = 1024):
    """Set the row for the attention layers of one forward (and its backward): the sample ids of the
    row, the row index of each local token (`local_slice`)."""
    n = segments.shape[0]
    gathered = torch.cat([shard_positions(n, r, seq.size, seq.layout) for r in range(seq.size)])
    seq.order = None if torch.equal(gathered, torch.arange(n)) else torch.argsort(gathered).to(segments.device)
    seq.segments, seq.positions, seq.rows = segments, positions, positions.tolist()
    seq.keys = max(seq.rows) + 1
    seq.blocks = query_blocks(seq.rows, block, cp_multiple(seq.size, seq.layout) // seq.size)
    try:
        yield
    finally:
        seq.segments = seq.positions = seq.order = seq.blocks = seq.rows = None


def query_blocks(positions: list[int], block: int, chunks: int = 1) -> list[tuple[int, int, int]]:
    """(start, end, keys) for blocks of at most `block` local queries, each inside one of the `chunks`
    equal chunks the rank holds (the zigzag's two: a block never spans both), `keys` the row index
    of its last query + 1 (the local positions of a chunk are consecutive)."""
    per = len(positions) // chunks
    return [(a, min(a + block, c + per), positions[min(a + block, c + per) - 1] + 1)
            for c in range(0, len(positions), per) for a in range(c, c + per, block)]


class GatherRows(Exchange):
    """All-gather of row slices along dim 0; backward: each rank's slice of the summed gradients
    (reduce-scatter). Written here on public collectives: torch's autograd all_gather falls back, on
    gloo, to scatters that name group ranks as global ranks and fail on any group not starting at rank 0."""

    def __init__(self, seq: Sequence, rows: int):
        self.seq, self.rows, self.eager = seq, rows, not seq.overlap

    def forward(self, local: torch.Tensor) -> Flight:
        parts = [torch.empty_like(local) for _ in range(self.seq.size)]
        work = dist.all_gather(parts, local.contiguous(), group=self.seq.group, async_op=True)
        return Flight(work, lambda: torch.cat(parts), keep=local)

    def backward(self, grad: torch.Tensor) -> Flight:
        out = grad.new_empty(self.rows, *grad.shape[1:])
        return Flight(dist.reduce_scatter_single(out, grad, group=self.seq.group, async_op=True), lambda: out, keep=grad)


def gather_issue(local_BSF: torch.Tensor, seq: Sequence):
    """The one collective of a layer, started: every rank's [1, S, F] part toward every rank."""
    return issue(local_BSF[0], GatherRows(seq, local_BSF.shape[1])) if seq.size > 1 else (local_BSF, None)


def gather_land(flight, seq: Sequence) -> torch.Tensor:
    """What `gather_issue` started, landed: [1, T, F] in row order, cut after the last key a local query
    may see; differentiable."""
    every = flight[0] if flight[1] is None else land(*flight)[None]
    if seq.order is not None:
        every = every[:, seq.order]
    return every[:, : seq.keys]


def select(ix, q, k_all, w, allowed: torch.Tensor, blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Top-k keys per local query, ties broken by position (`prl.model.dsa.stable_topk`, as the engine
    and the unsplit trainer select): [1, S, topk] int32. Scores are computed per block of queries
    (`query_blocks`) against the keys up to its last query, never fewer than top-k of them: the keys
    cut off are masked for the whole block, so the picks are those of the whole row."""
    topk = min(ix.index_topk, k_all.shape[1])
    picked = []
    for a, b, keys in blocks:
        keys = max(keys, topk)
        scores = index_scores(ix, q[:, a:b], k_all[:, :keys], w[:, a:b])
        scores = scores.masked_fill(~allowed[None, a:b, :keys], float("-inf"))
        picked.append(stable_topk(scores, topk))
    return torch.cat(picked, dim=1).to(torch.int32)


def attend_sparse(attn, q_pass, q_rot, latent, k_rot, topk, allowed, blocks) -> torch.Tensor:
    """DSA attention in MLA's latent space over each query's top-k keys only: [1, heads, S, v_head_dim].

    The no-position part of a query is taken into the latent space (q . W_UK c = (W_UK^T q) . c), each
    query scores only the latent KV rows of its picks (gathered: [queries, top-k, rank]), and the
    weighted sum of latents is taken back out per head (W_UV). No [heads, queries, keys] tensor and no
    per-head keys or values exist: memory grows with top-k, not the context. `latent` [T, kv_lora_rank]
    and `k_rot` [T, rope] are every key's; picks a query may not see (fewer allowed keys than top-k)
    get zero weight. Equal to every key scored with the others masked (`tests/test_cp_zigzag.py`)."""
    w_uk, w_uv = absorbed_weights(attn)
    q_lat = torch.einsum("hsn,hnl->hsl", q_pass[0], w_uk)  # [H, S, rank]
    outs = []
    for a, b, _keys in blocks:
        idx = topk[0, a:b].long()  # [blk, K]
        seen = allowed[a:b].gather(-1, idx)
        # one block's gathered rows and scores at a time, in backward too (recomputed there, not kept)
        outs.append(checkpoint(_sparse_block, q_lat[:, a:b], q_rot[0, :, a:b], latent, k_rot, idx, seen, w_uv,
                               attn.scaling, use_reentrant=False))
    return torch.cat(outs, dim=1)[None]


def _sparse_block(q_lat, q_rot, latent, k_rot, idx, seen, w_uv, scaling: float) -> torch.Tensor:
    """`attend_sparse` for one block of queries: [H, blk, v_head_dim]."""
    c, r = latent[idx], k_rot[idx]  # [blk, K, rank], [blk, K, rope]
    scores = (torch.einsum("hil,ikl->hik", q_lat, c) + torch.einsum("hir,ikr->hik", q_rot, r)) * scaling
    scores = scores.masked_fill(~seen[None], torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
    return torch.einsum("hil,hvl->hiv", torch.einsum("hik,ikl->hil", probs, c), w_uv)


class ContextParallelAttention:
    """Mixin placed before transformers' GlmMoeDsaAttention (see the module docstring)."""

    _prl_seq: Sequence

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
        seq = self._prl_seq
        if seq.segments is None or past_key_values is not None or hidden_states.shape[0] != 1:
            raise RuntimeError("context-parallel attention runs inside prl's training step only (one packed row)")
        keys = self.keys_issue(hidden_states, position_embeddings)  # their gather flies while the queries are computed
        return self.attend_part(hidden_states, position_embeddings, keys, 0, prev_topk_indices)

    def keys_issue(self, hidden_states, position_embeddings) -> list:
        """Every local token's keys (normed KV latent, rope key, indexer key), their gather started: the
        handle `attend_part` lands (once, for every part)."""
        B, S = hidden_states.shape[:2]
        cos, sin = position_embeddings
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rot = rotate_interleaved(k_rot.view(B, 1, S, self.qk_rope_head_dim), cos, sin, 1).view(B, S, -1)
        parts = [self.kv_a_layernorm(kv_pass), k_rot]
        if self.indexer is not None:
            parts.append(indexer_keys(self.indexer, hidden_states, cos, sin).to(k_rot.dtype))
        return [gather_issue(torch.cat(parts, dim=-1), self._prl_seq)]

    def attend_part(self, hidden_states, position_embeddings, keys: list, first: int, prev_topk_indices=None):
        """The attention of local queries first..first+S-1 (`hidden_states` [1, S, H], rope theirs) over the
        keys `keys_issue` started (landed by the first part that needs them): (output, None, top-k)."""
        seq = self._prl_seq
        B, S = hidden_states.shape[:2]
        cos, sin = position_embeddings
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_states = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rot = rotate_interleaved(q_rot, cos, sin, 1)
        if self.indexer is not None:
            iq, iw = indexer_queries(self.indexer, hidden_states, q_resid, cos, sin)
        if isinstance(keys[0], tuple):
            keys[0] = gather_land(keys[0], seq)  # [1, keys, kv_lora + rope (+ indexer key)]
        every = keys[0]
        allowed = seq.allowed(first, first + S)
        blocks = seq.blocks if (first, S) == (0, seq.positions.shape[0]) else part_blocks(seq, first, first + S)
        if self.indexer is not None:
            topk = select(self.indexer, iq, every[..., self.kv_lora_rank + self.qk_rope_head_dim:], iw, allowed, blocks)
        elif prev_topk_indices is not None:
            topk = prev_topk_indices
        else:
            raise ValueError("shared DSA layers need the top-k indices of a previous full indexer layer")
        rank = self.kv_lora_rank
        out = attend_sparse(self, q_pass, q_rot, every[0, :, :rank],
                            every[0, :, rank: rank + self.qk_rope_head_dim], topk, allowed, blocks)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1)), None, topk


def part_blocks(seq: Sequence, first: int, end: int) -> list[tuple[int, int, int]]:
    """`seq.blocks` cut to local queries first..end-1, counted from `first` (a part of a two-batch layer)."""
    out = []
    for a, b, _keys in seq.blocks:
        a, b = max(a, first), min(b, end)
        if a < b:
            out.append((a - first, b - first, seq.rows[b - 1] + 1))
    return out


def local_slice(mb: MicroBatch, seq: Sequence) -> tuple[MicroBatch, torch.Tensor, torch.Tensor]:
    """This rank's part of a packed micro-batch (`seq.layout`), the row's sample ids and the row index
    of each local token. The row is first padded to a multiple of `cp_multiple` (cp, or 2 x cp for
    zigzag) with loss-free one-token samples. Shared-prompt trees are not split over ranks: the
    resolver keeps `share_prompts` off under context parallelism, and a tree that comes anyway is refused."""
    if has_branches(mb.position_ids):
        raise ValueError("a shared-prompt row reached context parallelism (set trainer.share_prompts = false)")
    row = pad_row(mb, cp_multiple(seq.size, seq.layout))
    positions = shard_positions(row.input_ids.numel(), seq.rank, seq.size, seq.layout)
    return shard_sequence(row, seq.rank, seq.size, seq.layout), sample_ids(row.position_ids), positions
