"""The trainer's lean forward (`prl.trainer.lean`) against the model's forward on the same parallelized
model: every token's logprob and every parameter's gradient, for Qwen3-MoE and GLM-5 with R3 replaying
routes the routers would not pick, over packed rows of several samples and shared-prompt trees; with
activation checkpointing and with FP8 layers swapped in too."""

import pytest
import torch

from prl.model.families import routed_experts
from prl.model.routing import routers
from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg, TrainerCfg
from prl.trainer import lean
from prl.trainer.model_setup import setup_model
from prl.trainer.step import forward_backward, token_outputs
from prl.transport.batch import pack, rows_by_sample
from test_shared_prompts import groups, one_rank  # noqa: F401  (one_rank: its one-rank group, autouse)


def step_of(model_dir, tcfg: TrainerCfg, lean_forward: bool):
    """The trainer's model (one rank, FSDP) with the lean forward or without; R3 routes for `groups`' samples,
    packed as plain rows of several samples, then as shared-prompt trees."""
    tcfg = tcfg.model_copy(update={"lean_forward": lean_forward})
    dims = tcfg.parallel.dims(1)
    dims.build_meshes("cpu")
    built = setup_model(model_dir, tcfg, dims, torch.device("cpu"))
    cfg = built.par.model.config
    samples = groups(len(routers(built.par.model)), routed_experts(cfg.to_dict()), cfg.num_experts_per_tok)
    return built, pack(samples, 1, 40)[0] + pack(samples, 1, 64, share_prompts=True)[0]


def grads_and_logprobs(built, tcfg, mbs) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """The step's stats and gradients, then each micro-batch's token logprobs as the step computes them (one
    backward per model: FSDP2 adds a later step's root gradients to an earlier one's after a forward without
    gradient, whatever the forward)."""
    model, replay = built.par.model, built.replay
    stats = forward_backward(model, replay, mbs, "rl", tcfg, 1.0, torch.device("cpu"))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    out = []
    with torch.no_grad():
        for mb in mbs:
            rows, width = rows_by_sample(mb, model.config.hidden_size)
            with replay.use(rows.routing):
                out.append(token_outputs(model, rows, width, None, 1.0, tcfg.logprob_chunk_tokens, entropy=True))
    return stats, grads, torch.cat(out)


@pytest.mark.parametrize("arch,extra", [("glm_moe_dsa", {}), ("qwen3_moe", {}),
                                        ("glm_moe_dsa", {"activation_checkpointing": True}),
                                        ("qwen3_moe", {"activation_checkpointing": True, "fp8": True}),
                                        ("glm_moe_dsa", {"fp8": True})])
def test_lean_forward_equals_the_model_forward(tmp_path, arch, extra):
    """topk 4: GLM-5's DSA indexer really selects, over the rows' masks."""
    model_dir = write_model_dir(ModelCfg(arch=arch, index_topk=4), tmp_path / "m")
    tcfg = TrainerCfg.model_validate({"router_replay": True, **extra})
    (hf, mbs), (built, _) = step_of(model_dir, tcfg, False), step_of(model_dir, tcfg, True)
    model = built.par.model
    assert built.par.lean and isinstance(model, lean.LeanCausalLM) and not hf.par.lean
    inner = []  # transformers' model forward: never called on the lean path
    model.model.register_forward_pre_hook(lambda *a: inner.append(1))
    assert len(mbs) > 2
    s_hf, g_hf, lp_hf = grads_and_logprobs(hf, tcfg, mbs)
    s, g, lp = grads_and_logprobs(built, tcfg, mbs)
    assert not inner
    assert s["routing_agreed"] < s["routing_ids"], "replay forced routes the routers would not pick"
    assert s["routing_agreed"] == s_hf["routing_agreed"] and s["routing_ids"] == s_hf["routing_ids"]
    assert s["loss_sum"] == pytest.approx(s_hf["loss_sum"], rel=1e-6)
    torch.testing.assert_close(lp, lp_hf, rtol=1e-5, atol=1e-5)
    # every parameter but the DSA indexer's (not trained by the loss: transformers computes it without gradient)
    assert g.keys() == g_hf.keys() and all(".indexer." in n for n, _ in model.named_parameters() if n not in g)
    for n in g:
        torch.testing.assert_close(g[n], g_hf[n], rtol=1e-4, atol=1e-8, msg=n)
    model._prl_lean = False  # the switch the class keeps: the model's forward again
    model(input_ids=mbs[0].input_ids[None], position_ids=mbs[0].position_ids[None])
    assert inner


def test_where_it_does_not_fit_the_model_forward_runs(tmp_path):
    """Sliding-window layers: install leaves the model as it is (and the trainer says so in `Parallel.lean`)."""
    from prl.model.build import build_model

    model = build_model(write_model_dir(ModelCfg(arch="qwen3_moe"), tmp_path / "m"), seed=0)
    model.config.use_sliding_window = True
    assert not lean.install(model) and not isinstance(model, lean.LeanCausalLM)
