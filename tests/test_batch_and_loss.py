"""Packing keeps every token with its logprob, version and advantage; losses and staleness rules."""

import pytest
import torch

from prl.orchestrator.buffer import Group, GroupBuffer
from prl.orchestrator.orchestrator import group_advantages
from prl.recipe.schema import LossCfg
from prl.trainer.loss import mismatch_stats, rl_loss, token_logprobs
from prl.transport.batch import Sample, first_fit, pack, rows_by_sample


def make_samples(n=7):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = torch.randint(4, 40, (3 + i % 3,), generator=g).tolist()
        c = torch.randint(4, 40, (2 + i % 4,), generator=g).tolist()
        out.append(Sample(p, c, [-0.1 * (i + 1)] * len(c), [i] * len(c), advantage=i - 3.0, reward=0.5))
    return out


def test_pack_keeps_tokens_aligned_and_ranks_even():
    samples = make_samples()
    ranks = pack(samples, num_ranks=2, max_tokens=12)
    assert len(ranks[0]) == len(ranks[1])
    mbs = [mb for r in ranks for mb in r]
    assert all(mb.input_ids.numel() <= 12 for mb in mbs)
    assert sum(mb.loss_tokens for mb in mbs) == sum(len(s.completion_ids) for s in samples)
    for s in samples:  # find each sample's stretch by its position ids and check every loss token
        hits = 0
        for mb in mbs:
            starts = (mb.position_ids == 0).nonzero()[:, 0].tolist() + [mb.input_ids.numel()]
            for a, b in zip(starts, starts[1:]):
                seq = mb.input_ids[a:b].tolist()
                if seq == (s.prompt_ids + s.completion_ids)[:-1]:
                    m = mb.loss_mask[a:b]
                    assert mb.target_ids[a:b][m].tolist() == s.completion_ids
                    assert torch.allclose(mb.infer_logprobs[a:b][m], torch.tensor(s.logprobs))
                    assert mb.versions[a:b][m].tolist() == s.versions
                    assert (mb.advantages[a:b][m] == s.advantage).all()
                    hits += 1
        assert hits == 1


def test_packed_forward_equals_separate(tiny_model):
    samples = make_samples(4)
    [[mb]] = pack(samples, 1, 4096)
    with torch.no_grad():
        packed = tiny_model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False).logits[0]
        starts = (mb.position_ids == 0).nonzero()[:, 0].tolist() + [mb.input_ids.numel()]
        for a, b in zip(starts, starts[1:]):
            alone = tiny_model(input_ids=mb.input_ids[None, a:b], use_cache=False).logits[0]
            assert torch.allclose(packed[a:b], alone, atol=1e-5)


def test_rows_by_sample_gives_every_token_the_packed_rows_logprob(tiny_model):
    """The trainer runs a row of short samples as [rows, width] (first-fit rows at least as wide as the
    longest sample, several samples to a row where they fit): the same loss tokens with the same
    logprobs as the packed row, padding without loss, and no more padding than rows of the longest."""
    samples = make_samples(7)
    [[mb]] = pack(samples, 1, 4096)
    lengths = [s.num_tokens for s in samples]
    longest = max(lengths)
    assert rows_by_sample(mb)[1] == longest  # without the hidden size: rows of the longest sample
    flat, width = rows_by_sample(mb, hidden_size=tiny_model.config.hidden_size)
    assert width > longest and flat.input_ids.numel() % width == 0  # wider: rows hold several samples (the case tested)
    assert flat.input_ids.numel() <= len(first_fit(lengths, longest)) * longest
    assert flat.loss_tokens == mb.loss_tokens
    with torch.no_grad():
        packed = token_logprobs(tiny_model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                                           use_cache=False).logits[0], mb.target_ids)
        rows = token_logprobs(tiny_model(input_ids=flat.input_ids.view(-1, width),
                                         position_ids=flat.position_ids.view(-1, width),
                                         use_cache=False).logits.flatten(0, 1), flat.target_ids)
    for name in ("target_ids", "advantages", "infer_logprobs", "versions"):  # the same loss tokens, reordered
        assert sorted(getattr(flat, name)[flat.loss_mask].tolist()) == sorted(getattr(mb, name)[mb.loss_mask].tolist())
    assert torch.allclose(rows[flat.loss_mask].sort().values, packed[mb.loss_mask].sort().values, atol=1e-5)
    assert torch.allclose(rl_loss(rows, flat, LossCfg())[0], rl_loss(packed, mb, LossCfg())[0], atol=1e-4)
    single, n = rows_by_sample(pack(samples[:1], 1, 4096)[0][0])  # one sample: the row as it is
    assert n == single.input_ids.numel()


