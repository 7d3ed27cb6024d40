"""The engine core in-process: continuous batching, in-flight weight updates, version salt."""

import pytest
import torch

from prl.inference.engine import EngineCore, Policy, SamplingParams, Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def run_all(core: EngineCore, seqs):
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


def test_batched_greedy_matches_alone(tiny_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19]]
    alone = [run_all(EngineCore(tiny_model), [Sequence(p, GREEDY)])[0] for p in prompts]
    together = run_all(EngineCore(tiny_model), [Sequence(p, GREEDY) for p in prompts])
    for a, b in zip(alone, together):
        assert a.out_ids == b.out_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3_moe"])
def test_prompts_prefilled_together_equal_each_alone(arch, tmp_path):
    """Prompts of different lengths joining in one step share one left-padded forward; each gets the
    tokens and logprobs it gets alone (GLM-5 with a DSA indexer keeping 4 keys: padding never selected)."""
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch=arch, num_layers=2, index_topk=4), tmp_path / arch), seed=0)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9], [15, 4, 22, 7, 30], [16, 17, 18, 19, 20, 21], [8, 9]]
    alone = [run_all(EngineCore(model), [Sequence(p, GREEDY)])[0] for p in prompts]
    core = EngineCore(model)
    together = run_all(core, [Sequence(p, GREEDY) for p in prompts])
    assert core.stats.batched_prefills == 1 and core.stats.prefix_hits == 1  # the repeated prompt: a hit
    for a, b in zip(alone, together):
        assert a.out_ids == b.out_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def test_request_joins_mid_generation(tiny_model):
    core = EngineCore(tiny_model)
    long = Sequence([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=30))
    core.add(long)
    for _ in range(4):
        core.step()
    short = Sequence([9, 10], SamplingParams(temperature=0.0, max_tokens=3))
    core.add(short)
    while not short.finish_reason:
        core.step()
    assert short.admitted_at_step == 4
    assert long.finish_reason is None, "the short request finished while the long one still ran"
    alone = run_all(EngineCore(tiny_model), [Sequence([9, 10], SamplingParams(temperature=0.0, max_tokens=3))])[0]
    assert short.out_ids == alone.out_ids


def test_waiting_prompts_are_prefilled_ahead_in_a_joining_ones_forward(tiny_model):
    """Behind a full batch, requests wait; the forward of a prompt joining now also computes the
    prompts of up to three waiting ones (`_ahead`), which later join with no forward of their own and
    generate what they generate alone."""
    core = EngineCore(tiny_model, max_batch_size=2)
    first = [Sequence([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=n)) for n in (3, 30)]
    waiting = [Sequence(p, GREEDY) for p in ([9, 10], [11, 12, 13], [14], [15, 16, 17, 18], [19, 20])]
    for s in first + waiting:
        core.add(s)
    core.step()
    assert [s.admitted_at_step for s in waiting] == [-1] * 5, "the batch is full"
    assert core.stats.prefill_forwards == 1 and core.stats.prefilled_ahead == 3, "one forward, four prompts"
    while waiting[3].admitted_at_step < 0:
        core.step()
    assert core.stats.prefill_forwards == 2 and core.stats.prefilled_ahead == 4, "the fourth's, and the fifth ahead"
    while core.has_work():
        core.step()
    assert core.stats.prefill_forwards == 2, "those computed ahead joined with no forward"
    assert core.stats.prefill_tokens == 3 + 2 + 3 + 1 + 4 + 2, "each prompt computed once"
    st = core.stats  # those computed ahead count as computed, not as hits when they join
    assert st.prefix_hits == 1 and st.prefill_tokens + st.prefix_hit_tokens == st.prompt_tokens
    for seq in waiting:
        ref = run_all(EngineCore(tiny_model), [Sequence(seq.prompt_ids, GREEDY)])[0]
        assert seq.out_ids == ref.out_ids
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)


