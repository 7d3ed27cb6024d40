"""Rollout routing replay (R3): capture in the engine, replay in the trainer, alignment in transit."""

import contextlib
import copy

import pytest
import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.inference.protocol import decode_routing, encode_routing
from prl.model.routing import FAMILIES, Replay, routers
from prl.recipe import RecipeError, load_recipe
from prl.trainer.loss import token_logprobs
from prl.transport.batch import Sample, pack, shard_sequence


def generate(model, prompts, max_tokens=8):
    core = EngineCore(model, capture_routing=True)
    seqs = [Sequence(p, SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=())) for p in prompts]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


def to_sample(seq) -> Sample:
    routing = torch.cat([seq.prompt_routing, seq.completion_routing()])
    return Sample(seq.prompt_ids, seq.out_ids, seq.logprobs, seq.versions, 1.0, routing=routing)


def trainer_logprobs(model, mb, replay: Replay | None):
    with replay.use(mb.routing) if replay else contextlib.nullcontext():
        out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
    return token_logprobs(out.logits[0], mb.target_ids)


def test_capture_shapes_and_compact_dtype(tiny_model):
    [seq] = generate(tiny_model, [[5, 6, 7, 8]], max_tokens=5)
    layers, k = len(routers(tiny_model)), tiny_model.config.num_experts_per_tok
    assert seq.prompt_routing.shape == (4, layers, k) and seq.prompt_routing.dtype == torch.uint8
    assert seq.completion_routing().shape == (4, layers, k)  # 5 tokens, the last is never fed back
    wire = encode_routing(seq.prompt_routing)
    assert torch.equal(decode_routing(wire), seq.prompt_routing)


def test_replay_in_fp32_matches_engine_logprobs(tiny_model):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [14, 15]]
    seqs = generate(copy.deepcopy(tiny_model), prompts)  # engine: batched decode with a KV cache
    [[mb]] = pack([to_sample(s) for s in seqs], 1, 4096)
    replay = Replay(tiny_model)
    with torch.no_grad():
        logp = trainer_logprobs(tiny_model, mb, replay)
    assert torch.allclose(logp[mb.loss_mask], mb.infer_logprobs[mb.loss_mask], atol=1e-5)
    agreed, total = replay.agreement()
    assert agreed == total > 0, "fp32 on both sides: the trainer's router agrees with every captured id"
    shifted = mb.routing.clone()
    shifted[..., 0] = (shifted[..., 0].long() + 1) % tiny_model.config.n_routed_experts
    mb.routing = shifted
    with torch.no_grad():
        moved = trainer_logprobs(tiny_model, mb, replay)
    assert not torch.allclose(moved[mb.loss_mask], logp[mb.loss_mask], atol=1e-4), "replayed ids are used"
    agreed, total = replay.agreement()
    assert agreed < total


def test_replay_changes_gradients_only_through_gating(tiny_model):
    [seq] = generate(copy.deepcopy(tiny_model), [[5, 6, 7, 8]])
    [[mb]] = pack([to_sample(seq)], 1, 4096)
    reference = copy.deepcopy(tiny_model)
    plain = torch.autograd.grad(trainer_logprobs(reference, mb, None).sum(), list(reference.parameters()), allow_unused=True)
    replay = Replay(tiny_model)
    with replay.use(mb.routing):
        out = tiny_model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
    grads = torch.autograd.grad(token_logprobs(out.logits[0], mb.target_ids).sum(), list(tiny_model.parameters()), allow_unused=True)
    names = [n for n, _ in tiny_model.named_parameters()]
    for name, a, b in zip(names, plain, grads):
        assert (a is None) == (b is None), name
        if a is not None:  # same ids replayed: identical gradients, router weights included
            assert torch.allclose(a, b, atol=1e-6), name
    router_grads = [g for n, g in zip(names, grads) if n.endswith("gate.weight")]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads), "the router still learns"
    assert all(not r.e_score_correction_bias.requires_grad for r in routers(tiny_model))


def test_bias_and_groups_cannot_change_replayed_ids(tiny_model):
    replay = Replay(tiny_model)
    router = replay.routers[0]
    router.e_score_correction_bias.fill_(0)
    router.e_score_correction_bias[3] = 100.0  # the router's own choice now always includes expert 3
    h = torch.randn(6, tiny_model.config.hidden_size)
    ids = torch.tensor([[0, 1]] * 6)
    replay.routers[0]._prl_ids = ids
    _, weights, chosen = router(h)
    assert torch.equal(chosen, ids)
    expected = torch.sigmoid(h @ router.weight.T).gather(1, ids)
    assert torch.allclose(weights, expected / expected.sum(-1, keepdim=True) * router.routed_scaling_factor)


def test_packing_and_sequence_sharding_keep_routing_aligned():
    layers, k = 2, 3
    samples = []
    for i in range(5):
        prompt = list(range(10 + i, 14 + i))
        completion = list(range(40 + i, 43 + i))
        n = len(prompt) + len(completion) - 1
        tokens = torch.tensor((prompt + completion)[:-1], dtype=torch.uint8)
        routing = tokens[:, None, None].expand(n, layers, k).clone()  # routing encodes its token
        samples.append(Sample(prompt, completion, [0.0] * 3, [0] * 3, routing=routing))
    for mb in [m for rank in pack(samples, 2, 16) for m in rank]:
        if mb.routing is None:
            continue
        assert torch.equal(mb.routing[:, 0, 0].long(), mb.input_ids)
        for cp in (2, 3):
            parts = [shard_sequence(mb, r, cp) for r in range(cp)]
            assert torch.equal(torch.cat([p.input_ids for p in parts]), mb.input_ids)
            for p in parts:
                assert torch.equal(p.routing[:, 1, 2].long(), p.input_ids)


