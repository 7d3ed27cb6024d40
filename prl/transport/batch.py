"""What travels from the orchestrator to the trainer: samples packed into micro-batches.

A sample of prompt P and completion C becomes one stretch of a packed row: input ids P+C minus
the last token, targets shifted by one, a loss mask over the completion, and per loss token
the inference logprob, the advantage and the policy version that produced it. A multi-turn
completion interleaves model and environment tokens: `mask` says which are the model's (1, trained)
and which the environment's (0: tool results, feedback, template tokens; never trained, version -1). Position ids
restart at 0 for every sample, which is how the model keeps packed samples apart (with
`share_prompts`, a group's members become one tree over their prompt: `prl.transport.trees`). Packing is
first-fit-decreasing into bins of `max_tokens`; every rank gets the same number of micro-batches
(an empty one where needed) because each forward/backward under FSDP is a collective.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from prl.transport import trees
from prl.transport.trees import sample_ids


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # inference logprob of each completion token
    versions: list[int]  # policy version of each completion token
    advantage: float = 0.0
    reward: float = 0.0
    routing: torch.Tensor | None = None  # [num_tokens, MoE layers, k]: experts the engine used per input token
    mask: list[int] | None = None  # per completion token: 1 the model's (trained), 0 the environment's; None: all 1
    token_advantages: list[float] | None = None  # per completion token (per-turn credit); None: `advantage` for all
    teacher_logprobs: list[float] | None = None  # per completion token: the teacher's (teacher.mode = "loss")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1

    def model_versions(self) -> list[int]:
        """The policy versions of the model's tokens (environment tokens have none)."""
        if self.mask is None:
            return list(self.versions)
        return [v for v, m in zip(self.versions, self.mask) if m]


