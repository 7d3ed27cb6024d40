"""Each RL objective's loss and gradient on a packed batch (several samples, a multi-turn mask)
against a plain float64 implementation of its paper's formula written here, per sample in a loop;
entropy from the chunked head; a user's objective; refusals."""

import math

import pytest
import torch

from prl.recipe import RecipeError, load_recipe
from prl.recipe.schema import LossCfg
from prl.trainer import head
from prl.trainer.loss import ObjectiveError, check_user_objective, rl_loss
from prl.transport.batch import MicroBatch

from conftest import ROOT

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"
# three packed samples: prompt tokens (mask 0), then completions; the second is multi-turn (an environment
# token, mask 0, between its turns) and has per-turn advantages
SAMPLES = [dict(prompt=2, mask=[1, 1, 1], adv=[0.7] * 3),
           dict(prompt=3, mask=[1, 1, 0, 1, 1], adv=[-0.4, -0.4, 0.0, 0.9, 0.9]),
           dict(prompt=1, mask=[1, 1], adv=[-1.2] * 2)]


def packed(seed=0):
    """The micro-batch, the trainer's logprobs (leaf, float64) and the sampler's."""
    g = torch.Generator().manual_seed(seed)
    pos, mask, adv = [], [], []
    for s in SAMPLES:
        n = s["prompt"] + len(s["mask"])
        pos += list(range(n))
        mask += [0] * s["prompt"] + s["mask"]
        adv += [0.0] * s["prompt"] + s["adv"]
    L = len(pos)
    infer = -torch.rand(L, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = (infer + torch.randn(L, generator=g, dtype=torch.float64) * 3e-4).requires_grad_()
    mb = MicroBatch(torch.zeros(L, dtype=torch.long), torch.tensor(pos), torch.zeros(L, dtype=torch.long),
                    torch.tensor(mask, dtype=torch.bool), torch.tensor(adv, dtype=torch.float64), infer,
                    torch.zeros(L, dtype=torch.long))
    return mb, logp


def spans(mb):
    starts = (mb.position_ids == 0).nonzero()[:, 0].tolist() + [mb.position_ids.numel()]
    return list(zip(starts, starts[1:]))


def reference(name, mb, logp, cfg):
    """The objective summed over loss tokens (a sample's mean under sequence normalisation), per sample."""
    total = 0.0
    for a, b in spans(mb):
        m = mb.loss_mask[a:b]
        lp, old, adv = logp[a:b][m], mb.infer_logprobs[a:b][m], mb.advantages[a:b][m]
        ratio = torch.exp(lp.detach() - old)
        if name == "cispo":
            w = ratio.clamp(1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)
            total = total - (w * adv * lp).sum()
        elif name in ("gspo", "gspo_token"):
            s_seq = torch.exp((lp - old).mean())  # the sequence ratio, with its gradient
            if name == "gspo_token":  # value sg[s], gradient through each token's own logprob
                s = s_seq.detach() * torch.exp(lp - lp.detach())
            else:
                s = s_seq.expand_as(lp)
            clipped = s.clamp(1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
            per_token = -torch.minimum(s * adv, clipped * adv)
            total = total + (per_token.mean() if name == "gspo" else per_token.sum())
        elif name == "clip":
            past = ((adv > 0) & (ratio > 1 + cfg.clip_high)) | ((adv < 0) & (ratio < 1 - cfg.clip_low))
            total = total - (ratio.clamp(max=cfg.tis_cap) * adv * lp)[~past].sum()
    return total


@pytest.mark.parametrize("name, cfg", [
    ("cispo", LossCfg(correction="cispo", cispo_clip_low=0.2, cispo_clip_high=0.0002)),
    ("gspo", LossCfg(correction="gspo")),
    ("gspo_token", LossCfg(correction="gspo_token")),
    ("gspo", LossCfg(correction="gspo", gspo_clip_low=1e-6, gspo_clip_high=1e-6)),  # most samples clipped
    ("clip", LossCfg(correction="clip", clip_low=1e-4, clip_high=1e-4)),
])
def test_objective_loss_and_gradient_match_the_formula(name, cfg):
    mb, logp = packed()
    ours, stats = rl_loss(logp, mb, cfg)
    (g_ours,) = torch.autograd.grad(ours, logp)
    ref = reference(name, mb, logp, cfg)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_ours, g_ref, rtol=1e-9, atol=1e-12), (g_ours, g_ref)
    assert stats["sequences"] == 3 and stats["loss_tokens"] == 9
    assert float(g_ours[~mb.loss_mask].abs().sum()) == 0, "prompt and environment tokens get no gradient"


def test_cispo_at_tis_bounds_is_tis_and_keeps_every_token():
    mb, logp = packed(1)
    a, _ = rl_loss(logp, mb, LossCfg(correction="cispo"))  # defaults: [0, 2]
    b, _ = rl_loss(logp, mb, LossCfg(correction="tis", tis_cap=2.0))
    assert float(a) == pytest.approx(float(b))
    _, stats = rl_loss(logp, mb, LossCfg(correction="cispo", cispo_clip_low=1e-9, cispo_clip_high=1e-9))
    assert stats["masked_tokens"] == 0


def test_entropy_bonus_and_the_chunked_heads_entropy():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 11, bias=False).double()
    head.install_on(lin)
    h, tgt = torch.randn(7, 8, dtype=torch.float64), torch.randint(0, 11, (7,))

    class Owner(torch.nn.Module):
        def get_output_embeddings(self):
            return lin

    with head.targets(Owner(), tgt, 0.7, 3, entropy=True):
        out = lin(h)[0]
    probs = torch.softmax((h @ lin.weight.T).detach() / 0.7, -1)  # the head computes in float32
    want = -(probs * probs.log()).sum(-1)
    assert torch.allclose(out[:, 1].double(), want, atol=1e-5)
    assert torch.allclose(out[:, 0].double(), probs.log().gather(-1, tgt[:, None])[:, 0], atol=1e-5)
    mb, logp = packed()
    entropy = torch.rand(logp.shape[0], dtype=torch.float64, requires_grad=True)
    base, stats = rl_loss(logp, mb, LossCfg(correction="none"), entropy)
    bonus, _ = rl_loss(logp, mb, LossCfg(correction="none", entropy_coef=0.1), entropy)
    assert float(base - bonus) == pytest.approx(0.1 * float(entropy[mb.loss_mask].sum()))
    assert float(stats["entropy"]) == pytest.approx(float(entropy[mb.loss_mask].sum()))