def test_a_short_shared_instruction_is_recomputed_in_a_shared_forward(tiny_model):
    """Prompts sharing a short instruction (4 of 9 tokens, as reverse's "rev:") with an earlier entry
    join in one forward that recomputes it, rather than one forward each after the reused prefix; a
    prompt extending an entry by little (a conversation's next turn) reuses its prefix."""
    core = EngineCore(tiny_model)
    first = run_all(core, [Sequence([3, 4, 5, 6, 7, 8, 9, 10, 11], SamplingParams(temperature=0.0, max_tokens=4))])[0]
    tails = ([12, 13, 14, 15, 16], [17, 18, 19, 20, 21], [22, 23])
    others = [Sequence([3, 4, 5, 6, *tail], GREEDY) for tail in tails]
    turn = Sequence(first.prompt_ids + first.out_ids + [4], GREEDY)
    run_all(core, [*others, turn])
    assert core.stats.prefill_forwards == 3, "the first, the three sharing one forward, the turn's own"
    # the first's KV: its prompt and all it generated but the last token (never fed back), within
    # SHORT_HIT: reused because the turn extends it, not for its length
    reused = len(first.prompt_ids) + len(first.out_ids) - 1
    assert reused <= 16
    assert core.stats.prefix_hits == 1 and core.stats.prefix_hit_tokens == reused
    for seq in [*others, turn]:
        ref = run_all(EngineCore(tiny_model), [Sequence(seq.prompt_ids, GREEDY)])[0]
        assert seq.out_ids == ref.out_ids
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)


def test_requests_arriving_one_by_one_wait_to_share_a_prefill_forward(tiny_model):
    """`prefill_wait_steps`: while a batch decodes, a request arriving alone waits (up to that many
    decode steps) for others to share its prefill forward. Four prompts arriving on four steps are
    prefilled in one forward and generate what they generate alone; one more, alone, joins after its
    wait; an empty batch admits at once."""
    core = EngineCore(tiny_model, prefill_wait_steps=8)
    long = Sequence([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=40))
    core.add(long)
    core.step()
    assert long.admitted_at_step == 0 and core.stats.prefill_forwards == 1, "an empty batch admits at once"
    late = []
    for p in ([9, 10], [11, 12, 13], [14], [15, 16, 17, 18]):
        late.append(Sequence(p, GREEDY))
        core.add(late[-1])
        core.step()
    assert [s.admitted_at_step for s in late] == [4] * 4, "admitted together once four prompts waited"
    assert core.stats.prefill_forwards == 2 and core.stats.batched_prefills == 1
    alone = Sequence([19, 20], GREEDY)
    core.add(alone)
    arrived = core.stats.steps
    while alone.admitted_at_step < 0:
        core.step()
    assert alone.admitted_at_step == arrived + 8, "alone, it waited prefill_wait_steps decode steps"
    while core.has_work():
        core.step()
    core.add(Sequence([21, 22, 23], SamplingParams(temperature=0.0, max_tokens=20)))
    core.step()
    turn = Sequence(late[0].prompt_ids + late[0].out_ids + [4], GREEDY)  # extends a finished request's KV
    core.add(turn)
    core.step()
    assert turn.admitted_at_step == core.stats.steps - 1, "a conversation's next turn does not wait"
    while core.has_work():
        core.step()
    for seq in [*late, alone]:
        ref = run_all(EngineCore(tiny_model), [Sequence(seq.prompt_ids, GREEDY)])[0]
        assert seq.out_ids == ref.out_ids
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)


def perturbed(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g).to(v.device) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def test_inflight_update_changes_version_and_keeps_kv(tiny_model):
    import copy

    reference = run_all(EngineCore(copy.deepcopy(tiny_model)), [Sequence([5, 6, 7], GREEDY)])[0]
    core = EngineCore(tiny_model)
    seq = Sequence([5, 6, 7], GREEDY)
    core.add(seq)
    for _ in range(4):
        core.step()
    n = len(seq.out_ids)
    width_before, prefilled = core.batch.width, core.stats.prefill_tokens
    done = core.stage_weights(Policy(perturbed(tiny_model), {}, version=1))
    core.step()
    assert done.is_set() and core.version == 1
    assert core.batch.width == width_before + 1, "the running request kept its KV cache"
    while core.has_work():
        core.step()
    assert core.stats.prefill_tokens == prefilled, "nothing was recomputed"
    assert seq.versions == [-1] * n + [1] * (len(seq.versions) - n)
    assert seq.logprobs[:n] == reference.logprobs[:n]
    assert seq.logprobs[n:] != reference.logprobs[n:len(seq.logprobs)], "new weights produced the later tokens"


def test_prefix_cache_is_salted_by_version(tiny_model):
    core = EngineCore(tiny_model)
    run_all(core, [Sequence([5, 6, 7, 8], GREEDY), Sequence([5, 6, 7, 8], GREEDY)])
    assert core.stats.prefix_hits == 1 and core.stats.prefill_tokens == 4
    core.stage_weights(Policy(perturbed(tiny_model), {}, version=1))
    new = run_all(core, [Sequence([5, 6, 7, 8], GREEDY)])[0]
    assert core.stats.prefix_hits == 1 and core.stats.prefill_tokens == 8, "old-version prefix not reused"
    assert new.versions[0] == 1


