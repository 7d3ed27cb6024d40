"""Two-batch overlap (`trainer.parallel.overlap = "two_batch"`, prl/trainer/two_batch.py): each MoE layer's
micro-batch as two halves. Under real torchrun ranks (gloo, fp32) a step equals the serial step (loss, every
gradient, the global norm, the weights after AdamW) at ep 2, with R3 and with activation checkpointing; at cp 2 x
ep 2 (zigzag and contiguous halves, the sparse DSA selection binding); with node dedup over 2 nodes of 2, and FP8
dispatch within FP8's rounding. Ranks whose batch has one row split the experts alone and still meet their
peers' exchanges. The time it hides over a shaped link: bench/comm_overlap.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from test_parallel import assert_same_step

from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg, ParallelCfg, TrainerCfg
from prl.trainer.two_batch import Half, halves, token_halves

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Top-2 of 8 experts; the DSA indexer keeps 4 keys of the samples' 11-20 (the selection binds)."""
    d = tmp_path_factory.mktemp("model") / "model"
    write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0, index_topk=4), d)
    return d


def steps(model_dir: Path, tmp: Path, nproc: int, cases: dict) -> dict:
    out = tmp / f"steps-{nproc}.pt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        str(HERE / "dist_two_batch.py"), str(model_dir), str(out), json.dumps(cases)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=False)


def case(parallel: dict, overlap, replay: bool = False, **trainer) -> dict:
    return {"trainer": {"parallel": {**parallel, "overlap": overlap}, **trainer}, "replay": replay}


def split_everywhere(run: dict, name: str, key: str = "split") -> None:
    assert all(r.get(key, 0) > 0 for r in run[name]["split"]), (name, run[name]["split"])


def test_two_batch_equals_serial_at_ep2_with_r3_and_checkpointing(model_dir, tmp_path):
    ep2 = {"ep": 2}
    run = steps(model_dir, tmp_path, 2, {
        "serial": case(ep2, False), "two_batch": case(ep2, "two_batch"),
        "serial r3": case(ep2, False, True), "two_batch r3": case(ep2, "two_batch", True),
        "two_batch r3 checkpointed": case(ep2, "two_batch", True, activation_checkpointing=True),
        "three parts r3": case({**ep2, "overlap_parts": 3}, "two_batch", True)})
    assert_same_step(run["serial"], run["two_batch"], "two-batch against serial at ep 2")
    for name in ("two_batch r3", "two_batch r3 checkpointed", "three parts r3"):
        assert_same_step(run["serial r3"], run[name], f"{name} against serial")
        split_everywhere(run, name)
    assert run["serial r3"]["stats"]["routing_ids"] > 0 and run["serial"]["split"][0] == {}
    # counts and ids on a group of their own under two-batch overlap (not behind another part's rows)
    assert run["two_batch"]["meta"] == {True} and run["serial"]["meta"] == {False}
    # checkpointing recomputes each layer in backward: its halves run twice
    assert run["two_batch r3 checkpointed"]["split"][0]["split"] == 2 * run["two_batch r3"]["split"][0]["split"]


def test_two_batch_equals_serial_at_cp2_ep2_and_with_node_dedup_and_fp8(model_dir, tmp_path):
    cp_ep = {"cp": 2, "ep": 2}
    nodes = {"ep": 4, "ep_ranks_per_node": 2, "ep_node_dedup": True}
    fp8 = {"ep": 4, "ep_dispatch": "fp8"}
    run = steps(model_dir, tmp_path, 4, {
        "cp serial": case(cp_ep, False, True), "cp two_batch": case(cp_ep, "two_batch", True),
        "cp contiguous checkpointed": case({**cp_ep, "cp_layout": "contiguous"}, "two_batch", True,
                                           activation_checkpointing=True),
        "dedup serial": case(nodes, False, True), "dedup two_batch": case(nodes, "two_batch", True),
        "fp8 serial": case(fp8, False), "fp8 two_batch": case(fp8, "two_batch")})
    assert_same_step(run["cp serial"], run["cp two_batch"], "two-batch against serial at cp 2 x ep 2")
    assert_same_step(run["cp serial"], run["cp contiguous checkpointed"], "contiguous halves, checkpointed")
    split_everywhere(run, "cp two_batch")
    assert_same_step(run["dedup serial"], run["dedup two_batch"], "two-batch against serial with node dedup")
    # at ep 4 some rank's micro-batch is one row: its attention runs whole, its experts in halves, and its
    # exchanges meet the other ranks' halves
    seen = {k for r in run["dedup two_batch"]["split"] for k in r}
    assert seen == {"split", "experts"}, run["dedup two_batch"]["split"]
    serial, tb = run["fp8 serial"], run["fp8 two_batch"]
    assert tb["stats"]["loss_sum"] == pytest.approx(serial["stats"]["loss_sum"], rel=1e-5)
    for name, g in serial["grads"].items():  # fp32 rounding apart upstream may flip an E4M3 rounding
        if g.norm() > 0:
            assert float((tb["grads"][name] - g).norm() / g.norm()) < 2e-3, name


def test_halves_and_their_tokens():
    h = torch.zeros(5, 7, 3)
    a, b = halves(h, cp=False)
    assert (a.take(h).shape[0], b.take(h).shape[0]) == (2, 3) and (a.tokens, b.tokens) == ((0, 14), (14, 35))
    assert halves(h[:1], cp=False) is None  # one row: the attention runs whole
    row = torch.zeros(1, 9, 3)
    a, b = halves(row, cp=True)
    assert (a.take(row).shape[1], b.take(row).shape[1]) == (4, 5) and b.tokens == (4, 9)
    assert token_halves(1) == [Half(0, 0, 0, 1), Half(0, 0, 1, 1)]  # the first empty: its exchanges still run
    assert [p.take(h).shape[0] for p in halves(h, False, 4)] == [1, 1, 1, 2] and halves(h[:3], False, 4) is None


def test_replayed_ids_follow_the_half(tmp_path):
    """R3 under two halves: a router called on tokens 2..5 replays their ids; a count that does not match fails."""
    from prl.model import routing
    from prl.model.build import build_model

    model = build_model(write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=1,
                                                 first_dense_layers=0), tmp_path / "m"), seed=0)
    replay = routing.Replay(model)
    router = replay.routers[0]
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(6)])  # 6 tokens
    x = torch.randn(6, model.config.hidden_size)
    with replay.use(ids[:, None, :]):
        assert torch.equal(router(x)[2], ids)
        with routing.tokens(2, 6):
            assert torch.equal(router(x[2:6])[2], ids[2:6])
        with routing.tokens(0, 2), pytest.raises(RuntimeError, match="2 replayed routes for 6 tokens"):
            router(x)


def test_two_batch_is_refused_where_nothing_can_split():
    with pytest.raises(ValidationError, match="ep = 1 has none"):
        ParallelCfg(overlap="two_batch")
    with pytest.raises(ValidationError, match="runs through the lean forward"):
        TrainerCfg(lean_forward=False, parallel={"ep": 2, "overlap": "two_batch"})
    with pytest.raises(ValidationError, match="'fast': one of true"):
        ParallelCfg(ep=2, overlap="fast")
    assert ParallelCfg(overlap=True).overlap == "chunks" and ParallelCfg().overlap == "chunks"
