"""What travels from the orchestrator to the trainer: samples packed into micro-batches.

A sample of prompt P and completion C becomes one stretch of a packed row: input ids P+C minus
the last token, targets shifted by one, a loss mask over the completion, and per loss token
the inference logprob, the advantage and the policy version that produced it. Position ids
restart at 0 for every sample, which is how the model keeps packed samples apart. Packing is
first-fit-decreasing into bins of `max_tokens`; every rank gets the same number of micro-batches
(an empty one where needed) because each forward/backward under FSDP is a collective.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # inference logprob of each completion token
    versions: list[int]  # policy version of each completion token
    advantage: float = 0.0
    reward: float = 0.0
    routing: torch.Tensor | None = None  # [num_tokens, MoE layers, k]: experts the engine used per input token

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1


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

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    step: int
    micro_batches: list[list[MicroBatch]]  # [rank][i]
    data_position: int = 0  # prompts consumed up to this batch (for resume)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**asdict(self), "micro_batches": [[asdict(m) for m in rank] for rank in self.micro_batches]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainBatch":
        mbs = [[MicroBatch(**m) for m in rank] for rank in d["micro_batches"]]
        return cls(step=d["step"], micro_batches=mbs, data_position=d["data_position"], stats=d["stats"])


def sample_arrays(s: Sample) -> dict[str, list]:
    seq = s.prompt_ids + s.completion_ids
    n, p = len(seq) - 1, len(s.prompt_ids)
    loss = [i >= p - 1 for i in range(n)]
    pad = [0.0] * (p - 1)
    return {
        "input_ids": seq[:-1],
        "position_ids": list(range(n)),
        "target_ids": seq[1:],
        "loss_mask": loss,
        "advantages": [s.advantage if m else 0.0 for m in loss],
        "infer_logprobs": pad + list(s.logprobs),
        "versions": [-1] * (p - 1) + list(s.versions),
    }


DTYPES = {"input_ids": torch.long, "position_ids": torch.long, "target_ids": torch.long, "loss_mask": torch.bool,
          "advantages": torch.float32, "infer_logprobs": torch.float32, "versions": torch.long}


def make_micro_batch(samples: list[Sample]) -> MicroBatch:
    if not samples:  # an empty slot: one token, no loss, keeps the ranks' collectives in step
        return MicroBatch(**{k: torch.zeros(1, dtype=dt) for k, dt in DTYPES.items()})
    cols: dict[str, list] = {k: [] for k in DTYPES}
    for s in samples:
        for k, v in sample_arrays(s).items():
            cols[k].extend(v)
    routing = None
    if all(s.routing is not None for s in samples):
        for s in samples:
            if s.routing.shape[0] != s.num_tokens:
                raise ValueError(f"routing covers {s.routing.shape[0]} tokens, the sample has {s.num_tokens}")
        routing = torch.cat([s.routing for s in samples])
    return MicroBatch(**{k: torch.tensor(v, dtype=DTYPES[k]) for k, v in cols.items()}, routing=routing)


def shard_sequence(mb: MicroBatch, rank: int, size: int) -> MicroBatch:
    """The `rank`-th of `size` contiguous chunks of a packed row, every per-token tensor (routing
    included) cut at the same places: the split a context-parallel trainer applies."""
    n = mb.input_ids.numel()
    bounds = [n * i // size for i in range(size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    return MicroBatch(**{k: None if v is None else v[lo:hi] for k, v in vars(mb).items()})


def pack(samples: list[Sample], num_ranks: int, max_tokens: int) -> list[list[MicroBatch]]:
    bins: list[list[Sample]] = []
    loads: list[int] = []
    for s in sorted(samples, key=lambda s: -s.num_tokens):
        if s.num_tokens > max_tokens:
            raise ValueError(f"a sample of {s.num_tokens} tokens exceeds trainer.micro_batch_tokens ({max_tokens})")
        i = next((i for i, load in enumerate(loads) if load + s.num_tokens <= max_tokens), None)
        if i is None:
            bins.append([])
            loads.append(0)
            i = len(bins) - 1
        bins[i].append(s)
        loads[i] += s.num_tokens
    per_rank: list[list[list[Sample]]] = [[] for _ in range(num_ranks)]
    rank_load = [0] * num_ranks
    for b, load in sorted(zip(bins, loads), key=lambda x: -x[1]):
        r = min(range(num_ranks), key=lambda r: (rank_load[r], len(per_rank[r])))
        per_rank[r].append(b)
        rank_load[r] += load
    depth = max(len(r) for r in per_rank)
    return [[make_micro_batch(b) for b in r + [[]] * (depth - len(r))] for r in per_rank]
