"""The expert all-to-all's dispatch options (`trainer.parallel.ep_dispatch`, `ep_node_dedup`) against
the plain all-to-all, under real torchrun ranks on gloo, 4 ranks taken as 2 nodes of 2
(`ep_ranks_per_node = 2`).

- One MoE layer (tests/dist_dispatch.py): the bytes each rank sends, counted by the code, against a
  count by hand for a fixed routing; node dedup equal to plain; FP8 equal to plain on the input
  FP8 rounds, and within FP8's bound of plain on the input itself.
- A whole training step (tests/dist_step.py, the tiny GLM-5): node dedup gives plain's step, FP8
  dispatch gives it within the FP8 tolerance.

The FP8 bound: a row travels as E4M3 (3 mantissa bits, rounded to nearest) times one fp32 scale per
1x128 tile, the tile's amax / 448. An element in E4M3's normal range moves by at most 2^-4 of itself
(2^-5 to 2^-4 by where it sits in its binade); one in the subnormal range (below 2^-6 x the scale) by
at most half the subnormal step, 2^-10 x the scale = amax x 2.2e-6. So every element reaching an
expert is within 2^-4 |x| + 2.2e-6 amax of plain's (tested exactly: FP8 dispatch is plain on the
rounded input), a row's error being unsigned noise of about 2.5% of its norm. What the experts make
of it carries two such errors at once: the SwiGLU multiplies gate and up, both from the rounded row,
and a weight gradient multiplies the rounded input by the output gradient, which also travels toward
the experts in FP8; a product's relative error is at most the sum of its factors'. Every relative
difference (the layer's output and gradients, the step's loss and gradients) is asserted below
2 x 2^-4 = 2^-3, and above 0 (the rows did travel in FP8). Measured: at most 6.0% for the layer (the
routing weights' gradient, in bf16), 4-5% for its output and other gradients.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg, ParallelCfg

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
FP8_BOUND = 2 * 2.0 ** -4  # two E4M3 roundings (3 mantissa bits, to nearest: 2^-4 each) in a product


@pytest.fixture(scope="module")
def layer(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dispatch") / "layer.pt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                        str(HERE / "dist_dispatch.py"), str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=False)


def rows_by_hand(dedup: bool) -> dict[str, int]:
    """Rows each rank sends toward the experts (and back) for dist_dispatch.fixed_ids, by link.

    Rank p, with f its rail peer on the other node, g the other rank there, q its peer on its own node
    (2 experts a rank). Its tokens' experts: (f, g), (g, g), (q, f), (p, p), (q, q).
    Plain, a row per (token, slot) off this rank: to the other node 2 + 2 + 1 = 5, to q 1 + 2 = 3.
    Dedup, hop 1 a row per (token, other node) to f: 1 + 1 + 1 = 3; hop 2 from p as a forwarder, a
    row per (token, rank) for what reached it: its own (q, .), (q, q) and f's tokens, which are
    (p, q), (q, q), (g, p) seen from f: to q 1 + 1 + 1 + 1 = 4. Every rank is alike, so each also
    receives what it sends, and the way back (combine) carries the same rows."""
    return {"net": 3, "node": 4} if dedup else {"net": 5, "node": 3}


def meta_by_hand(dedup: bool) -> dict[tuple[str, str], int]:
    """Bytes of counts, ids and routing weights. Plain: per-expert counts, 2 int64 to each of 3 peers.
    Dedup: per hop one int64 count to each peer; per row sent int32 ids and fp32 weights of its 2
    slots (16 B) forward, and the weights' gradients (8 B) back."""
    if not dedup:
        return {("forward", "node"): 16, ("forward", "net"): 32}
    return {("forward", "node"): 2 * 8 + 4 * 16, ("forward", "net"): 2 * 16 + 3 * 16,
            ("backward", "node"): 4 * 8, ("backward", "net"): 3 * 8}


@pytest.mark.parametrize("case", ["plain", "fp8", "dedup", "fp8+dedup"])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_bytes_sent_match_a_count_by_hand(layer, case, dtype):
    size = 4 if dtype == "torch.float32" else 2
    dedup, fp8 = "dedup" in case, "fp8" in case
    hp_row, fp8_row = 256 * size, 256 + 2 * 4  # FP8: a byte per value and an fp32 scale per 128
    want = {}
    for link, rows in rows_by_hand(dedup).items():
        for phase in ("forward", "backward"):  # backward: the combine's gradient goes toward the experts
            want[(phase, "to_experts", link)] = rows * (fp8_row if fp8 else hp_row)
            want[(phase, "to_tokens", link)] = rows * hp_row
    want.update({(phase, "meta", link): n for (phase, link), n in meta_by_hand(dedup).items()})
    for rank in range(4):
        assert layer[rank][("fixed", dtype, case)]["traffic"] == want, f"rank {rank}"