def _mb(logp_infer, adv):
    [[mb]] = pack([Sample([5, 6], [7, 8, 9], logp_infer, [0, 0, 0], advantage=adv)], 1, 64)
    return mb


def test_tis_caps_and_mask_drops():
    mb = _mb([-3.0, -1.0, -1.0], adv=1.0)
    logp = torch.full((mb.input_ids.numel(),), -1.0, requires_grad=True)
    # token 0: ratio e^2 > cap 2 -> weight 2; tokens 1, 2: ratio 1
    loss, stats = rl_loss(logp, mb, LossCfg(correction="tis", tis_cap=2.0))
    loss.backward()
    assert torch.allclose(logp.grad[mb.loss_mask], torch.tensor([-2.0, -1.0, -1.0]))
    assert stats["truncated_tokens"] == 1
    logp.grad = None
    loss, stats = rl_loss(logp, mb, LossCfg(correction="mask", mask_low=0.5, mask_high=2.0))
    loss.backward()
    assert torch.allclose(logp.grad[mb.loss_mask], torch.tensor([0.0, -1.0, -1.0]))
    assert stats["masked_tokens"] == 1
    d = torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.isclose(stats["mismatch_kl"], (d.exp() - d - 1).sum())


def test_clip_stops_tokens_an_update_has_moved_far_enough():
    """PPO's clip against the sampling policy: with A > 0 a token whose ratio is past 1 + clip_high
    gets no gradient (counted as masked); below it, and every token with A < 0 above 1 - clip_low,
    the importance weight (capped at tis_cap)."""
    mb = _mb([-1.5, -1.1, -0.5], adv=1.0)  # ratios e^0.5 = 1.65, e^0.1 = 1.11, e^-0.5 = 0.61
    logp = torch.full((mb.input_ids.numel(),), -1.0, requires_grad=True)
    loss, stats = rl_loss(logp, mb, LossCfg(correction="clip", clip_low=0.2, clip_high=0.2))
    loss.backward()
    r = torch.tensor([0.5, 0.1, -0.5]).exp()
    assert torch.allclose(logp.grad[mb.loss_mask], torch.tensor([0.0, -r[1], -r[2]]))
    assert stats["masked_tokens"] == 1
    mb = _mb([-1.5, -1.1, -0.5], adv=-1.0)  # A < 0: the token below 1 - clip_low is the one stopped
    logp.grad = None
    loss, stats = rl_loss(logp, mb, LossCfg(correction="clip", clip_low=0.2, clip_high=0.2))
    loss.backward()
    assert torch.allclose(logp.grad[mb.loss_mask], torch.tensor([r[0], r[1], 0.0]))
    assert stats["masked_tokens"] == 1 and LossCfg().correction == "clip"


def test_mismatch_kl_keeps_tiny_differences():
    """exp(d)-d-1 ~ d^2/2: at d = 1e-5 that is 5e-11, which float32 rounds to 0."""
    mb = _mb([-1.0, -1.0, -1.0], adv=1.0)
    logp = mb.infer_logprobs.clone()
    logp[mb.loss_mask] += 1e-5
    stats = mismatch_stats(logp, mb)
    assert torch.isclose(stats["mismatch_kl"], torch.tensor(3 * 0.5e-10, dtype=torch.float64), rtol=0.05)


def test_positive_advantage_raises_logprob(tiny_model):
    mb = _mb([-1.0, -1.0, -1.0], adv=1.0)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    def logp():
        out = tiny_model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        return token_logprobs(out.logits[0], mb.target_ids)
    before = logp()[mb.loss_mask].sum().item()
    loss, _ = rl_loss(logp(), mb, LossCfg())
    loss.backward()
    opt.step()
    assert logp()[mb.loss_mask].sum().item() > before


def test_stale_groups_are_dropped_and_counted():
    buf = GroupBuffer(max_off_policy_steps=1, policy="drop")
    for v in (3, 4, 5):
        buf.add(Group(v, [Sample([1], [2, 3, 4][: 6 - v], [0] * (6 - v), [v, v + 1, v + 1][: 6 - v])]))
    dropped = buf.drop_stale(step=5)
    assert [g.prompt_index for g in dropped] == [3]
    taken, ages = buf.take(5, step=5)
    assert buf.dropped_samples == 1 and [g.prompt_index for g in taken] == [4, 5]
    assert ages == {"off_policy_hist": {"0": 2, "1": 1}, "stale_tokens": 0}
    # the longest trajectory (3 tokens, the top decile) was the one dropped: the bias is visible
    fields = buf.lengths.fields([s for g in taken for s in g.samples])
    assert fields["len_generated_max"] == 3 and fields["len_accepted_max"] == 2
    assert fields["dropped_by_len_decile"][-1] == 1.0 and sum(fields["dropped_by_len_decile"][:-1]) == 0


