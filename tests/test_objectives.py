"""Each RL objective's loss and gradient on a packed batch (several samples, a multi-turn mask)
against a plain float64 implementation of its paper's formula written here, per sample in a loop;
entropy from the chunked head; a user's objective; refusals."""

import math

import pytest
import torch
import torch.distributed as dist

from prl.recipe import RecipeError, load_recipe
from prl.recipe.schema import LossCfg
from prl.trainer import head
from prl.trainer.loss import LossBatch, ObjectiveError, check_objective, needs_whole_samples, objective, rl_loss
from prl.trainer.step import step_divisor
from prl.transport.batch import MicroBatch
from prl.transport.trees import segment_ids

from conftest import ROOT

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"
OBJECTIVES = ("tis", "clip", "cispo", "mask", "seq_mask", "none", "gspo", "gspo_token")
# every bound differs from its mirror, so a swapped pair fails
BOUNDS = dict(tis_cap=1.5, clip_low=0.1, clip_high=0.3, cispo_clip_low=0.15, cispo_clip_high=0.25, mask_low=0.8,
              mask_high=1.4, gspo_clip_low=0.05, gspo_clip_high=0.12)
# packed samples: prompt tokens, then (ratio to the sampler, advantage) per completion token, None an environment
# token; the ratios fall on both sides of every bound above, with both signs of advantage
SAMPLES = [
    (2, [(0.5, 0.7), (0.87, 0.7), (0.93, 0.7)]),  # below cispo's, clip's and mask's lower bounds; mean 0.74
    (3, [(1.0, -0.4), (1.2, -0.4), (1.28, -0.4), (1.35, -0.4)]),  # mean 1.20: above GSPO's band, A < 0
    (1, [(1.45, 0.9), (1.8, 0.9), None, (0.87, -0.3), (1.0, -0.3)]),  # two turns; above the cap and mask_high
    (2, [(0.89, -1.2), (0.94, -1.2)]),  # mean 0.915: below GSPO's band, A < 0 (clipped)
    (1, [(1.55, -0.5), (1.6, -0.5)]),  # mean 1.57: above seq_mask's band; past the cap, A < 0
    (2, [(1.02, 0.6), (1.05, 0.6), (1.0, 0.6)]),  # inside every band
    (1, [(1.1, 0.5), (1.2, 0.5)]),  # mean 1.15: above GSPO's band, A > 0 (clipped)
]