def test_fp8_sends_about_half_of_bf16_and_dedup_fewer_rows_across_nodes(layer):
    """The drops, for the fixed routing and for a random one (48 tokens a rank, 2 of 8 experts each)."""
    def sent(routing, case, what, link):
        return sum(layer[r][(routing, "torch.bfloat16", case)]["traffic"].get(("forward", what, link), 0)
                   for r in range(4))

    for routing in ("fixed", "random"):
        for link in ("node", "net"):
            assert sent(routing, "fp8", "to_experts", link) == \
                pytest.approx(sent(routing, "plain", "to_experts", link) * 264 / 512)
    assert sent("fixed", "dedup", "to_experts", "net") == 0.6 * sent("fixed", "plain", "to_experts", "net")
    # random routing, 2 distinct of 8 experts: both on the other node 6/28 of tokens, one 16/28; the
    # off-node rows per token drop from 2 x 6/28 + 16/28 = 1 to 22/28 = 0.79 (prl plan's
    # dedup_factor(2, 2) = 0.75 draws the 2 experts independently)
    ratio = sent("random", "dedup", "to_experts", "net") / sent("random", "plain", "to_experts", "net")
    assert 0.6 < ratio < 0.9, ratio


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def results(layer, routing, dtype, case):
    for r in range(4):
        res = layer[r][(routing, dtype, case)]
        yield r, [res["out"], res["x_grad"], res["w_grad"], *res["expert_grads"]]


@pytest.mark.parametrize("routing", ["fixed", "random"])
def test_node_dedup_equals_plain(layer, routing):
    """The same products, summed in another order: equal to fp32 rounding (each element within 1e-5 of
    itself or 1e-6 of its tensor's largest)."""
    for (r, plain), (_, dedup) in zip(results(layer, routing, "torch.float32", "plain"),
                                      results(layer, routing, "torch.float32", "dedup")):
        for i, (a, b) in enumerate(zip(dedup, plain)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(),
                                       msg=lambda m, i=i, r=r: f"rank {r}, tensor {i}: {m}")


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_fp8_dispatch_is_plain_on_the_rounded_input_and_within_the_fp8_bound(layer, dtype):
    """Forward, FP8 dispatch is exactly plain on `dequantize(quantize_tiles(x))` (each row rounded on
    its own, as it travels); its output and gradients are within FP8's bound of plain's."""
    for r in range(4):
        fp8 = layer[r][("random", dtype, "fp8")]
        assert torch.equal(fp8["out"], layer[r][("random", dtype, "plain, rounded input")]["out"]), r
    for case in ("fp8", "fp8+dedup"):
        for (r, plain), (_, got) in zip(results(layer, "random", dtype, "plain"), results(layer, "random", dtype, case)):
            errors = [close(a, b) for a, b in zip(got, plain)]
            assert 0 < max(errors) < FP8_BOUND, (case, r, errors)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "model"
    write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0), d)
    return d


