"""RL objectives over packed micro-batches: a per-token loss, summed (the trainer divides).

With d_t = logp_t - logp_infer_t (the trainer's logprob minus that of the policy that sampled the
token: in an async run, the policy "old" means), ratio_t = exp(d_t), A_t the advantage, sg[.] a
stopped gradient, and a sample i's loss tokens y_i:
    tis        : -sg[min(ratio_t, C)] A_t logp_t                        (truncated importance sampling)
    clip       : as tis, but a token whose ratio is already past 1 + clip_high (A > 0) or below
                 1 - clip_low (A < 0) gets no gradient (PPO's clip against the sampling policy)
    cispo      : -sg[clip(ratio_t, 1 - eps_low, 1 + eps_high)] A_t logp_t   (CISPO, MiniMax-M1: every
                 token keeps its gradient; eps_low = 1, eps_high = C - 1 is tis)
    gspo       : s_i = exp(mean_{t in y_i} d_t), per sample: -min(s_i A_i, clip(s_i, 1 - e_low, 1 + e_high) A_i)
                 (GSPO, Qwen: one ratio per sample, so one token's expert flip does not blow up its ratio;
                 every token of y_i carries it, and "sequence" normalisation makes it the paper's mean)
    gspo_token : s_i,t = sg[s_i] exp(logp_t - sg[logp_t]), -min(s_i,t A_t, clip(s_i,t) A_t) (GSPO-token:
                 the value of s_i, each token's own advantage and gradient; "sequence" normalisation
                 makes it the paper's per-sample mean)
    mask       : -1[low <= ratio_t <= high] A_t logp_t   (tokens outside the band masked)
    seq_mask   : -1[low <= exp(mean_{y_i} d) <= high] A_t logp_t (whole samples masked)
    none       : -A_t logp_t
plus, on every loss token (also those the objective drops), -entropy_coef H_t (an entropy bonus) and
kl_coef KL_t (a KL estimate to a frozen reference policy: `kl_to_reference`). A user's objective
("module:function") gets a `LossBatch` and `LossCfg` and returns the per-token loss (or it and a
dict of figures to sum and log). An objective whose tokens read their sample's mean (seq_mask, gspo,
gspo_token) declares it (`whole_samples`), and context parallelism is refused for it. A log-ratio
whose exp() would overflow float32 is bounded at LOG_RATIO_BOUND (`sequence_ratio`, k3).

Normalisation (`LossCfg.normalization`): "token" sums the per-token loss and the trainer divides by
the step's loss tokens; "sequence" weighs each token by 1 / its sample's loss tokens and the trainer
divides by the step's samples; "constant" sums, the trainer divides by a fixed count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prl.recipe.schema import BUILTIN_OBJECTIVES, LossCfg
from prl.tasks import import_function
from prl.transport.batch import MicroBatch
from prl.transport.trees import segment_ids


@dataclass
class LossBatch:
    """What an objective gets: one entry per token of a packed micro-batch (float tensors [L])."""

    logp: torch.Tensor  # the policy's logprob of each token, with its gradient
    infer_logp: torch.Tensor  # the logprob under the policy that sampled it (no gradient)
    advantages: torch.Tensor  # per token (a sample's, or its turn's)
    mask: torch.Tensor  # bool: a loss token (the model's, not stale-masked); the rest is context
    sequence_ids: torch.Tensor  # long: the packed sample (or shared-prompt branch) each token belongs to
    entropy: torch.Tensor | None = None  # the policy's entropy at each token (None where not computed)
    ref_logp: torch.Tensor | None = None  # the reference policy's logprob (trainer.loss.kl_coef > 0), no gradient


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


# ---- the objectives: (LossBatch, LossCfg) -> (per-token loss, tokens that keep a gradient) ----
LOG_RATIO_BOUND = 20.0  # exp() of a log-ratio past this is bounded (float32's exp overflows past 88.7)

BUILTIN: dict[str, Callable] = {}


def builtin(name: str, *, whole_samples: bool):
    """Register a built-in objective under `name`. `whole_samples`: its tokens read their sample's mean
    log-ratio, so a rank must hold every token of a sample (context parallelism is refused for it). A
    user's objective declares the same as a function attribute (`fn.whole_samples = True`)."""
    def register(fn: Callable) -> Callable:
        fn.whole_samples = whole_samples
        BUILTIN[name] = fn
        return fn
    return register


def needs_whole_samples(fn: Callable) -> bool:
    return bool(getattr(fn, "whole_samples", False))


def ratio_of(b: LossBatch) -> torch.Tensor:
    return torch.exp(b.logp.detach() - b.infer_logp)


@builtin("tis", whole_samples=False)
def tis(b: LossBatch, cfg: LossCfg):
    return -ratio_of(b).clamp(max=cfg.tis_cap) * b.advantages * b.logp, b.mask


@builtin("clip", whole_samples=False)
def clip(b: LossBatch, cfg: LossCfg):
    ratio, adv = ratio_of(b), b.advantages
    past = ((adv > 0) & (ratio > 1 + cfg.clip_high)) | ((adv < 0) & (ratio < 1 - cfg.clip_low))
    return -ratio.clamp(max=cfg.tis_cap) * adv * b.logp, b.mask & ~past