def test_sequence_normalisation_weighs_each_sample_once():
    mb, logp = packed()
    token, _ = rl_loss(logp, mb, LossCfg(correction="none", normalize="token"))
    seq, _ = rl_loss(logp, mb, LossCfg(correction="none", normalize="sequence"))
    want = sum(float(-(logp[a:b] * mb.advantages[a:b])[mb.loss_mask[a:b]].sum()) / int(mb.loss_mask[a:b].sum())
               for a, b in spans(mb))
    assert float(seq) == pytest.approx(want) and float(token) != pytest.approx(want)
    assert LossCfg(correction="gspo").normalization() == "sequence" and LossCfg().normalization() == "token"


def my_loss(batch, cfg):
    """A user's objective: REINFORCE with a constant baseline, and a figure to log."""
    return -(batch.advantages - 0.1) * batch.logp, {"mean_adv": batch.advantages[batch.mask].sum()}


def not_a_tensor(batch, cfg):
    return 3.0


def test_a_users_objective_runs_and_is_checked_at_load():
    mb, logp = packed()
    cfg = LossCfg(correction="test_objectives:my_loss")
    check_user_objective(cfg)
    loss, stats = rl_loss(logp, mb, cfg)
    want = -((mb.advantages - 0.1) * logp)[mb.loss_mask].sum()
    assert float(loss) == pytest.approx(float(want)) and float(stats["objective_mean_adv"]) == pytest.approx(
        float(mb.advantages[mb.loss_mask].sum()))
    with pytest.raises(ObjectiveError, match="must return the per-token loss"):
        check_user_objective(LossCfg(correction="test_objectives:not_a_tensor"))
    with pytest.raises(ObjectiveError, match="cannot import"):
        check_user_objective(LossCfg(correction="no_such_module:f"))


@pytest.mark.parametrize("override, words", [
    ('trainer.loss.correction="gsp0"', "one of tis, clip"),
    ('trainer.loss.correction="gspo"', None),
    ("trainer.loss.gspo_clip_low=0", "trainer.loss.gspo_clip_low"),
    ('trainer.loss.normalize="tokens"', "trainer.loss.normalize"),
])
def test_objective_keys_are_checked(override, words):
    if words is None:
        assert load_recipe(RECIPE, [override]).trainer.loss.normalization() == "sequence"
        return
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, [override])
    assert words in str(e.value)


def test_whole_sample_objectives_refuse_context_parallelism():
    with pytest.raises(RecipeError, match="needs trainer.parallel.cp = 1"):
        load_recipe(RECIPE, ['trainer.loss.correction="gspo"', "trainer.nproc=2", "trainer.parallel.cp=2",
                             "trainer.parallel.dp_shard=1"])
    assert math.isfinite(LossCfg().gspo_clip_high)