def test_rejected_weights_leave_old_version_serving(tiny_model, tmp_path):
    """An engine serving v1: a weight folder missing a tensor, and one whose bytes were damaged, are
    refused before they touch the model; the engine still serves v1, with v1's weights and outputs."""
    import pytest

    from prl.inference.engine import WeightLoadError, prepare_weights
    from prl.model.weights import write_weights

    v1 = perturbed(tiny_model)
    policy = prepare_weights(tiny_model, write_weights(tmp_path / "v1", v1, {"version": 1}))
    assert policy.version == 1 and all(torch.equal(policy.state[k], v) for k, v in v1.items())
    core = EngineCore(tiny_model)
    core.stage_weights(policy)
    before = run_all(core, [Sequence([5, 6, 7], GREEDY)])[0]
    assert core.version == 1 and before.versions == [1] * len(before.out_ids)
    broken = perturbed(tiny_model, seed=2)
    broken.pop(next(iter(broken)))
    with pytest.raises(WeightLoadError, match="missing"):
        prepare_weights(tiny_model, write_weights(tmp_path / "v2", broken, {"version": 2}))
    corrupt = write_weights(tmp_path / "v3", perturbed(tiny_model, seed=3), {"version": 3})
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(WeightLoadError, match="sha256"):
        prepare_weights(tiny_model, corrupt)
    assert all(torch.equal(tiny_model.state_dict()[k], v) for k, v in v1.items()), "a refused folder touched the model"
    after = run_all(core, [Sequence([5, 6, 7], GREEDY)])[0]
    assert core.version == 1 and after.versions == before.versions
    assert after.out_ids == before.out_ids and after.logprobs == before.logprobs


def test_non_finite_weights_are_named_whatever_their_dtype():
    """A version's screen names exactly the tensors holding a NaN or an infinity: in each screened dtype, in FP8
    (checked element by element), beside a finite float16 tensor whose norm overflows (cleared by the element
    check, not named) and integer buffers (never named)."""
    from prl.model.weights import nonfinite_names

    state = {"f32": torch.ones(4, 3), "f32_nan": torch.ones(5), "bf16_inf": torch.ones(7, dtype=torch.bfloat16),
             "f16_big": torch.full((64,), 60000.0, dtype=torch.float16), "f16_ninf": torch.zeros(3, dtype=torch.float16),
             "f64": torch.ones(2, dtype=torch.float64), "fp8": torch.ones(8).to(torch.float8_e4m3fn),
             "fp8_nan": torch.ones(8).to(torch.float8_e4m3fn), "ids": torch.arange(4)}
    state["f32_nan"][3] = float("nan")
    state["bf16_inf"][0] = float("inf")
    state["f16_ninf"][2] = float("-inf")
    state["fp8_nan"][5] = float("nan")
    assert not torch.isfinite(torch._foreach_norm([state["f16_big"]])[0]), "the float16 norm overflows"
    assert nonfinite_names(state) == ["f32_nan", "bf16_inf", "f16_ninf", "fp8_nan"]
    assert nonfinite_names({k: state[k] for k in ("f32", "f16_big", "f64", "fp8", "ids")}) == []


def test_an_aborted_request_leaves_the_batch_and_the_others_continue(tiny_model):
    core = EngineCore(tiny_model, max_batch_size=4)
    done = []
    keep = Sequence([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12), on_done=done.append)
    drop = Sequence([8, 9], SamplingParams(temperature=0.0, max_tokens=12), on_done=done.append)
    waiting = Sequence([10], SamplingParams(temperature=0.0, max_tokens=12), on_done=done.append)
    core.add(keep)
    core.add(drop)
    core.step()
    core.step()
    core.abort(drop)
    core.add(waiting)
    core.abort(waiting)  # not admitted yet: removed at once
    while keep.finish_reason is None:
        core.step()
    assert drop.finish_reason == "abort" and len(drop.out_ids) < 12
    assert keep.finish_reason == "length" and len(keep.out_ids) == 12
    assert waiting not in core.waiting and waiting.out_ids == []
    alone = Sequence([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12))
    core.add(alone)
    while alone.finish_reason is None:
        core.step()
    assert alone.out_ids == keep.out_ids, "the batch after the abort computes what a clean run does"


