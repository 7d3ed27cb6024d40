"""Two-batch overlap (`trainer.parallel.overlap = "two_batch"`): each MoE layer runs its micro-batch as parts
(`overlap_parts`, two by default: halves), so that one part's attention, router and shared experts compute
while another part's rows are on the wire to or from the experts.

Within a layer the parts take turns (`ep_dispatch.interleave`, one generator each). With halves A and B:
A's attention and router run and its rows leave for the experts; its shared experts run while they travel;
B's attention and router run and its rows leave; A's rows land, its experts run and their outputs leave;
B's land, its experts run and theirs leave; B's shared experts run while they travel; both come back and
are summed in. Each exchange flies behind other compute (A's dispatch behind A's shared experts and B's
attention, B's behind A's experts, A's combine behind B's experts, B's behind B's shared experts); with more
parts every part but the last runs its shared experts early. Backward runs the autograd nodes in reverse
creation order (`prl.trainer.overlap`), which mirrors the schedule: each reverse exchange flies behind the
same compute's gradient.

The parts: without context parallelism the layer's `[rows, width]` batch (`prl.transport.batch.rows_by_sample`)
split into consecutive rows; under context parallelism the rank's local tokens split in consecutive runs
(halves under the zigzag layout: its two chunks), their keys computed and gathered once for the layer and
each part's queries attending over them (`ContextParallelAttention.keys_issue`, `attend_part`). A batch
with fewer rows than parts runs its attention whole and its experts in parts (`experts_in_halves`): every
rank of the ep group issues the same exchanges, whatever its own rows. Each part's counts travel on a process
group of their own (`Comm.meta`), so they never queue behind another part's rows in flight; with R3 each
part's router replays that part's ids (`prl.model.routing.tokens`). Everything else per token (norms,
router, experts, FP8 dispatch, node dedup) is the serial layer's, so a step equals the serial step (to fp32
rounding: tests/test_two_batch.py, with R3, activation checkpointing and cp 2 x ep 2). The lean forward runs
it (`prl.trainer.lean`); GLM-5 and Qwen3-MoE.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from prl.model import routing
from prl.model.lean_forward import attend, dense_mlp, rms_norm
from prl.trainer.context_parallel import ContextParallelAttention
from prl.trainer.ep_dispatch import interleave
from prl.trainer.expert_parallel import ExpertParallel


SPLIT: Counter = Counter()  # layer forwards in two halves ("split") or with the experts alone in halves ("experts")


@dataclass(frozen=True)
class Half:
    """One part of a layer's tokens (a half, with two): rows a..b-1 of a `[rows, width, H]` batch (`dim` 0), or
    tokens a..b-1 of the one packed row a context-parallel rank holds (`dim` 1)."""

    dim: int
    a: int
    b: int
    width: int  # tokens per row (dim 0); 1 under context parallelism

    def take(self, t):
        if t is None:
            return None
        return t[self.a: self.b] if self.dim == 0 else t[:, self.a: self.b]

    @property
    def tokens(self) -> tuple[int, int]:
        """The half's tokens in the micro-batch's token order (R3's replayed ids)."""
        return self.a * self.width, self.b * self.width


def halves(h: torch.Tensor, cp: bool, n: int = 2) -> list[Half] | None:
    """The `n` parts (two: halves) of `h` ([rows, width, H]; one row under context parallelism) the attention runs
    on; None where it has fewer rows (tokens) than parts: the attention then runs whole and only the experts in
    parts."""
    size = h.shape[1] if cp else h.shape[0]
    return None if size < n else even_parts(size, n, 1 if cp else 0, 1 if cp else h.shape[1])


def token_halves(size: int, n: int = 2) -> list[Half]:
    """The `n` parts of `size` tokens in a row ([size, H]); some empty for fewer tokens (their exchanges still run:
    every rank of the ep group issues the same ones, whatever its tokens)."""
    return even_parts(size, n, 0, 1)


def even_parts(size: int, n: int, dim: int, width: int) -> list[Half]:
    """`size` rows (tokens) along `dim` in `n` consecutive parts, as even as they divide."""
    return [Half(dim, size * i // n, size * (i + 1) // n, width) for i in range(n)]


def splittable(layer) -> bool:
    """The layer's MLP is routed experts split by expert parallelism (the exchanges the halves hide)."""
    return isinstance(getattr(layer.mlp, "experts", None), ExpertParallel)


def moe_half(layer, h: torch.Tensor, x: torch.Tensor, half: Half, early: bool):
    """A generator: the MoE block of one half (`x` its post-attention norm, `h` its residual), yielding while
    its rows travel; returns the layer's output for the half. `early`: its shared experts run while its rows
    go to the experts (half A), else while they come back (half B)."""
    flat = x.reshape(-1, x.shape[-1])
    with routing.tokens(*half.tokens):
        _, weights, ids = layer.mlp.gate(flat)
    shared_mlp = getattr(layer.mlp, "shared_experts", None)
    shared: list = []

    def run_shared() -> None:
        shared.append(0 if shared_mlp is None else dense_mlp(shared_mlp, x))

    moe = layer.mlp.experts.two_batch(flat, ids, weights, last=None if early else run_shared)
    next(moe)  # the counts exchanged, the rows on their way to the experts
    if early:
        run_shared()
    yield
    out = yield from moe
    return h + (out.view(x.shape) + shared[0])


def glm_moe_dsa_layer(layer, h: torch.Tensor, rope, mask, positions: torch.Tensor, topk, n: int = 2):
    """One GLM-5 MoE decoder layer in `n` parts: (hidden states, DSA selection), or None where the layer has no
    experts split by expert parallelism (the caller runs it whole)."""
    if not splittable(layer):
        return None
    cp = isinstance(layer.self_attn, ContextParallelAttention) and mask is None
    x_in = rms_norm(layer.input_layernorm, h)
    parts = halves(h, cp, n)
    SPLIT["split" if parts else "experts"] += 1
    if parts is None:  # the attention whole, the experts in halves
        out, _, topk = layer.self_attn(x_in, rope, mask, None, positions, topk)
        return experts_in_halves(layer, h + out, n), topk
    keys = layer.self_attn.keys_issue(x_in, rope) if cp else None  # every local token's, gathered once

    def job(i: int, half: Half):
        cut = half.take
        part_rope = (cut(rope[0]), cut(rope[1]))
        if cp:
            out, _, part_topk = layer.self_attn.attend_part(cut(x_in), part_rope, keys, half.a, cut(topk))
        else:
            out, _, part_topk = layer.self_attn(cut(x_in), part_rope, cut(mask), None, cut(positions), cut(topk))
        hh = cut(h) + out
        hh = yield from moe_half(layer, hh, rms_norm(layer.post_attention_layernorm, hh), half, i < len(parts) - 1)
        return hh, part_topk

    done = interleave([job(i, p) for i, p in enumerate(parts)], len(parts))
    dim = parts[0].dim
    topks = [t for _, t in done]
    return torch.cat([o for o, _ in done], dim), None if topks[0] is None else torch.cat(topks, dim)


def experts_in_halves(layer, h: torch.Tensor, n: int) -> torch.Tensor:
    """The MoE block (and residual) of a layer whose attention ran whole, on `n` parts of its tokens."""
    flat = h.reshape(-1, h.shape[-1])
    jobs = [moe_half(layer, half.take(flat), rms_norm(layer.post_attention_layernorm, half.take(flat)), half,
                     i < n - 1) for i, half in enumerate(token_halves(flat.shape[0], n))]
    return torch.cat(interleave(jobs, n)).view(h.shape)


def qwen3_moe_layer(layer, h: torch.Tensor, rope, bias: torch.Tensor, n: int = 2):
    """One Qwen3-MoE decoder layer in `n` parts of its rows; None where the layer has no experts split by
    expert parallelism."""
    if not splittable(layer):
        return None
    parts = halves(h, False, n)
    SPLIT["split" if parts else "experts"] += 1
    if parts is None:
        return experts_in_halves(layer, h + attend(layer.self_attn, rms_norm(layer.input_layernorm, h), rope, bias), n)

    def job(i: int, half: Half):
        cut = half.take
        hh = cut(h) + attend(layer.self_attn, rms_norm(layer.input_layernorm, cut(h)), (cut(rope[0]), cut(rope[1])),
                             cut(bias))
        return (yield from moe_half(layer, hh, rms_norm(layer.post_attention_layernorm, hh), half, i < len(parts) - 1))

    return torch.cat(interleave([job(i, p) for i, p in enumerate(parts)], len(parts)), 0)