def test_router_replay_on_dense_model_is_rejected(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[model]\nnum_layers = 2\nfirst_dense_layers = 2\n[trainer]\nrouter_replay = true\n")
    with pytest.raises(RecipeError, match="trainer.router_replay needs an MoE model"):
        load_recipe(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_replays(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2)
    kw.update({"qwen3_moe": dict(num_experts=8, head_dim=16),
               "deepseek_v3": dict(n_routed_experts=8, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
               "glm_moe_dsa": dict(n_routed_experts=8, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_n_heads=2,
                                   index_head_dim=16, index_topk=64)}[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw)).eval()
    for r in routers(model):
        torch.nn.init.normal_(r.weight, std=0.5)
    seqs = generate(copy.deepcopy(model), [[5, 6, 7], [8, 9]], max_tokens=4)
    [[mb]] = pack([to_sample(s) for s in seqs], 1, 4096)
    with torch.no_grad():
        logp = trainer_logprobs(model, mb, Replay(model))
    assert torch.allclose(logp[mb.loss_mask], mb.infer_logprobs[mb.loss_mask], atol=1e-5)


def test_bf16_engine_against_fp32_trainer(tiny_model):
    """The precision knob: a bf16 engine disagrees a little with an fp32 trainer; replay keeps ids."""
    seqs = generate(copy.deepcopy(tiny_model).to(torch.bfloat16), [[5, 6, 7], [8, 9, 10, 11]])
    [[mb]] = pack([to_sample(s) for s in seqs], 1, 4096)
    replay = Replay(tiny_model)
    with torch.no_grad():
        logp = trainer_logprobs(tiny_model, mb, replay)
    d = logp[mb.loss_mask] - mb.infer_logprobs[mb.loss_mask]
    assert 0 < d.abs().max() < 0.1
    agreed, total = replay.agreement()
    assert agreed / total > 0.9


def test_sparse_dsa_selection_agrees_between_engine_and_packed_trainer(tmp_path):
    """GLM-5 tiny model with index_topk 2, far below the sequences: the engine (one query against its
    cache) and the trainer (a packed row, other samples masked) keep the same keys, though the
    indexer's ReLU scores tie (checked: at the top-k boundary), because both break ties by position."""
    from prl.model.build import build_model
    from prl.model.dsa import index_scores, indexer_parts
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(index_topk=2), tmp_path / "m"), seed=3)
    prompts = [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13], [14, 15, 16, 17]]
    seqs = generate(copy.deepcopy(model), prompts, max_tokens=10)
    [[mb]] = pack([to_sample(s) for s in seqs], 1, 4096)
    with torch.no_grad():
        logp = trainer_logprobs(model, mb, None)
    assert torch.allclose(logp[mb.loss_mask], mb.infer_logprobs[mb.loss_mask], atol=1e-5)
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(mb.input_ids[None]))
    pos = mb.position_ids[None]
    cos_sin = model.model.rotary_emb(h, pos)
    q, k, w = indexer_parts(attn.indexer, h, attn.q_a_layernorm(attn.q_a_proj(h)), *cos_sin)
    seg = torch.cumsum((mb.position_ids == 0).long(), 0)
    n = seg.numel()
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    top = index_scores(attn.indexer, q, k, w)[0].masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True).values
    ties = (top[:, 1] == top[:, 2]) & (allowed.sum(1) > 2)
    assert ties.any(), "the indexer's scores tie at the top-k boundary among allowed keys (the case being tested)"


def test_indexer_keeps_every_key_unscored_while_topk_covers_them(tmp_path):
    """GLM-5 tiny model with index_topk 8: a prefill of 5 tokens, then decode steps one token at a time
    past 8 keys. While the top-k covers every key prl's indexer returns them all without scoring (and
    still fills its cache); past it, it scores the cached keys. Every step's logits equal an indexer
    that always scores (the same stable top-k) on the same cache, and a no-cache forward of the row."""
    from transformers import DynamicCache

    from prl.model import dsa
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    class AlwaysScored:
        def forward(self, hidden, q_resid, position_embeddings, attention_mask, position_ids=None, past_key_values=None):
            q, k, w = dsa.indexer_parts(self, hidden, q_resid, *position_embeddings)
            k = past_key_values.update_indexer(k, self.layer_idx)
            scores = dsa.index_scores(self, q, k, w) + attention_mask
            return dsa.stable_topk(scores, min(self.index_topk, k.shape[1])).to(torch.int32)

    ours = build_model(write_model_dir(ModelCfg(index_topk=8), tmp_path / "m"), seed=5).eval()
    theirs = copy.deepcopy(ours)
    for m in theirs.modules():
        if isinstance(m, dsa.StableIndexer):
            m.__class__ = type("AlwaysScored", (AlwaysScored, type(m)), {})
    ids = torch.tensor([[5, 9, 14, 7, 22, 8, 30, 11, 6, 19, 12, 25]])
    caches = [DynamicCache(config=ours.config), DynamicCache(config=theirs.config)]
    with torch.no_grad():
        steps = [(0, 5)] + [(t, t + 1) for t in range(5, ids.shape[1])]
        for a, b in steps:
            pos = torch.arange(a, b)[None]
            got, want = (m(input_ids=ids[:, a:b], position_ids=pos, past_key_values=c, use_cache=True).logits
                         for m, c in zip((ours, theirs), caches))
            assert torch.allclose(got, want, atol=1e-5), f"tokens {a}..{b}: prl's indexer differs from scoring every key"
        whole = ours(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got[:, -1], whole[:, -1], atol=1e-5)
    assert caches[0].layers[0].indexer_keys.shape[1] == ids.shape[1]  # every step's keys went into the cache
