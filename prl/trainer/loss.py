"""Losses over packed micro-batches, summed over loss tokens (the caller normalises).

RL loss per completion token t, with d_t = logp_train - logp_infer and ratio_t = exp(d_t):
    tis           : -min(ratio_t, C) * A * logp_train      (truncated importance sampling)
    clip (default): PPO's clipped objective against the sampling policy: as tis, but a token whose
                    ratio is already past 1 + clip_high (A > 0) or below 1 - clip_low (A < 0) gets no
                    gradient: an update made since sampling has moved it far enough
    mask          : -1[low <= ratio_t <= high] * A * logp_train   (tokens outside the band masked)
    seq_mask      : -1[low <= exp(mean_seq d) <= high] * A * logp_train (whole sequences masked by
                    their geometric-mean ratio)
    none          : -A * logp_train
The weights are detached, so the gradient is that of the importance-weighted policy gradient.
The caller divides the summed loss by the loss tokens of the whole step across all ranks.
"""

from __future__ import annotations

import torch

from prl.recipe.schema import LossCfg
from prl.transport.batch import MicroBatch
from prl.transport.trees import segment_ids


def token_logprobs(logits_LV: torch.Tensor, targets_L: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp_LV = torch.log_softmax(logits_LV.float() / temperature, dim=-1)
    return logp_LV.gather(-1, targets_L[:, None])[:, 0]


def mismatch_stats(logp_L: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Sums over loss tokens: k3 KL estimate exp(d)-d-1 and |d| > ln 2 counts (d = train - infer).

    In float64: exp(d)-d-1 of a tiny d is lost to rounding in float32."""
    mask = mb.loss_mask
    d = (logp_L.detach().double() - mb.infer_logprobs.double())[mask]
    return {
        "mismatch_kl": (torch.exp(d) - d - 1).sum(),
        "extreme_tokens": (d.abs() > 0.6931).sum().float(),
        "loss_tokens": mask.sum().float(),
    }


def rl_loss(logp_L: torch.Tensor, mb: MicroBatch, cfg: LossCfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mb.loss_mask
    ratio = torch.exp(logp_L.detach() - mb.infer_logprobs)
    if cfg.correction == "tis":
        weight, keep = ratio.clamp(max=cfg.tis_cap), mask
    elif cfg.correction == "clip":
        adv = mb.advantages
        past = ((adv > 0) & (ratio > 1 + cfg.clip_high)) | ((adv < 0) & (ratio < 1 - cfg.clip_low))
        weight, keep = ratio.clamp(max=cfg.tis_cap), mask & ~past
    elif cfg.correction == "mask":
        weight, keep = torch.ones_like(ratio), mask & (ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)
    elif cfg.correction == "seq_mask":
        seq_ratio = sequence_ratio(logp_L.detach() - mb.infer_logprobs, mb)
        weight, keep = torch.ones_like(ratio), mask & (seq_ratio >= cfg.mask_low) & (seq_ratio <= cfg.mask_high)
    else:
        weight, keep = torch.ones_like(ratio), mask
    loss_sum = -(weight * mb.advantages * logp_L)[keep].sum()
    stats = mismatch_stats(logp_L, mb)
    stats["masked_tokens"] = (mask & ~keep).sum().float()
    capped = cfg.correction in ("tis", "clip")
    stats["truncated_tokens"] = ((ratio > cfg.tis_cap) & keep).sum().float() if capped else 0 * stats["loss_tokens"]
    return loss_sum, stats


def sequence_ratio(d_L: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """exp(mean of d over each packed sample's loss tokens), broadcast back to its tokens (a member of
    a shared-prompt tree is its branch: its root carries no loss)."""
    seg = segment_ids(mb.position_ids)
    n = int(seg.max()) + 1
    m = mb.loss_mask.float()
    sums = torch.zeros(n, dtype=d_L.dtype).scatter_add(0, seg, d_L * m)
    counts = torch.zeros(n, dtype=d_L.dtype).scatter_add(0, seg, m)
    return torch.exp(sums / counts.clamp(min=1))[seg]


def sft_loss(logp_L: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mb.loss_mask
    return -logp_L[mask].sum(), {"loss_tokens": mask.sum().float()}