def test_stale_tokens_are_masked_or_kept_and_counted_never_dropped():
    """A trajectory whose first tokens outlived the window: "mask" trains only its fresh tokens
    (environment tokens stay masked), "correct" trains all of them; both count them; no group is dropped."""
    def fill(policy):
        buf = GroupBuffer(max_off_policy_steps=1, policy=policy)
        buf.add(Group(0, [Sample([1], [2, 3, 4, 5], [0.0] * 4, [2, 3, -1, 4], mask=[1, 1, 0, 1])]))
        buf.add(Group(1, [Sample([1], [6], [0.0], [4])]))
        assert buf.drop_stale(step=4) == []
        return buf.take(2, step=4)

    masked, ages = fill("mask")
    assert [s.mask for g in masked for s in g.samples] == [[0, 1, 0, 1], None]
    assert ages == {"off_policy_hist": {"0": 2, "1": 1, "2": 1}, "stale_tokens": 1}
    kept, ages = fill("correct")
    assert [s.mask for g in kept for s in g.samples] == [[1, 1, 0, 1], None] and ages["stale_tokens"] == 1


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.5, 0.5], "mean") == [0.5, -0.5, 0.0, 0.0]
    a = group_advantages([1.0, 0.0], "mean_std")
    assert abs(a[0] - 1.0) < 1e-4 and abs(a[1] + 1.0) < 1e-4


def test_sequence_weighting_makes_a_groups_members_weigh_the_same():
    """Token sums of the scaled advantages: each member's total is its advantage times the group's
    mean length, so the group's totals cancel whatever the members' lengths."""
    from prl.orchestrator.orchestrator import sequence_weighted

    adv = group_advantages([1.0, 0.0, 0.0, 0.0], "mean")  # one short success, three long failures
    lens = [4, 12, 12, 12]
    token_sums = [a * n for a, n in zip(adv, lens)]
    assert sum(token_sums) < -2  # weighed by tokens, the group pushes its sampled tokens down
    scaled = sequence_weighted(adv, lens)
    assert abs(sum(a * n for a, n in zip(scaled, lens))) < 1e-9
    assert [round(a * n, 6) for a, n in zip(scaled, lens)] == [round(a * 10, 6) for a in adv]


def test_turn_credit_judges_each_attempt_against_the_same_attempt_of_the_others():
    """Three members: passes at once; fails then passes; fails twice. The first attempts are compared
    with each other (1 against two failures of 0.2 and 0.4), the second attempts with each other; the
    environment's tokens get nothing, and packing carries each token's advantage."""
    from prl.envs.base import Trajectory
    from prl.orchestrator.orchestrator import turn_advantages
    from prl.transport.batch import Sample, sample_arrays

    def traj(mask, turn_rewards):
        n = len(mask)
        return Trajectory([1, 2], list(range(3, 3 + n)), [0.0] * n, [0] * n, turn_rewards[-1], mask=mask,
                          turn_rewards=turn_rewards)

    group = [traj([1, 1], [1.0]), traj([1, 1, 0, 0, 1, 1], [0.2, 1.0]), traj([1, 1, 0, 0, 1, 1], [0.4, 0.3])]
    first, second = (1.0 + 0.2 + 0.4) / 3, (1.0 + 0.3) / 2
    want = [[1 - first] * 2, [0.2 - first] * 2 + [0.0] * 2 + [1 - second] * 2,
            [0.4 - first] * 2 + [0.0] * 2 + [0.3 - second] * 2]
    got = turn_advantages(group)
    assert [[round(a, 9) for a in row] for row in got] == [[round(a, 9) for a in row] for row in want]
    s = group[1]
    arrays = sample_arrays(Sample(s.prompt_ids, s.completion_ids, s.logprobs, s.versions, 0.5, mask=s.mask,
                                  token_advantages=got[1]))
    assert arrays["advantages"] == [0.0] + [a if m else 0.0 for a, m in zip(got[1], s.mask)]
    assert turn_advantages([traj([1], [1.0]), Trajectory([1], [2], [0.0], [0], 0.0)]) is None
    # tools: every turn carries the episode's score, compared within the same state (the tool results
    # got so far): the answers to result "x" with each other, the one answer to "y" with itself
    calls = [traj([1, 0, 1], [r, r]) for r in (0.9, 0.5, 0.1)]
    for t, result in zip(calls, "xxy"):
        t.turn_states = [(), (result,)]
    mean, xs = (0.9 + 0.5 + 0.1) / 3, (0.9 + 0.5) / 2
    want = [[0.9 - mean, 0.0, 0.9 - xs], [0.5 - mean, 0.0, 0.5 - xs], [0.1 - mean, 0.0, 0.0]]
    assert [[round(a, 9) for a in row] for row in turn_advantages(calls)] == [[round(a, 9) for a in row] for row in want]
    from prl.launch.checks import check_recipe
    from prl.recipe.schema import Recipe

    with pytest.raises(ValueError, match="rl.credit = 'turn' needs a multi-turn environment"):
        check_recipe(Recipe.model_validate({"rl": {"credit": "turn"}}))
    with pytest.raises(ValueError, match="has no effect with rl.credit = 'turn'"):
        Recipe.model_validate({"rl": {"credit": "turn", "loss_weighting": "sequence"},
                               "env": {"kind": "code", "max_total_tokens": 64}})


