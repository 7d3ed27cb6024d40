"""Zigzag context parallelism (`trainer.parallel.cp_layout`): which row tokens each rank holds and
their reassembly, the (query, key) pairs each rank scores under the real causal mask (balanced for
zigzag, ~2cp/(cp+1) of the mean on the last rank for contiguous slices), and zigzag over 4 and
contiguous over 2 real torchrun ranks against one rank (loss, gradients, weights after the step, every
token's logprob in its place) and the engine."""

import subprocess
import sys
import textwrap

import pytest
import torch

from test_parallel import (assert_engine_logprobs, assert_same_step, engine_samples,  # noqa: F401 (fixtures)
                           sparse_model_dir, step)

from prl.recipe.schema import ParallelCfg
from prl.trainer.context_parallel import Sequence, query_blocks, sequence
from prl.transport.batch import MicroBatch, cp_multiple, pad_row, shard_positions, shard_sequence, unshard


def test_zigzag_ranks_hold_a_chunk_and_its_mirror():
    assert shard_positions(16, 0, 2, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert shard_positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    assert shard_positions(6, 0, 1, "zigzag").tolist() == list(range(6)), "one rank holds the row as it is"
    assert (cp_multiple(4, "zigzag"), cp_multiple(4, "contiguous"), cp_multiple(1, "zigzag")) == (8, 4, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_positions(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="zigzag, contiguous"):
        shard_positions(16, 0, 2, "striped")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_token_on_one_rank_and_reassembly_is_the_identity(layout, size):
    n = 13
    mb = MicroBatch(**{k: torch.arange(n) * (i + 1) for i, k in enumerate(
        ["input_ids", "position_ids", "target_ids", "loss_mask", "advantages", "infer_logprobs", "versions"])},
        routing=torch.arange(n * 6).view(n, 3, 2), teacher_logprobs=torch.arange(n) * -0.5)
    row = pad_row(mb, cp_multiple(size, layout))
    held = torch.cat([shard_positions(row.input_ids.numel(), r, size, layout) for r in range(size)])
    assert sorted(held.tolist()) == list(range(row.input_ids.numel())), "each token on exactly one rank"
    parts = [shard_sequence(row, r, size, layout) for r in range(size)]
    for k, v in vars(row).items():
        torch.testing.assert_close(unshard([getattr(p, k) for p in parts], layout), v, rtol=0, atol=0)


def test_query_blocks_stay_inside_a_chunk():
    pos = shard_positions(32, 1, 2, "zigzag").tolist()  # 8..15 and 16..23
    assert query_blocks(pos, 1024, 2) == [(0, 8, 16), (8, 16, 24)]
    pos = shard_positions(32, 0, 2, "zigzag").tolist()  # 0..7 and 24..31
    assert query_blocks(pos, 5, 2) == [(0, 5, 5), (5, 8, 8), (8, 13, 29), (13, 16, 32)]
    assert query_blocks(list(range(8, 16)), 1024) == [(0, 8, 16)]


def pairs(n: int, size: int, layout: str, segments: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per rank: the (query, key) pairs its mask allows (`Sequence.allowed`), and the pairs its
    attention computes (each block of queries against the keys up to its last query)."""
    allowed, computed = [], []
    for r in range(size):
        seq = Sequence(None, size, r, layout)
        with sequence(seq, segments, shard_positions(n, r, size, layout), block=n):
            allowed.append(int(seq.allowed().sum()))
            computed.append(sum((b - a) * keys for a, b, keys in seq.blocks))
    return allowed, computed


def imbalance(per_rank: list[int]) -> float:
    return max(per_rank) * len(per_rank) / sum(per_rank)


@pytest.mark.parametrize("size", [2, 4, 16])
def test_zigzag_balances_the_pairs_each_rank_scores(size):
    """One sample filling the row: zigzag ranks score the same pairs; contiguous slices leave the last
    rank (2cp-1)/cp of the mean allowed pairs and 2cp/(cp+1) of the computed ones (1.875 at cp 16)."""
    n = 2 * size * 64
    one_sample = torch.zeros(n, dtype=torch.long)
    allowed, computed = pairs(n, size, "zigzag", one_sample)
    assert imbalance(allowed) == 1.0 and imbalance(computed) == 1.0, (allowed, computed)
    allowed, computed = pairs(n, size, "contiguous", one_sample)
    assert imbalance(computed) == pytest.approx(2 * size / (size + 1))
    assert imbalance(allowed) == pytest.approx((2 * size - 1) / size, rel=0.01)
    assert sum(allowed) == n * (n + 1) // 2, "every causal pair is scored by exactly one rank"


def test_the_layout_knob_is_checked():
    assert ParallelCfg().cp_layout == "zigzag"
    assert ParallelCfg(cp=2, cp_layout="contiguous").cp_layout == "contiguous"
    with pytest.raises(ValueError, match="cp_layout = 'ring'.*zigzag.*contiguous"):
        ParallelCfg(cp=2, cp_layout="ring")


@pytest.mark.slow
def test_zigzag_over_4_ranks_and_contiguous_over_2_match_one_rank(sparse_model_dir, engine_samples, tmp_path):  # noqa: F811
    """The engine's samples (sparse DSA: 4 keys kept of 10-20), zigzag over cp = 4 and contiguous over
    cp = 2 (zigzag over 2, the default, is test_parallel's CP test): the same step as one rank, and
    each token's logprob, reassembled from the ranks' parts (`unshard`), lands on the token one rank
    computed it for."""
    path, tokens = engine_samples
    one = step(sparse_model_dir, tmp_path, 1, {}, False, "--cp-adapter", samples=path)
    for cp, layout in [(4, "zigzag"), (2, "contiguous")]:
        run = step(sparse_model_dir, tmp_path, cp, {"parallel": {"cp": cp, "cp_layout": layout}}, False, samples=path)
        assert_same_step(one, run, f"cp={cp} {layout} against one rank")
        assert_engine_logprobs(run, tokens, f"cp={cp} {layout}")
        for i, whole in enumerate(one["rows"][0]):
            got = unshard([run["rows"][r][i] for r in range(cp)], layout)
            torch.testing.assert_close(got[: whole.numel()], whole, rtol=0, atol=1e-5,
                                       msg=lambda m, w=f"cp={cp} {layout}, micro-batch {i}": f"{w}: {m}")


SPARSE = textwrap.dedent("""
    import resource, sys, torch
    from types import SimpleNamespace
    from prl.trainer.context_parallel import attend_sparse
    def attend(query, key_states, value_states, keep, blocks, scaling):
        # the dense reference: every (head, query, key) scored, the keys not kept masked
        outs = []
        for a, b, keys in blocks:
            k = keep[a:b, :keys]
            mask = torch.zeros(k.shape).masked_fill(~k, torch.finfo(query.dtype).min)
            scores = torch.matmul(query[:, :, a:b], key_states[:, :, :keys].transpose(2, 3)) * scaling + mask
            outs.append(torch.matmul(torch.softmax(scores, dim=-1), value_states[:, :, :keys]))
        return torch.cat(outs, dim=2)
    torch.manual_seed(0)
    H, nope, rope, v, rank = 4, 8, 4, 8, 16
    attn = SimpleNamespace(num_heads=H, qk_nope_head_dim=nope, v_head_dim=v, kv_lora_rank=rank, scaling=0.3,
                           kv_b_proj=torch.nn.Linear(rank, H * (nope + v), bias=False))
    def inputs(S, T, K):
        q_pass, q_rot = torch.randn(1, H, S, nope), torch.randn(1, H, S, rope)
        latent, k_rot = torch.randn(T, rank, requires_grad=True), torch.randn(T, rope)
        pos = torch.arange(T - S, T)  # the local queries are the last S tokens of one sample
        allowed = torch.arange(T)[None] <= pos[:, None]
        topk = torch.stack([torch.randperm(int(p) + 1)[:K].sort().values for p in pos])
        return q_pass, q_rot, latent, k_rot, topk[None], allowed, [(0, S // 2, T), (S // 2, S, T)]
    # equal to the dense reference (every key scored, the non-picks masked), values and gradients
    q_pass, q_rot, latent, k_rot, topk, allowed, blocks = inputs(16, 40, 6)
    sparse = attend_sparse(attn, q_pass, q_rot, latent, k_rot, topk, allowed, blocks)
    (g_sparse,) = torch.autograd.grad(sparse.square().sum(), latent)
    kv = attn.kv_b_proj(latent).view(-1, H, nope + v).transpose(0, 1)
    keys = torch.cat([kv[..., :nope], k_rot[None].expand(H, -1, -1)], -1)[None]
    keep = torch.zeros_like(allowed).scatter(-1, topk[0], True) & allowed
    dense = attend(torch.cat([q_pass, q_rot], -1), keys, kv[None, ..., nope:], keep, blocks, 0.3)
    (g_dense,) = torch.autograd.grad(dense.square().sum(), latent)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_sparse, g_dense, rtol=1e-5, atol=1e-6)
    # 512 queries against a million keys: the dense scores alone would be 8 GB; memory follows top-k
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    q_pass, q_rot, latent, k_rot, topk, allowed, blocks = inputs(512, 1 << 20, 64)
    inputs_kb = (latent.numel() + k_rot.numel()) * 4 // 1024 + allowed.numel() // 1024
    attend_sparse(attn, q_pass, q_rot, latent, k_rot, topk, allowed, blocks).sum().backward()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before - inputs_kb) // 1024)
""")


def test_sparse_attention_equals_the_dense_one_and_its_memory_follows_top_k():
    """prl's DSA attention in MLA's latent space over each query's picks equals every key scored with
    the non-picks masked (values and gradients), and against a million keys it needs memory for its
    picks, not for the (heads x queries x keys) scores a dense attention would hold (8 GB here)."""
    p = subprocess.run([sys.executable, "-c", SPARSE], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    extra_mb = int(p.stdout.split()[-1])
    assert extra_mb < 1024, f"{extra_mb} MB beyond the inputs for 512 queries over a million keys"