def test_a_compiled_engine_serves_what_the_eager_one_does(tmp_path):
    """`inference.compile`: every forward through torch.compile. The same greedy tokens and logprobs as
    eager through a batched prefill, a reused prefix, requests joining mid-generation and weights loaded
    in flight (parameters are the compiled graphs' inputs, not constants baked in); the warm-up that
    compiles leaves nothing behind."""
    import copy

    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch="qwen3_moe", num_layers=1), tmp_path / "m"), seed=0)
    new_weights = perturbed(model)

    def serve(core):
        core.warm_up()
        assert core.stats.generated_tokens == 0 and not core.prefix.entries and core.version == -1
        return serve_through_a_load(core, new_weights, ([5, 6, 7], [8, 9, 10, 11, 12], [13, 14]), 0, [4], [9, 10])

    eager, eager_stats = serve(EngineCore(copy.deepcopy(model)))
    compiled, stats = serve(EngineCore(model, compiled=True))
    assert stats.prefix_hits == eager_stats.prefix_hits >= 1 and stats.batched_prefills == eager_stats.batched_prefills
    assert -1 in compiled[-1].versions and 1 in compiled[-1].versions, "the late request spans the load"
    for a, b in zip(eager, compiled):
        assert b.out_ids == a.out_ids and b.versions == a.versions
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def serve_through_a_load(core, new_weights, prompts, extend: int, suffix: list[int], late: list[int]):
    """Greedy `prompts` to the end; then a next turn extending prompt `extend`'s KV by `suffix` and a
    `late` request, with a weight load (version 1) staged three decode steps in. The sequences in order
    (the prompts', the turn, the late one) and the engine's stats."""
    first = run_all(core, [Sequence(p, GREEDY) for p in prompts])
    turn = Sequence(first[extend].prompt_ids + first[extend].out_ids + suffix, GREEDY)
    late = Sequence(late, SamplingParams(temperature=0.0, max_tokens=20))
    core.add(turn)
    core.add(late)
    for _ in range(3):
        core.step()
    core.stage_weights(Policy(new_weights, {}, version=1))
    while core.has_work():
        core.step()
    return [*first, turn, late], core.stats


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm_moe_dsa"])
@pytest.mark.parametrize("r3", [False, True])
def test_the_lean_forward_serves_what_the_model_forward_does(arch, r3, tmp_path):
    """Qwen3-MoE's and GLM-5's lean forwards (`prl.model.lean_forward`, the engine's default) against
    the engine calling transformers' forward: the same greedy tokens, logprobs and (R3) captured routing
    through a left-padded batched prefill (without R3), a conversation's next turn extending a reused
    prefix, requests joining and leaving mid-generation and a weight load in flight. Each of: padding
    unmasked, the causal mask dropped, rope's sign or the experts' weights swapped, GLM-5's shared experts
    left out, fails it (checked)."""
    lean_against_model_forward(tmp_path, arch, r3, torch.device("cpu"), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm_moe_dsa"])
def test_the_lean_forward_keeps_fp8_layers(arch, tmp_path):
    """With `inference.fp8` the lean forward goes through prl's FP8 linears and experts, not around them
    (`linear` and `routed` take only transformers' plain modules): it serves what the model forward does.
    `linear` taking any nn.Linear subclass (Qwen3-MoE) or `routed` any experts (GLM-5) fails it (checked)."""
    lean_against_model_forward(tmp_path, arch, False, torch.device("cpu"), atol=1e-4, fp8=True)


@pytest.mark.parametrize("arch,attn", [("qwen3_moe", "sdpa"), ("glm_moe_dsa", "sdpa"), ("glm_moe_dsa", "eager")])
def test_the_lean_forward_rounds_as_the_model_forward_does(arch, attn, tmp_path):
    """In bf16 the lean forward serves exactly what the model forward does, under transformers' sdpa and
    eager attention: the same kernels and the same order of roundings (the routing weights applied in
    fp32, GLM-5's shared experts added to the routed ones before the residual; GLM-5's attention under
    eager takes an additive mask). Each of those undone fails it (checked)."""
    lean_against_model_forward(tmp_path, arch, False, torch.device("cpu"), atol=0.0, dtype="bfloat16", attn=attn)


def lean_against_model_forward(tmp_path, arch: str, r3: bool, device: torch.device, atol: float,
                               fp8: bool = False, dtype: str = "float32", attn: str | None = None) -> None:
    """Also `tests/test_gpu.py`'s, on CUDA."""
    import copy

    from prl.model.build import build_model
    from prl.model.fp8 import apply_fp8
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    cfg = ModelCfg(arch=arch, num_layers=3, index_topk=4)  # GLM-5: the DSA indexer keeps 4 keys of up to 30
    model = build_model(write_model_dir(cfg, tmp_path / "m"), seed=0, dtype=dtype).to(device)
    if attn:
        model.config._attn_implementation = attn
    if fp8:
        assert apply_fp8(model)["fp8"]
    new_weights = perturbed(model)

    def serve(core):
        prompts = ([5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [13, 14])
        return serve_through_a_load(core, new_weights, prompts, 1, [4, 9], [9, 10, 11])

    hf, hf_stats = serve(EngineCore(copy.deepcopy(model), capture_routing=r3, lean=False))  # before the load
    lean_core = EngineCore(model, capture_routing=r3)
    assert lean_core.lean is not None
    lean, stats = serve(lean_core)
    assert stats.prefix_hits == hf_stats.prefix_hits >= 1 and stats.batched_prefills == hf_stats.batched_prefills
    assert stats.batched_prefills == (0 if r3 else 1)
    assert -1 in lean[-1].versions and 1 in lean[-1].versions, "the late request spans the load"
    for a, b in zip(hf, lean):
        assert b.out_ids == a.out_ids and b.versions == a.versions
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=atol, rtol=0)
        if r3:
            assert torch.equal(b.prompt_routing, a.prompt_routing)
            assert torch.equal(b.completion_routing(), a.completion_routing())


def test_latent_decode_equals_the_expanded_attention(tmp_path):
    """GLM-5's MLA decode in the latent space (`prl.model.mla`, what the engine installs) against
    transformers' forward that expands the cache into per-head keys and values: same logits over a
    left-padded batch, a DSA indexer keeping 4 of up to 16 keys, and 6 decode steps on the cache."""
    from prl.model import mla
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch="glm_moe_dsa", num_layers=2, index_topk=4), tmp_path / "m"), seed=0)
    ids = torch.randint(3, 30, (3, 10), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(3, 10, dtype=torch.long)
    pad[1, :4] = 0  # row 1: 4 padded slots on the left

    @torch.no_grad()
    def decode():
        out = model(input_ids=ids, attention_mask=pad, use_cache=True)
        cache, mask, logits = out.past_key_values, pad, []
        for i in range(6):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            out = model(input_ids=ids[:, i:i + 1], attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                        use_cache=True, past_key_values=cache)
            logits.append(out.logits)
        return torch.cat(logits, 1)

    expanded = decode()
    assert mla.install(model) == 2 and mla.install(model) == 2  # one per layer; twice is a no-op
    attn = model.model.layers[0].self_attn
    assert mla.latent_is_cheaper(attn, 1, 16) and not mla.latent_is_cheaper(attn, 4096, 4096)
    torch.testing.assert_close(decode(), expanded, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3_moe"])
def test_scored_tokens_are_the_models_own_logprobs_and_the_sampled_ones(arch, tmp_path):
    """`score` (a teacher's one forward, nothing generated) gives each token's logprob under transformers' own
    forward of the untouched model (fp32), and, for tokens the engine sampled at temperature 1, the logprobs it
    returned with them; under a loaded version it says that version. Greedy logprobs are not compared: they are
    of the sampled distribution too, which at temperature 1 is the model's."""
    import copy

    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch=arch, num_layers=2, index_topk=4), tmp_path / arch), seed=0)
    reference = copy.deepcopy(model).eval()
    core = EngineCore(model)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 4, 22]
    [got], version = core.score([(ids, 3)])
    with torch.no_grad():
        logp = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    want = [logp[i - 1, ids[i]].item() for i in range(3, len(ids))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert version == -1 and len(got) == len(ids) - 3
    [seq] = run_all(core, [Sequence([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=8, seed=1))])
    [again], _ = core.score([([5, 6, 7, *seq.out_ids], 3)])
    torch.testing.assert_close(torch.tensor(again), torch.tensor(seq.logprobs), atol=1e-4, rtol=0)
    shifted = {k: v + 0.01 for k, v in model.state_dict().items() if v.is_floating_point()}
    core.stage_weights(Policy(shifted, {}, version=4))
    core.apply_staged()
    [moved], version = core.score([(ids, 3)])
    assert version == 4 and max(abs(a - b) for a, b in zip(moved, got)) > 1e-3
    items = [(ids, 3), ([9, 8, 7], 1), (ids[:6], 5)]  # one forward, padded: each as if alone
    batched, _ = core.score(items)
    split, _ = core.score(items, budget=20)  # two forwards: [ids], then [[9, 8, 7], ids[:6]]
    for (one, start), row, part in zip(items, batched, split):
        [alone], _ = core.score([(one, start)])
        torch.testing.assert_close(torch.tensor(row), torch.tensor(alone), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(part), torch.tensor(alone), atol=1e-5, rtol=0)