def test_the_teachers_logprobs_travel_with_their_tokens_and_add_the_kl_to_the_teacher_to_the_loss():
    """teacher.mode = "loss": each sample's teacher logprobs sit on its loss tokens through packing, padding,
    regrouping and a context-parallel split (0 elsewhere; no column when a sample lacks them); the loss gains
    coef * k3(log p_teacher - log p) on every loss token, its gradient (1 - exp(r)) * coef, as computed here in
    float64."""
    from prl.transport.batch import pad_row, shard_sequence

    samples = make_samples(5)
    g = torch.Generator().manual_seed(1)
    for s in samples:
        s.teacher_logprobs = (-torch.rand(len(s.completion_ids), generator=g) * 3).tolist()
        s.mask = [1] * (len(s.completion_ids) - 1) + [0]  # the last token the environment's: no teacher signal
    [[mb]] = pack(samples, num_ranks=1, max_tokens=64)
    want = sorted(q for s in samples for q, m in zip(s.teacher_logprobs, s.mask) if m)  # packing reorders samples
    assert sorted(mb.teacher_logprobs[mb.loss_mask].tolist()) == pytest.approx(want)
    assert (mb.teacher_logprobs[~mb.loss_mask] == 0).all()
    padded = pad_row(mb, 16)
    grouped, _ = rows_by_sample(padded)
    halves = [shard_sequence(padded, r, 2) for r in range(2)]
    for view in (padded, grouped):
        assert sorted(view.teacher_logprobs[view.loss_mask].tolist()) == pytest.approx(want)
    assert sorted(sum((h.teacher_logprobs[h.loss_mask].tolist() for h in halves), [])) == pytest.approx(want)
    samples[0].teacher_logprobs = None
    with pytest.raises(ValueError, match="mixes samples with and without"):
        pack(samples, 1, 64)
    assert pack(samples[1:2], 1, 64)[0][0].teacher_logprobs is not None
    m = mb.loss_mask
    zero = type(mb)(**{**vars(mb), "advantages": torch.zeros_like(mb.advantages)})  # the KL alone
    for estimator, value, grad in (("k3", lambda r: r.exp() - r - 1, lambda r: 1 - r.exp()),  # forward KL's
                                   ("k2", lambda r: r * r / 2, lambda r: -r)):  # reverse KL's
        logp = (torch.linspace(-2.5, -0.2, mb.input_ids.numel())).requires_grad_(True)
        loss, stats = rl_loss(logp, zero, LossCfg(kl_estimator="k1"), teacher_kl=(0.5, estimator))
        loss.backward()
        r = mb.teacher_logprobs.double()[m] - logp.detach().double()[m]
        assert float(loss.detach()) == pytest.approx(float(0.5 * value(r).sum()), rel=1e-5)
        assert float(stats["kl_teacher"]) == pytest.approx(float(value(r).sum()), rel=1e-5)
        torch.testing.assert_close(logp.grad[m].double(), 0.5 * grad(r), atol=1e-6, rtol=0)
        assert (logp.grad[~m] == 0).all()
    plain, plain_stats = rl_loss(logp.detach(), zero, LossCfg())
    assert float(plain) == 0 and "kl_teacher" not in plain_stats
    [[_], [empty]] = pack(samples[1:2], 2, 64)  # a rank with an empty slot reports the key too (the ranks all-reduce)
    _, empty_stats = rl_loss(torch.zeros(empty.input_ids.numel()), empty, LossCfg(), teacher_kl=(0.5, "k2"))
    assert float(empty_stats["kl_teacher"]) == 0