@builtin("cispo", whole_samples=False)
def cispo(b: LossBatch, cfg: LossCfg):
    weight = ratio_of(b).clamp(min=1 - cfg.cispo_clip_low, max=1 + cfg.cispo_clip_high)
    return -weight * b.advantages * b.logp, b.mask


@builtin("mask", whole_samples=False)
def band_mask(b: LossBatch, cfg: LossCfg):
    ratio = ratio_of(b)
    return -b.advantages * b.logp, b.mask & (ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)


@builtin("seq_mask", whole_samples=True)
def seq_mask(b: LossBatch, cfg: LossCfg):
    seq_ratio = torch.exp(sequence_mean(b.logp.detach() - b.infer_logp, b))
    return -b.advantages * b.logp, b.mask & (seq_ratio >= cfg.mask_low) & (seq_ratio <= cfg.mask_high)


@builtin("none", whole_samples=False)
def plain(b: LossBatch, cfg: LossCfg):
    return -b.advantages * b.logp, b.mask


@builtin("gspo", whole_samples=True)
def gspo(b: LossBatch, cfg: LossCfg):
    return clipped_surrogate(sequence_ratio(b.logp - b.infer_logp, b), b.advantages, cfg), b.mask


@builtin("gspo_token", whole_samples=True)
def gspo_token(b: LossBatch, cfg: LossCfg):
    s = sequence_ratio(b.logp.detach() - b.infer_logp, b) * torch.exp(b.logp - b.logp.detach())
    return clipped_surrogate(s, b.advantages, cfg), b.mask


def sequence_ratio(d_L: torch.Tensor, b: LossBatch) -> torch.Tensor:
    """exp(each sample's mean log-ratio), on its tokens; a mean past LOG_RATIO_BOUND is held there (no
    gradient beyond it: exp would overflow to inf, and inf x 0 is NaN in backward even for a clipped sample)."""
    return torch.exp(sequence_mean(d_L, b).clamp(max=LOG_RATIO_BOUND))


def clipped_surrogate(s: torch.Tensor, adv: torch.Tensor, cfg: LossCfg) -> torch.Tensor:
    """-min(s A, clip(s, 1 - gspo_clip_low, 1 + gspo_clip_high) A), per token."""
    return -torch.minimum(s * adv, s.clamp(1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high) * adv)


def per_sample(values_L: torch.Tensor, b: LossBatch) -> torch.Tensor:
    """The sum of `values` over each sample's loss tokens, one entry per sample (differentiable)."""
    n = int(b.sequence_ids.max()) + 1
    zeros = torch.zeros(n, dtype=values_L.dtype, device=values_L.device)
    return zeros.index_add(0, b.sequence_ids, torch.where(b.mask, values_L, 0))


def sequence_mean(values_L: torch.Tensor, b: LossBatch) -> torch.Tensor:
    """The mean of `values` over each sample's loss tokens, broadcast back to its tokens (differentiable)."""
    return (per_sample(values_L, b) / sequence_tokens(b, values_L.dtype))[b.sequence_ids]


assert set(BUILTIN) == set(BUILTIN_OBJECTIVES)


USER_FIGURE = "objective_"  # a user objective's figures, summed over the step, logged under this prefix


class ObjectiveError(ValueError):
    """A user's objective cannot be used; the message names `trainer.loss.correction`."""


@functools.cache
def objective(name: str) -> Callable:
    """The function `trainer.loss.correction` names."""
    if name in BUILTIN:
        return BUILTIN[name]
    try:
        return import_function(name, "trainer.loss.correction")
    except ValueError as e:
        raise ObjectiveError(str(e)) from None


def user_terms(fn: Callable, b: LossBatch, cfg: LossCfg):
    """A user's objective's per-token loss, its extra figures, checked (an ObjectiveError naming the key)."""
    out = fn(b, cfg)
    loss_L, extra = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss_L, torch.Tensor) or loss_L.shape != b.logp.shape or not loss_L.requires_grad:
        shape = tuple(loss_L.shape) if isinstance(loss_L, torch.Tensor) else type(loss_L).__name__
        raise ObjectiveError(f"trainer.loss.correction = {cfg.correction!r} must return the per-token loss, a tensor "
                             f"of shape {tuple(b.logp.shape)} with a gradient from batch.logp; got {shape}")
    return loss_L, b.mask, {f"{USER_FIGURE}{k}": torch.as_tensor(v, dtype=torch.float32).detach() for k, v in extra.items()}


def check_objective(cfg: LossCfg, cp: int = 1) -> None:
    """The objective can train this run: a user's imports and, on two small samples with the fields the run
    provides (entropy always, the reference's logprobs with kl_coef > 0), returns a per-token loss; one whose
    tokens read their sample's mean needs cp = 1. Else an ObjectiveError naming the key."""
    fn = objective(cfg.correction)
    if why := layout_refusal(cfg.correction, fn, cp):
        raise ObjectiveError(why)
    if cfg.correction in BUILTIN:
        return
    try:
        user_terms(fn, probe_batch(cfg), cfg)
    except ObjectiveError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code, named in one line
        raise ObjectiveError(f"trainer.loss.correction = {cfg.correction!r} failed on a small batch: "
                             f"{type(e).__name__}: {e}") from None