def packed(samples=SAMPLES, seed=0):
    """The micro-batch, the trainer's logprobs (a float64 leaf) and per token the reference's logprob and the
    entropy (a leaf); prompt and environment tokens get random log-ratios."""
    g = torch.Generator().manual_seed(seed)
    pos, mask, adv, log_ratio = [], [], [], []
    for prompt, tokens in samples:
        pos += list(range(prompt + len(tokens)))
        mask += [0] * prompt + [t is not None for t in tokens]
        adv += [0.0] * prompt + [t[1] if t else 0.0 for t in tokens]
        log_ratio += [float(torch.randn((), generator=g))] * prompt + [math.log(t[0]) if t else 0.3 for t in tokens]
    L = len(pos)
    infer = -torch.rand(L, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = (infer + torch.tensor(log_ratio, dtype=torch.float64)).requires_grad_()
    ref = logp.detach() + torch.rand(L, generator=g, dtype=torch.float64) * 1.6 - 0.8  # |log-ratio| up to 0.8
    entropy = (torch.rand(L, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    mb = MicroBatch(torch.zeros(L, dtype=torch.long), torch.tensor(pos), torch.zeros(L, dtype=torch.long),
                    torch.tensor(mask, dtype=torch.bool), torch.tensor(adv, dtype=torch.float64), infer,
                    torch.zeros(L, dtype=torch.long))
    return mb, logp, ref, entropy


def spans(mb):
    starts = (mb.position_ids == 0).nonzero()[:, 0].tolist() + [mb.position_ids.numel()]
    return list(zip(starts, starts[1:]))


# ---- the reference: each formula from its paper, token by token in float64 (no code of prl.trainer.loss) ----
def token_term(name, lp, old, a, s_i, cfg):
    """One loss token's objective term. lp: its logprob (with gradient); old: the sampler's; s_i: the sample's
    ratio exp(mean log-ratio) with its gradient."""
    r = math.exp(lp.item() - old)  # a value: no gradient through the importance weight
    if name == "tis":  # truncated importance sampling
        return -min(r, cfg.tis_cap) * a * lp
    if name == "clip":  # PPO: no gradient once the ratio has moved past the bound the advantage points to
        moved_past = (a > 0 and r > 1 + cfg.clip_high) or (a < 0 and r < 1 - cfg.clip_low)
        return 0 * lp if moved_past else -min(r, cfg.tis_cap) * a * lp
    if name == "cispo":  # CISPO: the clipped weight, gradient stopped; every token keeps its gradient
        return -max(1 - cfg.cispo_clip_low, min(r, 1 + cfg.cispo_clip_high)) * a * lp
    if name == "mask":  # tokens whose ratio leaves [mask_low, mask_high] masked
        return -a * lp if cfg.mask_low <= r <= cfg.mask_high else 0 * lp
    if name == "seq_mask":  # whole samples masked by their geometric-mean ratio
        return -a * lp if cfg.mask_low <= s_i.item() <= cfg.mask_high else 0 * lp
    if name == "none":
        return -a * lp
    # GSPO: the sample's ratio (GSPO-token: its value, the gradient of this token's own logprob)
    s = s_i if name == "gspo" else s_i.item() * torch.exp(lp - lp.item())
    lo, hi = 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high
    clipped = torch.clamp(s, lo, hi)
    return -torch.minimum(s * a, clipped * a)


def kl_term(lp, ref, estimator):
    """Schulman's estimators of KL(pi || pi_ref) at a token sampled from pi, with q = pi_ref / pi."""
    log_q = ref - lp
    if estimator == "k1":
        return -log_q
    if estimator == "k2":
        return log_q ** 2 / 2
    return torch.exp(log_q) - 1 - log_q


def reference_loss(name, mb, logp, ref, entropy, cfg, normalize, constant):
    """The step's loss: per sample, each loss token's objective + kl_coef KL - entropy_coef H, then normalised:
    "token" the sum over the step's loss tokens, "sequence" each sample's mean then the mean over samples,
    "constant" the sum over a fixed count."""
    per_sample, tokens = [], 0
    for a, b in spans(mb):
        idx = [t for t in range(a, b) if mb.loss_mask[t]]
        s_i = torch.exp(sum(logp[t] - mb.infer_logprobs[t] for t in idx) / len(idx))
        terms = [token_term(name, logp[t], float(mb.infer_logprobs[t]), float(mb.advantages[t]), s_i, cfg)
                 + cfg.kl_coef * kl_term(logp[t], ref[t], cfg.kl_estimator) - cfg.entropy_coef * entropy[t]
                 for t in idx]
        per_sample.append(sum(terms) / (len(idx) if normalize == "sequence" else 1))
        tokens += len(idx)
    total = sum(per_sample)
    return total / {"token": tokens, "sequence": len(per_sample), "constant": constant}[normalize]


def our_loss(mb, logp, ref, entropy, cfg, constant):
    loss_sum, stats = rl_loss(logp, mb, cfg, entropy, ref)
    return loss_sum / step_divisor([(mb, None, None)], cfg.normalization(), constant, torch.device("cpu")), stats


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("normalize", ["token", "sequence", "constant"])
@pytest.mark.parametrize("name", OBJECTIVES)
def test_objective_loss_and_gradients_match_the_papers(one_rank, name, normalize, estimator):
    """Value and gradients (logprobs and entropy) against the float64 reference, with the KL term and the
    entropy bonus on every loss token (those the objective drops too)."""
    mb, logp, ref, entropy = packed()
    cfg = LossCfg(correction=name, normalize=normalize, kl_coef=0.3, kl_estimator=estimator, entropy_coef=0.07,
                  **BOUNDS)
    ours, stats = our_loss(mb, logp, ref, entropy, cfg, constant=37.0)
    want = reference_loss(name, mb, logp, ref, entropy, cfg, normalize, 37.0)
    g_ours = torch.autograd.grad(ours, (logp, entropy))
    g_want = torch.autograd.grad(want, (logp, entropy))
    assert float(ours) == pytest.approx(float(want), rel=1e-10, abs=1e-13)
    for got, expect in zip(g_ours, g_want):
        assert torch.allclose(got, expect, rtol=1e-9, atol=1e-13), (got, expect)
    assert float(g_ours[0][~mb.loss_mask].abs().sum()) == 0, "prompt and environment tokens get no gradient"
    assert stats["sequences"] == len(SAMPLES) and stats["loss_tokens"] == int(mb.loss_mask.sum())
    kl = sum(float(kl_term(logp[t], ref[t], estimator)) for t in range(len(logp)) if mb.loss_mask[t])
    assert float(stats["kl_ref"]) == pytest.approx(kl, rel=1e-10)


def test_the_reference_binds_every_bound():
    """The samples put tokens on both sides of each bound (else a swapped or dropped bound passes)."""
    ratios = [r for _, tokens in SAMPLES for r, _ in filter(None, tokens)]
    means = [math.exp(sum(math.log(r) for r, _ in filter(None, t)) / len(list(filter(None, t)))) for _, t in SAMPLES]
    b = BOUNDS
    for bound, values in [(b["tis_cap"], ratios), (1 - b["clip_low"], ratios), (1 + b["clip_high"], ratios),
                          (1 - b["cispo_clip_low"], ratios), (1 + b["cispo_clip_high"], ratios),
                          (b["mask_low"], ratios), (b["mask_high"], ratios), (b["mask_low"], means),
                          (b["mask_high"], means), (1 - b["gspo_clip_low"], means), (1 + b["gspo_clip_high"], means)]:
        assert min(values) < bound < max(values)


def test_whole_sample_flags_say_which_objectives_read_the_sample():
    """Split every sample's tokens over two 'ranks' (as context parallelism does): an objective that does not
    declare `whole_samples` gives the same loss summed over the halves; one that declares it does not."""
    mb, logp, _, _ = packed()
    seq = segment_ids(mb.position_ids)
    halves = [torch.arange(len(logp)) % 2 == k for k in (0, 1)]
    cfg = LossCfg(**BOUNDS)
    for name in OBJECTIVES:
        fn = objective(name)

        def summed(sel):
            b = LossBatch(logp[sel], mb.infer_logprobs[sel], mb.advantages[sel], mb.loss_mask[sel], seq[sel])
            loss_L, keep = fn(b, cfg)
            return float(torch.where(keep, loss_L, 0).sum())

        split = sum(summed(h) for h in halves)
        whole = summed(torch.ones(len(logp), dtype=torch.bool))
        assert (split != pytest.approx(whole, rel=1e-9)) == needs_whole_samples(fn), name


def test_whole_sample_objectives_refuse_context_parallelism():
    for name in ("seq_mask", "gspo", "gspo_token"):
        with pytest.raises(ObjectiveError, match="needs trainer.parallel.cp = 1"):
            check_objective(LossCfg(correction=name, normalize="token"), cp=2)
    check_objective(LossCfg(correction="clip"), cp=2)
    with pytest.raises(RecipeError, match="needs trainer.parallel.cp = 1"):  # sequence normalisation: the schema
        load_recipe(RECIPE, ['trainer.loss.correction="gspo_token"', "trainer.nproc=2", "trainer.parallel.cp=2",
                             "trainer.parallel.dp_shard=1"])


def test_gspo_token_at_defaults_is_gspo_with_one_advantage_per_sample(one_rank):
    """GSPO-token equals GSPO in value and gradient when every token of a sample has its advantage."""
    singles = [s for s in SAMPLES if None not in s[1] and len({a for _, a in s[1]}) == 1]
    mb, logp, _, _ = packed(singles)
    out = {}
    for name in ("gspo", "gspo_token"):
        cfg = LossCfg(correction=name)  # default bounds and normalisation
        loss, _ = our_loss(mb, logp, None, None, cfg, None)
        out[name] = (float(loss), torch.autograd.grad(loss, logp)[0])
    assert out["gspo"][0] == pytest.approx(out["gspo_token"][0], rel=1e-12)
    assert torch.allclose(out["gspo"][1], out["gspo_token"][1], rtol=1e-9, atol=1e-15)


def test_cispo_at_tis_bounds_is_tis_and_keeps_every_token():
    wide = [(1, [(0.3, 0.5), (2.5, 0.5), (1.2, -0.5)]), (2, [(3.0, -0.8), (0.9, -0.8)])]  # past the cap of 2
    mb, logp, _, _ = packed(wide)
    a, _ = rl_loss(logp, mb, LossCfg(correction="cispo"))  # defaults: [0, 2]
    b, _ = rl_loss(logp, mb, LossCfg(correction="tis", tis_cap=2.0))
    c, _ = rl_loss(logp, mb, LossCfg(correction="none"))
    assert float(a) == pytest.approx(float(b), rel=1e-12) and float(a) != pytest.approx(float(c))
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (a, b))
    assert torch.allclose(ga, gb)
    _, stats = rl_loss(logp, mb, LossCfg(correction="cispo", cispo_clip_low=1e-9, cispo_clip_high=1e-9))
    assert stats["masked_tokens"] == 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_is_finite_with_an_extreme_token(estimator):
    """float32, a masked prompt token whose log-ratio to the reference is 100 (exp overflows) and a loss token
    at 95: the loss and every gradient stay finite; under k2 and k3 the loss token's gradient still pulls it
    toward the reference (k1's gradient is +1 whatever the ratio)."""
    mb, logp64, ref64, _ = packed()
    logp = logp64.detach().float().requires_grad_()
    ref = ref64.float()
    first_loss = int(mb.loss_mask.nonzero()[0])
    ref[0], ref[first_loss] = logp[0].detach() + 100, logp[first_loss].detach() + 95
    loss, stats = rl_loss(logp, mb, LossCfg(correction="clip", kl_coef=1.0, kl_estimator=estimator), None, ref)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and torch.isfinite(stats["kl_ref"])
    assert g[0] == 0
    if estimator == "k1":
        assert g[first_loss] == pytest.approx(1 + float(torch.autograd.grad(rl_loss(logp, mb, LossCfg())[0], logp)[0][first_loss]))
    else:
        assert g[first_loss] < -1


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "seq_mask"])
def test_sequence_ratio_is_finite_past_exps_range(name):
    """float32, one sample whose mean log-ratio is 100 (clipped or masked): no NaN reaches the gradient."""
    mb, logp64, _, _ = packed()
    mb.infer_logprobs, mb.advantages = mb.infer_logprobs.float(), mb.advantages.float()
    logp = logp64.detach().float()
    a, b = spans(mb)[0]
    logp[a:b] = logp[a:b] + torch.where(mb.loss_mask[a:b], 100.0, 0.0)
    logp.requires_grad_()
    loss, _ = rl_loss(logp, mb, LossCfg(correction=name), None, None)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert (g[b:] != 0).any()  # the other samples still train


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
    mb, logp, _, entropy = packed()
    base, stats = rl_loss(logp, mb, LossCfg(correction="none"), entropy)
    bonus, _ = rl_loss(logp, mb, LossCfg(correction="none", entropy_coef=0.1), entropy)
    assert float(base - bonus) == pytest.approx(0.1 * float(entropy[mb.loss_mask].sum()))
    assert float(stats["entropy"]) == pytest.approx(float(entropy[mb.loss_mask].sum()))


