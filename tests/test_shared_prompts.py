"""A group's members trained over one copy of their prompt (`prl.transport.trees`): the trainer's step
on tree rows gives every loss token the logprob, and every parameter the gradient, of the same samples
packed one by one, with fewer tokens; under R3 the replayed routes follow the tokens."""

import io

import pytest
import torch
import torch.distributed as dist

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import Replay, routers
from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg, TrainerCfg
from prl.trainer import head
from prl.trainer.context_parallel import Sequence, local_slice
from prl.trainer.step import forward_backward
from prl.transport.batch import BadBatch, Sample, TrainBatch, load_batch, pack
from prl.transport.trees import has_branches, segment_ids, share_prompts, tree_mask, tree_tokens


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def groups(layers: int = 0, experts: int = 8, k: int = 2) -> list[Sample]:
    """Three groups of 4 members (one multi-turn: environment tokens in its completions), a lone
    sample, and one whose prompt is a single token (nothing to share). With `layers`, routing per
    token where the members of a group agree on their prompt's routes (one prefill computed them)."""
    g = torch.Generator().manual_seed(0)
    out = []
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in (7, 9, 5, 6, 1)]
    for gi, (p, members) in enumerate(zip(prompts, (4, 4, 4, 1, 1))):
        shared = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(len(p) * max(layers, 1))])
        for m in range(members):
            c = torch.randint(4, 40, (2 + (3 * m + gi) % 6,), generator=g).tolist()
            mask = [int(i % 3 != 2) for i in range(len(c))] if gi == 1 else None
            lp = (-torch.rand(len(c), generator=g) * 3).tolist()
            routing = None
            if layers:
                n = len(p) + len(c) - 1
                own = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)])
                routing = torch.cat([shared[: (len(p) - 1) * layers], own[(len(p) - 1) * layers:]])
                routing = routing.view(n, layers, k).to(torch.uint8)
            out.append(Sample(p, c, lp, [0] * len(c), float(m % 3) - 1.0, mask=mask, routing=routing))
    return out


def test_units_and_mask():
    samples = groups()
    units = share_prompts(samples, 4096)
    assert sorted(len(u) for u in units) == [1, 1, 4, 4, 4]
    cut = share_prompts(samples, 20)  # trees cut to fit: every sample once, no tree over 20 tokens
    assert len(cut) > len(units) and sorted(map(id, sum(cut, []))) == sorted(map(id, samples))
    assert all(tree_tokens(u) <= 20 for u in cut if len(u) > 1)
    # a root of 2 tokens (positions 0, 1), branches at 2..3, 2..4, then a plain sample
    pos = torch.tensor([[0, 1, 2, 3, 2, 3, 4, 0, 1]])
    allowed = tree_mask(pos)[0, 0]
    assert allowed[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0]  # branch 1: root and itself
    assert allowed[6].tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0]  # branch 2: root, not branch 1
    assert allowed[8].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert segment_ids(pos[0]).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert has_branches(pos) and not has_branches(torch.tensor([0, 1, 2, 0, 1]))


@pytest.mark.parametrize("arch,correction,topk", [("glm_moe_dsa", "clip", 256), ("glm_moe_dsa", "seq_mask", 256),
                                                  ("glm_moe_dsa", "tis", 4), ("qwen3_moe", "tis", 256)])
def test_tree_rows_train_as_the_samples_alone(tmp_path, arch, correction, topk):
    """topk 4: the DSA indexer really selects (4 keys of up to 18), over the tree's mask."""
    model = build_model(write_model_dir(ModelCfg(arch=arch, index_topk=topk), tmp_path / "m"), seed=0)
    head.install(model)  # the trainer's chunked logprob head, as the trainer runs it
    replay = Replay(model, replay=True) if arch == "qwen3_moe" else None
    cfg = model.config
    samples = groups(len(routers(model)), routed_experts(cfg.to_dict()), cfg.num_experts_per_tok) if replay else groups()
    tcfg = TrainerCfg.model_validate({"loss": {"correction": correction, "mask_low": 0.2, "mask_high": 5.0}})
    results = []
    for share in (False, True):
        [mbs] = pack(samples, 1, 64, share_prompts=share)
        model.zero_grad()
        stats = forward_backward(model, replay, mbs, "rl", tcfg, 1.0, torch.device("cpu"))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((stats, grads, sum(mb.input_ids.numel() for mb in mbs)))
    (plain, g_plain, n_plain), (tree, g_tree, n_tree) = results
    assert n_tree < 0.8 * n_plain  # the prompts' tokens once per group
    for key in ("loss_tokens", "masked_tokens"):
        assert plain[key] == tree[key], key
    assert tree["loss_sum"] == pytest.approx(plain["loss_sum"], rel=1e-5, abs=1e-6)
    assert tree["mismatch_kl"] == pytest.approx(plain["mismatch_kl"], rel=1e-5)
    assert g_plain.keys() == g_tree.keys()
    for n in g_plain:
        assert torch.allclose(g_tree[n], g_plain[n], rtol=1e-4, atol=1e-6), n
    if replay:  # replay forced routes the router would not pick, so equal losses mean the routes followed the tokens
        assert plain["routing_agreed"] < plain["routing_ids"] and tree["routing_ids"] < plain["routing_ids"]


def test_context_parallelism_refuses_a_tree():
    """At the trainer endpoint (a batch refused there never reaches the loop, where it would fail every
    restart), and in the CP slicing should one come by another way."""
    batch = TrainBatch(step=3, micro_batches=pack(groups(), 1, 4096, share_prompts=True))
    buf = io.BytesIO()
    torch.save(batch.to_dict(), buf)
    assert load_batch(buf.getvalue(), 3, 1, trees_allowed=True).step == 3
    with pytest.raises(BadBatch, match="shared-prompt rows"):
        load_batch(buf.getvalue(), 3, 1, trees_allowed=False)
    with pytest.raises(ValueError, match="share_prompts"):
        local_slice(batch.micro_batches[0][0], Sequence(None, 2, 0, "zigzag"))


def test_members_routed_apart_do_not_share():
    """Multi-turn members are requests of their own: with R3, members whose prompts were routed
    differently (another server, another version) keep their own stretches."""
    samples = groups(layers=2)
    first = samples[0]
    samples[1].routing = samples[1].routing.clone()
    samples[1].routing[0] = (first.routing[0] + 1) % 8  # the same prompt, routed apart
    units = share_prompts(samples, 4096)
    assert sorted(len(u) for u in units) == [1, 1, 1, 3, 4, 4]
    assert [u for u in units if any(m is samples[1] for m in u)] == [[samples[1]]]