def steps(model_dir: Path, tmp: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """tests/dist_ep_step.py: a training step on 4 ranks (ep = 4, 2 nodes of 2) per dispatch in `cases`."""
    out = tmp / "steps.pt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                        str(HERE / "dist_ep_step.py"), str(model_dir), str(out), json.dumps(cases)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_a_training_step_with_node_dedup_and_fp8_dispatch(model_dir, tmp_path):
    """ep = 4 over 2 nodes of 2: dedup gives plain's step (loss, every gradient, the weights after
    AdamW) and sends fewer rows across nodes; FP8 dispatch gives it within the FP8 bound, and differs
    (the rows did travel in FP8). Each with its exchanges overlapped (the default) gives the step with
    them serial, activation checkpointing (the exchanges run again in backward) too; under FP8 dispatch
    to 2e-3 of each gradient (a value fp32 rounding apart may round to the next E4M3 value: FP8 against
    plain differs by about 4e-2)."""
    from test_parallel import assert_same_step

    serial = {"overlap": False}
    run = steps(model_dir, tmp_path, {
        "plain": {}, "dedup": {"ep_node_dedup": True}, "fp8": {"ep_dispatch": "fp8"},
        "plain serial": serial, "dedup serial": {"ep_node_dedup": True, **serial},
        "fp8 serial": {"ep_dispatch": "fp8", **serial}, "checkpointed": {"activation_checkpointing": True},
        "checkpointed serial": {"activation_checkpointing": True, **serial},
        "fp8 dedup checkpointed": {"ep_dispatch": "fp8", "ep_node_dedup": True, "activation_checkpointing": True},
        "fp8 dedup checkpointed serial": {"ep_dispatch": "fp8", "ep_node_dedup": True, "activation_checkpointing": True,
                                          **serial}})
    for name in ("plain", "dedup", "checkpointed"):
        assert_same_step(run[f"{name} serial"], run[name], f"{name}: overlapped against serial")
    # the shared experts ran ahead and were taken by their MoE block, recomputed layers too: nothing held
    assert run["checkpointed"]["ahead"] == {"modules": 2, "left": 0}, run["checkpointed"]["ahead"]
    assert run["plain serial"]["ahead"]["modules"] == 0, "serial: nothing runs ahead"
    for name in ("fp8", "fp8 dedup checkpointed"):  # fp32 rounding apart upstream can flip an FP8 rounding
        serial, overlapped = run[f"{name} serial"], run[name]
        assert overlapped["stats"]["loss_sum"] == pytest.approx(serial["stats"]["loss_sum"], rel=1e-5), name
        errors = {n: close(overlapped["grads"][n], g) for n, g in serial["grads"].items() if g.norm() > 0}
        assert max(errors.values()) < 2e-3, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
    plain, fp8 = run["plain"], run["fp8"]
    assert_same_step(plain, run["dedup"], "node dedup against plain")
    assert_same_step(plain, run["checkpointed"], "activation checkpointing against none")
    net = {k: sum(t.get((p, "to_experts", "net"), 0) for t in run[k]["traffic"] for p in ("forward", "backward"))
           for k in ("plain", "dedup", "fp8")}
    assert 0 < net["dedup"] < net["plain"], net
    # hidden 128 in fp32: a row of 512 B, in FP8 128 + 4 B. The rows differ a little: the second layer's
    # router sees the first layer's FP8-perturbed output
    assert net["fp8"] % 132 == 0 and net["fp8"] // 132 == pytest.approx(net["plain"] // 512, rel=0.05), net
    assert fp8["stats"]["loss_sum"] == pytest.approx(plain["stats"]["loss_sum"], rel=FP8_BOUND)
    errors = {n: close(fp8["grads"][n], g) for n, g in plain["grads"].items() if g.norm() > 0}
    print("FP8 dispatch against plain, the largest relative gradient differences:",
          sorted(errors.items(), key=lambda kv: -kv[1])[:3], "; bytes toward the experts across nodes:", net)
    assert max(errors.values()) < FP8_BOUND, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert max(errors.values()) > 1e-4, "FP8 changed the step"


def test_recipe_keys_are_checked():
    assert ParallelCfg(ep=4, ep_dispatch="fp8", ep_node_dedup=True).ep_dispatch == "fp8"
    with pytest.raises(ValidationError, match="ep_dispatch = 'fp8'.*ep = 1"):
        ParallelCfg(ep_dispatch="fp8")
    with pytest.raises(ValidationError, match="ep_node_dedup.*ep = 1"):
        ParallelCfg(ep_node_dedup=True)
    with pytest.raises(ValidationError, match="plain.*fp8"):
        ParallelCfg(ep=2, ep_dispatch="bf16")
    with pytest.raises(ValueError, match=r"ep_ranks_per_node \(3\) must divide the trainer's world size \(4\)"):
        ParallelCfg(ep=4, ep_ranks_per_node=3).check(4, 8)
    with pytest.raises(ValueError, match=r"ep \(4\) must be a multiple of the trainer ranks of one host \(6"):
        ParallelCfg(ep=4, ep_node_dedup=True).check(12, 8, per_host=6)
    ParallelCfg(ep=4).check(12, 8, per_host=6)  # plain: an expert group may straddle hosts
    assert ParallelCfg(ep=4, ep_node_dedup=True).ranks_per_node(8, 2) == 2
    assert ParallelCfg(ep=4, ep_ranks_per_node=2).ranks_per_node(4, 4) == 2


def test_recipe_carries_the_keys_to_the_trainer():
    """A recipe with the keys validates through `Recipe` (nproc as ranks per node)."""
    from prl.recipe.schema import Recipe

    r = Recipe.model_validate({"trainer": {"nproc": 4, "parallel": {"ep": 4, "ep_dispatch": "fp8",
                                                                    "ep_node_dedup": True, "ep_ranks_per_node": 2}}})
    assert r.trainer.parallel.ranks_per_node(r.trainer_world(), r.trainer.nproc) == 2
    with pytest.raises(ValidationError, match="must divide the trainer's world size"):
        Recipe.model_validate({"trainer": {"nproc": 4, "parallel": {"ep": 4, "ep_node_dedup": True,
                                                                    "ep_ranks_per_node": 3}}})


def test_shared_experts_computed_ahead_are_returned_for_their_own_tokens_only():
    """The result waits with its tokens: new tokens (which may land at the freed tokens' address after an
    exception left a result waiting) or tokens changed in place since are computed anew."""
    from prl.trainer.expert_parallel import AheadShared

    class Doubler(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Doubler.calls += 1
            return x * 2

    m = type("AheadDoubler", (AheadShared, Doubler), {})()
    m._prl_ahead = None
    x = torch.randn(4, 8)
    m.run_ahead(x)
    assert torch.equal(m(x.view(1, 4, 8)), (x * 2).view(1, 4, 8)) and Doubler.calls == 1, "the result computed ahead"
    for _ in range(20):
        m.run_ahead(torch.randn(4, 8))  # a result left waiting; its tokens go out of scope
        y = torch.randn(4, 8)
        assert torch.equal(m(y), y * 2)
    m.run_ahead(y)
    y.add_(1)
    assert torch.equal(m(y), y * 2)
