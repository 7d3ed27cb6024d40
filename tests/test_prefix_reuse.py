"""Multi-turn prefix reuse in the embedded engine (`prl.inference.prefix_cache`): a growing token
history computes only its new tokens, samples what a cache-less engine samples, returns the routing a
fresh prefill gives, never reuses another weights version's KV, and stays within its bounds.

The model is GLM-5's tiny architecture with a DSA indexer that keeps fewer keys than the history
holds (`index_topk` 8), so a reused prefix's indexer keys decide which keys every later token attends.
"""

import copy

import pytest
import torch

from prl.inference.engine import EngineCore, Policy, SamplingParams, Sequence
from prl.inference.prefix_cache import BLOCK, PrefixCache

ENV = 7  # environment tokens appended after each completion


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    return build_model(write_model_dir(ModelCfg(num_layers=2, index_topk=8), tmp_path_factory.mktemp("m")), seed=0)


def finish(core: EngineCore, seqs: list[Sequence]) -> list[Sequence]:
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


def sampled(prompt: list[int], seed: int, n: int = 10) -> Sequence:
    return Sequence(list(prompt), SamplingParams(temperature=1.0, max_tokens=n), generator=torch.Generator().manual_seed(seed))


def conversations(core: EngineCore, turns: int = 3, branches: int = 2):
    """`branches` conversations from one prompt, run side by side, each turn the whole history
    (prompt, completions, environment tokens) as ids; per turn the tokens computed and the sequences."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 40, (21,), generator=g).tolist()
    histories, out = [prompt] * branches, []
    for turn in range(turns):
        before = core.stats.prefill_tokens
        seqs = finish(core, [sampled(h, seed=100 * turn + b) for b, h in enumerate(histories)])
        out.append((core.stats.prefill_tokens - before, seqs))
        histories = [h + s.out_ids + torch.randint(4, 40, (ENV,), generator=g).tolist() for h, s in zip(histories, seqs)]
    return out


def test_a_growing_history_computes_only_its_new_tokens_and_samples_the_same(model):
    reused = conversations(EngineCore(model, capture_routing=True))
    plain = conversations(EngineCore(model, capture_routing=True, prefix_cache_entries=0))
    assert reused[0][0] == 21, "turn 1: the prompt once; the second branch reuses it whole"
    for computed, _ in reused[1:]:
        assert computed == 2 * (ENV + 1), "per branch: the environment tokens and the last sampled token"
    for (computed, _), (_, ref) in zip(reused[1:], plain[1:]):
        assert computed < sum(len(s.prompt_ids) for s in ref)
    for (_, seqs), (_, ref) in zip(reused, plain):
        for s, r in zip(seqs, ref):
            assert s.prompt_ids == r.prompt_ids and s.out_ids == r.out_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)


def test_a_conversation_holds_one_entry_with_its_indexer_keys(model):
    core = EngineCore(model)
    *_, (_, seqs) = conversations(core, turns=3, branches=1)
    assert len(core.prefix) == 1, "each turn's entry replaced the one it extended"
    entry = next(iter(core.prefix.entries.values()))
    s = seqs[0]
    assert entry.ids == tuple(s.prompt_ids + s.out_ids[:-1])
    for layer in entry.cache.layers:
        assert layer.keys.shape[-2] == layer.indexer_keys.shape[1] == len(entry.ids)


def test_a_final_sequence_leaves_no_entry_but_still_reuses(model):
    """A sequence its client marks final (nothing will extend it: a single-turn rollout, a last turn) reuses the
    prefix it extends and keeps its prompt's KV, but none of what it generated when it finishes; an unmarked
    one is kept."""
    core = EngineCore(model)
    prompt = torch.randint(4, 40, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    [first] = finish(core, [sampled(prompt, seed=1)])
    kept = tuple(prompt + first.out_ids[:-1])
    assert {e.ids for e in core.prefix.entries.values()} == {kept}
    last = sampled(list(kept) + [first.out_ids[-1]] + [5] * ENV, seed=2)
    last.final = True
    before = core.stats.prefill_tokens
    finish(core, [last])
    assert core.stats.prefill_tokens - before == ENV + 1, "the final turn reused the first turn's KV"
    entries = {e.ids for e in core.prefix.entries.values()}
    assert entries == {tuple(last.prompt_ids)}, "its prompt's entry (for members admitted later), not its own KV"
    again = sampled(prompt, seed=1)  # unmarked, the same as the first: kept when it finishes
    finish(core, [again])
    assert tuple(prompt + again.out_ids[:-1]) in {e.ids for e in core.prefix.entries.values()}


def test_the_reused_prefix_routing_equals_a_fresh_prefill(model):
    *_, (_, seqs) = conversations(EngineCore(model, capture_routing=True), turns=3, branches=2)
    for s in seqs:
        fresh = finish(EngineCore(model, capture_routing=True, prefix_cache_entries=0), [sampled(s.prompt_ids, 0, n=1)])[0]
        assert s.prompt_routing.shape[0] == len(s.prompt_ids)
        assert torch.equal(s.prompt_routing, fresh.prompt_routing), "R3: the reused prefix's routing comes back"


def perturbed(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def test_nothing_of_an_old_version_is_reused(model):
    core = EngineCore(copy.deepcopy(model))
    first = finish(core, [sampled(list(range(4, 30)), seed=1)])[0]
    core.stage_weights(Policy(perturbed(model), {}, version=1))
    core.step()
    history = first.prompt_ids + first.out_ids + [5] * ENV
    hits, computed = core.stats.prefix_hit_tokens, core.stats.prefill_tokens
    again = finish(core, [sampled(history, seed=2)])[0]
    assert core.stats.prefix_hit_tokens == hits and core.stats.prefill_tokens - computed == len(history)
    assert set(again.versions) == {1}
    # a sequence running across the load continues under v1, but its v0 prefix is never kept
    span = sampled(list(range(6, 40)), seed=3, n=12)
    core.add(span)
    for _ in range(4):
        core.step()
    core.stage_weights(Policy(perturbed(model, seed=2), {}, version=2))
    finish(core, [])
    assert set(span.versions) == {1, 2} and len(core.prefix) == 0
    hits = core.stats.prefix_hit_tokens
    finish(core, [sampled(span.prompt_ids + span.out_ids + [5] * ENV, seed=4)])
    assert core.stats.prefix_hit_tokens == hits
    # the salt is the version itself, not only the clearing on a load
    core.version = 3
    finish(core, [sampled(span.prompt_ids + span.out_ids + [5] * ENV + [6], seed=4)])
    assert core.stats.prefix_hit_tokens == hits


def test_eviction_keeps_the_cache_within_its_bounds(model):
    core = EngineCore(model, prefix_cache_entries=3)
    prompts = [[4 + i] + list(range(10, 30)) for i in range(6)]
    for p in prompts:
        finish(core, [sampled(p, seed=0, n=4)])
        assert len(core.prefix) <= 3
    before = core.stats.prefill_tokens
    finish(core, [sampled(prompts[0], seed=0, n=1)])
    assert core.stats.prefill_tokens - before == len(prompts[0]), "the oldest was evicted"
    before = core.stats.prefill_tokens
    finish(core, [sampled(prompts[-1], seed=0, n=1)])
    assert core.stats.prefill_tokens == before, "the newest is whole, with its last logits"

    budget = EngineCore(model, prefix_cache_tokens=60)
    for p in prompts:
        finish(budget, [sampled(p, seed=0, n=4)])
        assert 0 < budget.prefix.tokens <= 60
        assert budget.prefix.tokens == sum(len(e.ids) for e in budget.prefix.entries.values())


def test_matches_are_per_token_and_a_hash_collision_is_a_miss(monkeypatch):
    cache = PrefixCache(max_entries=8)
    base = tuple(range(100, 100 + 2 * BLOCK + 5))
    cache.insert(0, base, cache=None, routing=None)
    hit = cache.lookup(0, base[: BLOCK + 3] + (7, 8, 9))
    assert hit.tokens == BLOCK + 3, "the match ends at the first differing token, not a block boundary"
    assert cache.lookup(0, base).tokens == len(base) - 1, "no logits: the last token is computed"
    assert cache.lookup(1, base) is None, "another version"
    import prl.inference.prefix_cache as pc

    colliding = PrefixCache(max_entries=8)
    monkeypatch.setattr(pc, "hash", lambda _: 0, raising=False)  # every block key the same
    colliding.insert(0, base, cache=None, routing=None)
    assert colliding.lookup(0, tuple(range(2 * BLOCK + 5))) is None


def test_a_short_prompt_finds_its_longest_sharer_among_many():
    """Prompts under one block (a GRPO group's) reach the short levels' keys: among 60 entries that
    share 1 to 9 leading tokens with it, the lookup gives the longest sharer, and a prompt sharing
    nothing misses."""
    cache = PrefixCache(max_entries=100)
    prompt = tuple(range(1, 11))
    for i in range(60):
        shared = 1 + i % 9
        cache.insert(0, prompt[:shared] + (50 + i, 51 + i), cache=None, routing=None)
    hit = cache.lookup(0, prompt)
    assert hit.tokens == 9 and hit.entry.ids[:9] == prompt[:9]
    assert cache.lookup(0, (99, 98, 97)) is None


def test_rows_added_together_equal_rows_added_one_by_one(model):
    """`BatchCache.add_rows` (one copy for all joining rows) builds the cache and mask that adding each
    row alone builds."""
    from prl.inference.kvcache import BatchCache, layer_tensors

    caches = []
    with torch.no_grad():
        for n in (5, 9, 3):
            out = model(input_ids=torch.arange(4, 4 + n)[None], use_cache=True)
            caches.append((out.past_key_values, n))
    one, together = BatchCache(), BatchCache()
    for c, n in caches:
        one.add_rows([(copy.deepcopy(c), n)])
    together.add_rows([(copy.deepcopy(caches[0][0]), caches[0][1])])
    together.add_rows([(copy.deepcopy(c), n) for c, n in caches[1:]])
    assert torch.equal(one.mask, together.mask)
    for a, b in zip(one.cache.layers, together.cache.layers):
        for attr, _ in layer_tensors(a):
            assert torch.equal(getattr(a, attr), getattr(b, attr))
    # and each row is its own cache right-aligned behind zeros, its mask the last n columns (DSA's indexer
    # keys included)
    width = max(n for _, n in caches)
    for r, (c, n) in enumerate(caches):
        assert together.mask[r].tolist() == [False] * (width - n) + [True] * n
        for i, layer in enumerate(together.cache.layers):
            for attr, dim in layer_tensors(layer):
                row, src = getattr(layer, attr)[r: r + 1], getattr(c.layers[i], attr)
                d = dim % row.dim()
                assert torch.equal(row.narrow(d, width - n, n), src)
                assert not row.narrow(d, 0, width - n).any()


class MemoryStore:
    """The calls `KvPool` makes on a Mooncake store, over a dict (no master needed)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def batch_is_exist(self, keys):
        return [1 if k in self.objects else 0 for k in keys]

    def get_size(self, key):
        return len(self.objects.get(key, b""))

    def get(self, key):
        return self.objects[key]

    def put(self, key, data):
        self.objects[key] = bytes(data)
        return 0

    def close(self):
        pass


def test_local_reuse_and_the_kv_pool_together(model):
    """A conversation's turn reuses its own server's KV first and offers the pool only the chunks it
    lacks; another server then loads the whole history's chunks from the pool (issue 22: a
    conversation moving to another server) with the same routing as a fresh prefill."""
    from prl.inference.kv_pool import KvPool

    store, chunk = MemoryStore(), 8
    a = EngineCore(model, capture_routing=True, pool=KvPool(store, "run", chunk))
    b = EngineCore(model, capture_routing=True, pool=KvPool(store, "run", chunk))
    finish(a, [sampled([4, 5, 6], 0, n=2)])  # each engine's first prefill learns its cache layout
    finish(b, [sampled([4, 5, 7], 0, n=2)])
    first = finish(a, [sampled(list(range(4, 4 + 3 * chunk + 3)), seed=1)])[0]
    history = first.prompt_ids + first.out_ids + [9] * ENV
    a.pool.flush()
    puts, hits = a.pool.stats.stored_chunks, a.stats.prefix_hit_tokens
    second = finish(a, [sampled(history, seed=2)])[0]
    a.pool.flush()
    assert a.stats.prefix_hit_tokens - hits == len(first.prompt_ids) + len(first.out_ids) - 1
    assert a.pool.stats.hit_tokens == 0, "the local KV was longer than the pool's"
    assert a.pool.stats.stored_chunks - puts == len(history) // chunk - len(first.prompt_ids) // chunk
    third = second.prompt_ids + second.out_ids + [9] * ENV
    before = b.stats.prefill_tokens
    moved = finish(b, [sampled(third, seed=3)])[0]
    assert b.pool.stats.hit_tokens == len(history) // chunk * chunk, "the history's chunks came from the pool"
    assert b.stats.prefill_tokens - before == len(third) - len(history) // chunk * chunk
    fresh = finish(EngineCore(model, capture_routing=True, prefix_cache_entries=0), [sampled(third, seed=3)])[0]
    assert moved.out_ids == fresh.out_ids and torch.equal(moved.prompt_routing, fresh.prompt_routing)