@dataclass
class MicroBatch:
    """One packed row of length L (tensors are 1-D over L)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    infer_logprobs: torch.Tensor
    versions: torch.Tensor  # -1 where no loss
    routing: torch.Tensor | None = None  # [L, MoE layers, k] (R3), None when not captured
    teacher_logprobs: torch.Tensor | None = None  # the teacher's logprob per token (0 where no loss), or None

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    step: int
    micro_batches: list[list[MicroBatch]]  # [rank][i]
    data_position: int = 0  # every prompt index below this one is trained or dropped (where a restart continues)
    data_ahead: list[int] = field(default_factory=list)  # indices at or past it trained or dropped already
    prompt_indices: list[int] = field(default_factory=list)  # the data indices of the batch's groups
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**asdict(self), "micro_batches": [[asdict(m) for m in rank] for rank in self.micro_batches]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainBatch":
        mbs = [[MicroBatch(**m) for m in rank] for rank in d["micro_batches"]]
        return cls(step=d["step"], micro_batches=mbs, data_position=d["data_position"], stats=d["stats"],
                   prompt_indices=d.get("prompt_indices", []), data_ahead=d.get("data_ahead", []))


class BadBatch(ValueError):
    """A batch the trainer cannot train; the message names what is wrong."""


def load_batch(data: bytes, step: int, world: int | None = None, vocab_size: int | None = None,
               trees_allowed: bool = True) -> TrainBatch:
    """Deserialize and check a batch as it arrives (the trainer endpoint refuses it with 400), so a
    malformed one never reaches the training loop, where it would kill every restart of the trainer."""
    import io

    try:
        batch = TrainBatch.from_dict(torch.load(io.BytesIO(data), weights_only=True))
    except Exception as e:  # noqa: BLE001 - anything unreadable is the sender's error
        raise BadBatch(f"not a prl batch ({type(e).__name__}: {str(e)[:200]})") from None
    if batch.step != step:
        raise BadBatch(f"batch for step {batch.step} sent as step {step}")
    if world is not None and len(batch.micro_batches) != world:
        raise BadBatch(f"packed for {len(batch.micro_batches)} ranks, the trainer has {world}")
    for r, rank in enumerate(batch.micro_batches):
        for i, mb in enumerate(rank):
            check_micro_batch(mb, f"rank {r} micro-batch {i}", vocab_size)
            if not trees_allowed and trees.has_branches(mb.position_ids):
                raise BadBatch(f"rank {r} micro-batch {i}: shared-prompt rows, and this trainer runs context "
                               "parallelism (the orchestrator must pack with share_prompts off)")
    return batch


def check_micro_batch(mb: MicroBatch, where: str, vocab_size: int | None) -> None:
    fields = {k: v for k, v in vars(mb).items() if k != "routing" and (v is not None or k != "teacher_logprobs")}
    for name, t in fields.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise BadBatch(f"{where}: {name} is not a 1-D tensor")
        if len(t) != len(mb.input_ids):
            raise BadBatch(f"{where}: {name} has {len(t)} entries, input_ids {len(mb.input_ids)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise BadBatch(f"{where}: {name} holds non-finite values")
    for name in ("input_ids", "target_ids", "position_ids"):
        t = fields[name]
        if t.is_floating_point() or (len(t) and int(t.min()) < 0):
            raise BadBatch(f"{where}: {name} must hold non-negative integers")
        if vocab_size and name != "position_ids" and len(t) and int(t.max()) >= vocab_size:
            raise BadBatch(f"{where}: {name} holds id {int(t.max())}, outside the vocabulary ({vocab_size})")
    if mb.routing is not None and (not isinstance(mb.routing, torch.Tensor) or mb.routing.dim() != 3
                                   or len(mb.routing) != len(mb.input_ids)):
        raise BadBatch(f"{where}: routing must be [tokens, MoE layers, k] with one row per input token")


def sample_arrays(s: Sample) -> dict[str, list]:
    seq = s.prompt_ids + s.completion_ids
    n, p = len(seq) - 1, len(s.prompt_ids)
    mask = s.mask if s.mask is not None else [1] * len(s.completion_ids)
    loss = [False] * (p - 1) + [bool(m) for m in mask]
    pad = [0.0] * (p - 1)
    return {
        "input_ids": seq[:-1],
        "position_ids": list(range(n)),
        "target_ids": seq[1:],
        "loss_mask": loss,
        "advantages": (pad + [a if m else 0.0 for a, m in zip(s.token_advantages, mask)] if s.token_advantages is not None
                       else [s.advantage if m else 0.0 for m in loss]),
        "infer_logprobs": pad + [lp if m else 0.0 for lp, m in zip(s.logprobs, mask)],
        "versions": [-1] * (p - 1) + [v if m else -1 for v, m in zip(s.versions, mask)],
        **({"teacher_logprobs": pad + [lp if m else 0.0 for lp, m in zip(s.teacher_logprobs, mask)]}
           if s.teacher_logprobs is not None else {}),
    }


DTYPES = {"input_ids": torch.long, "position_ids": torch.long, "target_ids": torch.long, "loss_mask": torch.bool,
          "advantages": torch.float32, "infer_logprobs": torch.float32, "versions": torch.long}


def make_micro_batch(units: list[list[Sample]]) -> MicroBatch:
    """One row of packing units: a unit of one sample is its own stretch, of several a shared-prompt
    tree (`prl.transport.trees`)."""
    if not units:  # an empty slot: one token, no loss, keeps the ranks' collectives in step
        return MicroBatch(**{k: torch.zeros(1, dtype=dt) for k, dt in DTYPES.items()})
    samples = [s for unit in units for s in unit]
    taught = any(s.teacher_logprobs is not None for s in samples)
    if taught and not all(s.teacher_logprobs is not None for s in samples):
        raise ValueError("a row mixes samples with and without the teacher's logprobs (teacher.mode = 'loss')")
    cols: dict[str, list] = {k: [] for k in (*DTYPES, *(["teacher_logprobs"] if taught else []))}
    for unit in units:
        for k, v in trees.tree_arrays(unit, sample_arrays).items():
            if k in cols:
                cols[k].extend(v)
    routing = None
    if all(s.routing is not None for s in samples):
        for s in samples:
            if s.routing.shape[0] != s.num_tokens:
                raise ValueError(f"routing covers {s.routing.shape[0]} tokens, the sample has {s.num_tokens}")
        routing = torch.cat([trees.tree_routing(unit) for unit in units])
    return MicroBatch(**{k: torch.tensor(v, dtype=DTYPES.get(k, torch.float32)) for k, v in cols.items()},
                      routing=routing)


def pad_row(mb: MicroBatch, multiple: int) -> MicroBatch:
    """The row grown to a multiple of `multiple` tokens with one-token samples that carry no loss,
    each what an empty slot holds (zeros; routing: experts 0..k-1, k distinct ids)."""
    pad = -mb.input_ids.numel() % multiple
    if not pad:
        return mb
    fields = {k: torch.cat([getattr(mb, k), torch.zeros(pad, dtype=dt)]) for k, dt in DTYPES.items()}
    if mb.teacher_logprobs is not None:
        fields["teacher_logprobs"] = torch.cat([mb.teacher_logprobs, torch.zeros(pad)])
    routing = mb.routing
    if routing is not None:
        ids = torch.arange(routing.shape[-1], dtype=routing.dtype).expand(pad, *routing.shape[1:])
        routing = torch.cat([routing, ids])
    return MicroBatch(**fields, routing=routing)


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `capacity`: first fit, longest first."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, load in enumerate(loads) if load + lengths[i] <= capacity), None)
        if b is None:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


ROW_WIDTHS = (1.0, 1.25, 1.5, 2.0)  # the widths `row_layout` weighs, as multiples of the longest sample


def row_layout(lengths: list[int], hidden_size: int | None) -> tuple[int, list[list[int]]]:
    """The width of the `[rows, width]` batch that packs `lengths` (first fit) at the least estimated
    cost, and its rows (indices of `lengths`): of the widths in `ROW_WIDTHS`, the one with the fewest
    padded tokens, each token weighed `1 + width / (6 hidden_size)` (a token's attention products
    against the rest of a layer, about 4 width hidden against 24 hidden^2 multiply-adds: an estimate,
    not a measurement); ties go to the narrower. Without `hidden_size`, the longest sample. On a batch
    shaped like reverse-tiny's (128 samples of 12-22 tokens) that is 70 rows of 34 (8% padding)
    instead of 128 of 23 (26%), and the forward-backward took 15% less time (a standalone run, medians
    of 18 steps)."""
    longest = max(lengths)
    widths = [longest] if hidden_size is None else [int(longest * k) for k in ROW_WIDTHS]
    def cost(layout: tuple[int, list[list[int]]]) -> float:  # one width without `hidden_size`: no cost to weigh
        width, rows = layout
        return len(rows) * width * (1 + width / (6 * hidden_size)) if hidden_size else 0.0
    return min(((width, first_fit(lengths, width)) for width in widths), key=cost)


def rows_by_sample(mb: MicroBatch, hidden_size: int | None = None) -> tuple[MicroBatch, int]:
    """The packed row's samples regrouped into rows of `row_layout`'s width (at least the longest
    sample's), each padded to that width with one-token samples that carry no loss (what `pad_row`
    adds), concatenated; and the width. The trainer runs them as a `[rows, width]` batch: attention
    (and GLM-5's DSA indexer) then costs rows x width^2 instead of the whole row squared (a 1,776-token
    row of 128 reverse-tiny samples: 128 x 17, a forward-backward 5x faster on CPU). A row whose
    longest sample is over half of it is returned as it is."""
    n = mb.input_ids.numel()
    lengths = torch.bincount(sample_ids(mb.position_ids)).tolist()
    if 2 * max(lengths) > n:
        return mb, n
    width, rows = row_layout(lengths, hidden_size)
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    index = []
    for row in rows:
        tokens = [t for i in row for t in range(starts[i], starts[i] + lengths[i])]
        index += tokens + [n] * (width - len(tokens))  # n: the padding token appended below
    index_t = torch.tensor(index, device=mb.input_ids.device)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        pad = torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)
        if t.dim() == 3:  # routing: experts 0..k-1 (k distinct ids), as pad_row
            pad = torch.arange(t.shape[-1], dtype=t.dtype, device=t.device).expand(1, *t.shape[1:])
        return torch.cat([t, pad])[index_t]

    return MicroBatch(**{k: take(v) for k, v in vars(mb).items()}), width


CP_LAYOUTS = ("zigzag", "contiguous")


def cp_multiple(size: int, layout: str) -> int:
    """What a context-parallel row is padded to: `size` slices, or for zigzag 2 x `size` chunks."""
    return 2 * size if layout == "zigzag" and size > 1 else size


def shard_positions(n: int, rank: int, size: int, layout: str = "contiguous") -> torch.Tensor:
    """The row indices of the tokens `rank` of `size` holds of an n-token row, in the order it holds
    them. contiguous: the rank-th of `size` slices. zigzag: the row cut into 2 x `size` chunks, and
    the rank holds chunk `rank` and its mirror 2 x size - 1 - rank, as many early tokens as late ones,
    so under causal attention every rank has about as many keys to score (n a multiple of 2 x size)."""
    if layout not in CP_LAYOUTS:
        raise ValueError(f"context-parallel layout {layout!r}: expected one of {', '.join(CP_LAYOUTS)}")
    if layout == "contiguous" or size == 1:
        return torch.arange(n * rank // size, n * (rank + 1) // size)
    if n % (2 * size):
        raise ValueError(f"a zigzag split over {size} ranks needs a row of a multiple of {2 * size} tokens, got {n}")
    h = n // (2 * size)
    mirror = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * h, (rank + 1) * h), torch.arange(mirror * h, (mirror + 1) * h)])


def shard_sequence(mb: MicroBatch, rank: int, size: int, layout: str = "contiguous") -> MicroBatch:
    """The tokens of a packed row that `rank` of `size` context-parallel ranks holds
    (`shard_positions`), every per-token tensor (routing included) taken at the same indices: the
    split a context-parallel trainer applies (to a row `pad_row` made a multiple of `cp_multiple`)."""
    idx = shard_positions(mb.input_ids.numel(), rank, size, layout)
    return MicroBatch(**{k: None if v is None else v[idx] for k, v in vars(mb).items()})


def unshard(parts: list[torch.Tensor], layout: str = "contiguous") -> torch.Tensor:
    """Per-token tensors of every rank's shard (in rank order) put back in row order: the inverse of
    `shard_sequence` (a loss or logprob per token, reassembled)."""
    n = sum(p.shape[0] for p in parts)
    order = torch.cat([shard_positions(n, r, len(parts), layout) for r in range(len(parts))])
    out = parts[0].new_empty(n, *parts[0].shape[1:])
    out[order] = torch.cat(parts)
    return out


def pack(samples: list[Sample], num_ranks: int, max_tokens: int, share_prompts: bool = False) -> list[list[MicroBatch]]:
    """Rows of at most `max_tokens` for each of `num_ranks` ranks, as many on each; with
    `share_prompts` the samples of one prompt go as trees over one copy of it (`prl.transport.trees`)."""
    longest = max((s.num_tokens for s in samples), default=0)
    if longest > max_tokens:
        raise ValueError(f"a sample of {longest} tokens exceeds trainer.micro_batch_tokens ({max_tokens})")
    units = trees.share_prompts(samples, max_tokens) if share_prompts else [[s] for s in samples]
    lengths = [trees.tree_tokens(u) for u in units]
    placed = first_fit(lengths, max_tokens)
    bins = [[units[i] for i in b] for b in placed]
    loads = [sum(lengths[i] for i in b) for b in placed]
    per_rank: list[list[list[list[Sample]]]] = [[] for _ in range(num_ranks)]
    rank_load = [0] * num_ranks
    for b, load in sorted(zip(bins, loads), key=lambda x: -x[1]):
        r = min(range(num_ranks), key=lambda r: (rank_load[r], len(per_rank[r])))
        per_rank[r].append(b)
        rank_load[r] += load
    depth = max(len(r) for r in per_rank)
    return [[make_micro_batch(b) for b in r + [[]] * (depth - len(r))] for r in per_rank]
