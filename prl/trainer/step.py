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
from prl.model.policy import Reference
from prl.trainer.context_parallel import local_slice
from prl.trainer.loss import rl_loss, sequence_count, sft_loss
from prl.trainer.overlap import CLOCK
from prl.transport import trees
from prl.transport.batch import MicroBatch, rows_by_sample


def forward_backward(model, replay, mbs: list[MicroBatch], kind: str, tcfg: TrainerCfg, temperature: float,
                     device: torch.device, seq=None, norm_constant: float | None = None,
                     reference: Reference | None = None, teacher_kl: tuple[float, str] = (0.0, "k2")
                     ) -> dict[str, float]:
    """Accumulate gradients over this rank's micro-batches; returns stats summed over all ranks.
    With context parallelism (`seq`), this rank computes its part of each micro-batch (`seq.layout`).
    `norm_constant`: the divisor of trainer.loss.normalize = "constant"; `reference`: the frozen
    reference policy of trainer.loss.kl_coef (parallelized as `model`; under LoRA `model` itself, adapters
    off: `prl.model.policy`), its forward without gradient; `teacher_kl`: the (weight, estimator) of the KL to the
    teacher whose logprobs the batch carries (teacher.mode = "loss")."""
    rows = [local_slice(mb, seq) if seq is not None else (mb, None, None) for mb in mbs]
    mode = tcfg.loss.normalization() if kind == "rl" else "token"
    divisor = step_divisor(rows, mode, norm_constant, device)
    # FSDP averages gradients over `grad_divisor` ranks: undo it, so the step's loss is one sum / divisor
    scale = tcfg.parallel.dims(dist.get_world_size()).grad_divisor / divisor
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
            ref = None
            if kind == "rl" and reference is not None:  # first: the policy's forward then runs last before backward
                # the reference routes by itself (R3 replays the sampled routes into the policy alone)
                with torch.no_grad(), replay.paused() if replay else contextlib.nullcontext(), reference.within():
                    ref = token_outputs(reference.model, mb, width, seq, temperature, tcfg.logprob_chunk_tokens)[:, 0]
            per_token = token_outputs(model, mb, width, seq, temperature, tcfg.logprob_chunk_tokens, kind == "rl")
            if kind == "rl":
                loss_sum, stats = rl_loss(per_token[:, 0], mb, tcfg.loss, per_token[:, 1], ref, teacher_kl=teacher_kl)
            else:
                loss_sum, stats = sft_loss(per_token[:, 0], mb)
            if replay:
                stats["routing_agreed"], stats["routing_ids"] = map(torch.tensor, replay.agreement())
            CLOCK.mark()
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
    return {**dict(zip(keys, packed.tolist())), "loss_divisor": divisor}


def token_outputs(model, mb: MicroBatch, width: int, seq, temperature: float, chunk: int,
                  entropy: bool = False) -> torch.Tensor:
    """[L, 1] logprobs of mb's targets ([L, 2] with each token's entropy), in mb's token order."""
    with head.targets(model, mb.target_ids, temperature, chunk, entropy=entropy):
        position_ids = mb.position_ids.view(-1, width)
        mask = trees.attention_mask(model, position_ids) if seq is None else None  # CP: its own masks
        out = model(input_ids=mb.input_ids.view(-1, width), position_ids=position_ids, attention_mask=mask,
                    use_cache=False)
    return out.logits.reshape(-1, out.logits.shape[-1])


def step_divisor(rows, mode: str, constant: float | None, device) -> float:
    """What the step's summed loss is divided by, over all ranks: its loss tokens, its samples with loss
    tokens ("sequence"), or `constant`."""
    if mode == "constant":
        if not constant:
            raise ValueError("trainer.loss.normalize = 'constant' needs the trainer's constant divisor")
        return float(constant)
    count = (lambda mb: float(mb.loss_tokens)) if mode == "token" else sequences_with_loss
    local = torch.tensor(sum(count(mb) for mb, _, _ in rows), device=device, dtype=torch.float64)
    dist.all_reduce(local)
    return max(float(local), 1.0)


def sequences_with_loss(mb: MicroBatch) -> float:
    return float(sequence_count(mb.loss_mask, trees.segment_ids(mb.position_ids)))