def test_auto_normalisation_is_each_papers():
    assert [LossCfg(correction=n).normalization() for n in OBJECTIVES] == [
        "token", "token", "token", "token", "token", "token", "sequence", "sequence"]


def my_loss(batch, cfg):
    """A user's objective: REINFORCE with a constant baseline, and a figure to log."""
    return -(batch.advantages - 0.1) * batch.logp, {"mean_adv": batch.advantages[batch.mask].sum()}


def not_a_tensor(batch, cfg):
    return 3.0


def reads_every_field(batch, cfg):
    """Reads the entropy, and the reference where the run keeps one (and only there)."""
    assert batch.entropy is not None and (batch.ref_logp is not None) == (cfg.kl_coef > 0)
    kl = 0 if batch.ref_logp is None else (batch.logp - batch.ref_logp) ** 2
    return -batch.advantages * batch.logp - 0.01 * batch.entropy + kl


def test_a_users_objective_runs_and_is_checked_at_load():
    mb, logp, _, _ = packed()
    cfg = LossCfg(correction="test_objectives:my_loss")
    check_objective(cfg)
    loss, stats = rl_loss(logp, mb, cfg)
    want = -((mb.advantages - 0.1) * logp)[mb.loss_mask].sum()
    assert float(loss) == pytest.approx(float(want)) and float(stats["objective_mean_adv"]) == pytest.approx(
        float(mb.advantages[mb.loss_mask].sum()))
    with pytest.raises(ObjectiveError, match="must return the per-token loss"):
        check_objective(LossCfg(correction="test_objectives:not_a_tensor"))
    with pytest.raises(ObjectiveError, match="cannot import"):
        check_objective(LossCfg(correction="no_such_module:f"))
    for kl_coef in (0.0, 0.1):  # the probe gives the fields the run gives
        check_objective(LossCfg(correction="test_objectives:reads_every_field", kl_coef=kl_coef))


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


def test_the_mutation_check_still_applies():
    """Each mutation of tests/mutation_objectives.py still finds its one line (run the check itself by hand)."""
    from mutation_objectives import M, applies

    assert [m for m in M if not applies(m[0], m[1])] == []