def layout_refusal(name: str, fn: Callable, cp: int) -> str | None:
    """Why objective `fn` (`trainer.loss.correction = name`) cannot train with `cp` context-parallel ranks."""
    if cp > 1 and needs_whole_samples(fn):
        return (f"trainer.loss.correction = {name!r} needs trainer.parallel.cp = 1: it reads each sample's mean "
                f"log-ratio, and a rank holds only part of a sample under context parallelism")
    return None


def probe_batch(cfg: LossCfg) -> LossBatch:
    """Two samples of three tokens (the first of each context), with every field a run fills."""
    logp = torch.full((6,), -1.0, requires_grad=True)
    ref = torch.full((6,), -0.9) if cfg.kl_coef > 0 else None
    return LossBatch(logp, torch.full((6,), -1.1), torch.tensor([0.5] * 3 + [-0.5] * 3),
                     torch.tensor([False, True, True, False, True, True]), torch.tensor([0, 0, 0, 1, 1, 1]),
                     entropy=torch.full((6,), 2.0, requires_grad=True), ref_logp=ref)


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, mask: torch.Tensor) -> torch.Tensor:
    """Per loss token (0 elsewhere), with r = log pi_ref - log pi: k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1.
    k3 past r = LOG_RATIO_BOUND continues as its tangent there (finite, the same sign of gradient)."""
    r = torch.where(mask, ref_logp - logp, 0)
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    e = torch.exp(r.clamp(max=LOG_RATIO_BOUND))
    return e - r - 1 + (r - LOG_RATIO_BOUND).clamp(min=0) * e


def rl_loss(logp_L: torch.Tensor, mb: MicroBatch, cfg: LossCfg, entropy_L: torch.Tensor | None = None,
            ref_logp_L: torch.Tensor | None = None, teacher_kl: tuple[float, str] = (0.0, "k2")
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's summed loss (weighted per sample under "sequence" normalisation) and its figures.
    The objective's term counts on the tokens it keeps; the entropy bonus and the KL terms (to a reference, to a
    teacher whose logprobs the batch carries, `teacher_kl` its (weight, estimator)) on every loss token."""
    b = LossBatch(logp_L, mb.infer_logprobs, mb.advantages, mb.loss_mask, segment_ids(mb.position_ids), entropy_L,
                  ref_logp_L)
    fn = objective(cfg.correction)
    if cfg.correction in BUILTIN:
        (pg_L, keep), extra = fn(b, cfg), {}
    else:
        pg_L, keep, extra = user_terms(fn, b, cfg)
    loss_L = torch.where(keep, pg_L, 0)
    if entropy_L is not None and cfg.entropy_coef:
        loss_L = loss_L - cfg.entropy_coef * torch.where(b.mask, entropy_L, 0)
    if ref_logp_L is not None:
        kl_L = kl_to_reference(logp_L, ref_logp_L, cfg.kl_estimator, b.mask)
        loss_L = loss_L + cfg.kl_coef * kl_L
        extra = {**extra, "kl_ref": kl_L.detach().double().sum()}
    if teacher_kl[0]:  # every micro-batch reports it (an empty slot 0): the ranks all-reduce the same keys
        kl_T = (kl_to_reference(logp_L, mb.teacher_logprobs, teacher_kl[1], b.mask) if mb.teacher_logprobs is not None
                else torch.zeros_like(logp_L))
        loss_L = loss_L + teacher_kl[0] * kl_T
        extra = {**extra, "kl_teacher": kl_T.detach().double().sum()}
    if cfg.normalization() == "sequence":
        loss_L = loss_L / sequence_tokens(b, loss_L.dtype)[b.sequence_ids]
    stats = {**mismatch_stats(logp_L, mb), **extra, "masked_tokens": (b.mask & ~keep).sum().float(),
             "sequences": sequence_count(b.mask, b.sequence_ids)}
    capped = cfg.correction in ("tis", "clip")
    stats["truncated_tokens"] = ((ratio_of(b) > cfg.tis_cap) & keep).sum().float() if capped else 0 * stats["loss_tokens"]
    if entropy_L is not None:
        stats["entropy"] = entropy_L.detach()[b.mask].double().sum()
    return loss_L.sum(), stats


def sequence_tokens(b: LossBatch, dtype: torch.dtype) -> torch.Tensor:
    """Each sample's loss tokens (at least 1), one entry per sample."""
    return per_sample(torch.ones_like(b.mask, dtype=dtype), b).clamp(min=1)


def sequence_count(mask: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The samples (or shared-prompt branches) with at least one loss token."""
    return torch.unique(seq[mask]).numel() * torch.ones((), dtype=torch.float32)


def sft_loss(logp_L: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mb.loss_mask
    return -logp_L[mask].sum(), {"loss_tokens": mask.sum().float()}
