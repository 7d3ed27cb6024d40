"""One rank's share of a training step: forward and backward over its micro-batches.

Kept apart from the trainer's process wiring so tests can run exactly this under any parallel
layout and compare losses and gradients. Rules: the loss is normalised by the loss tokens of the
whole step across all ranks (FSDP then averages gradients over ranks, hence the factor
`ParallelDims.grad_divisor`);
logprobs come from the chunked head (`prl.trainer.head`), never from full logits; with R3 the
micro-batch's routing is replayed; without context parallelism a packed row of short samples runs
as a `[rows, width]` batch of first-fit rows a little wider than the longest sample
(`prl.transport.batch.rows_by_sample`, `row_layout`), so attention and the DSA indexer cost about each
sample's square, not the whole row's; a row holding shared-prompt trees (`prl.transport.trees`) gets
their attention mask.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from prl.recipe.schema import TrainerCfg
from prl.trainer import context_parallel as cp
from prl.trainer import head
from prl.trainer.context_parallel import local_slice
from prl.trainer.loss import rl_loss, sft_loss
from prl.transport import trees
from prl.transport.batch import MicroBatch, rows_by_sample


def forward_backward(model, replay, mbs: list[MicroBatch], kind: str, tcfg: TrainerCfg, temperature: float,
                     device: torch.device, seq=None) -> dict[str, float]:
    """Accumulate gradients over this rank's micro-batches; returns stats summed over all ranks.
    With context parallelism (`seq`), this rank computes its part of each micro-batch (`seq.layout`)."""
    rows = [local_slice(mb, seq) if seq is not None else (mb, None, None) for mb in mbs]
    local_tokens = torch.tensor(float(sum(mb.loss_tokens for mb, _, _ in rows)), device=device)
    dist.all_reduce(local_tokens)
    # FSDP averages gradients over `grad_divisor` ranks: undo it, so the step's loss is one sum / tokens
    scale = tcfg.parallel.dims(dist.get_world_size()).grad_divisor / max(float(local_tokens), 1.0)
    totals: dict[str, torch.Tensor] = {}
    for mb, segments, positions in rows:
        tokens = mb.input_ids.numel()
        # without CP, a row of short samples runs as [rows, width]: attention about per sample
        mb, width = rows_by_sample(mb, model.config.hidden_size) if seq is None else (mb, mb.input_ids.numel())
        mb = MicroBatch(**{k: None if v is None else v.to(device) for k, v in vars(mb).items()})
        # the replayed ids and the CP row stay set through backward: activation checkpointing reruns
        # the routers and the attention there
        with (replay.use(mb.routing) if replay else contextlib.nullcontext(),
              cp.sequence(seq, segments.to(device), positions.to(device)) if seq is not None else contextlib.nullcontext()):
            with head.targets(model, mb.target_ids, temperature, tcfg.logprob_chunk_tokens):
                position_ids = mb.position_ids.view(-1, width)
                mask = trees.attention_mask(model, position_ids) if seq is None else None  # CP: its own masks
                out = model(input_ids=mb.input_ids.view(-1, width), position_ids=position_ids,
                            attention_mask=mask, use_cache=False)
            logp = out.logits.reshape(-1)  # the head's [1, L, 1] logprobs, in the order of mb's tokens
            loss_sum, stats = rl_loss(logp, mb, tcfg.loss) if kind == "rl" else sft_loss(logp, mb)
            if replay:
                stats["routing_agreed"], stats["routing_ids"] = map(torch.tensor, replay.agreement())
            (loss_sum * scale).backward()
            if replay:
                replay.agreement()  # what the recomputation counted again
        stats["loss_sum"] = loss_sum.detach()
        stats["tokens"] = torch.tensor(float(tokens))  # the packed row's, without the padding
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v.detach().float().to(device)
    keys = sorted(totals)
    packed = torch.stack([totals[k] for k in keys])
    dist.all_reduce(packed)
    return dict(zip(keys, packed.tolist()))
