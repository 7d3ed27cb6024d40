"""`prl plan`: parameter counts exact against built models, optimizer bytes exact against a real
Adam step, activation bytes against what autograd saves, and the verdicts the command prints."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, prl_cmd
from prl.model.tiny import write_model_dir
from prl.recipe import load_recipe
from prl.recipe.schema import ModelCfg
from prl.sizing.estimate import GB, make_plan
from prl.sizing.trainer import layer_activation_bytes
from prl.sizing.params import count

FLAGSHIP = ROOT / "recipes/glm5-131k-28xh200.toml"
CONFIGS = [ModelCfg(arch="glm_moe_dsa"), ModelCfg(arch="glm_moe_dsa", num_layers=3, first_dense_layers=2, num_experts=4),
           ModelCfg(arch="qwen3_moe"), ModelCfg(arch="qwen3_moe", num_layers=4, first_dense_layers=0, num_experts=16)]


def built(cfg: ModelCfg, tmp: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = write_model_dir(cfg, tmp / cfg.arch)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    return model, json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.arch}-{c.num_layers}x{c.num_experts}")
def test_parameter_counts_are_exact(cfg, tmp_path):
    model, config = built(cfg, tmp_path)
    n = count(config)
    assert n.total == sum(v.numel() for v in model.state_dict().values())
    params = dict(model.named_parameters())
    assert n.routed == sum(p.numel() for k, p in params.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert n.dense + n.routed == sum(p.numel() for p in params.values())


def test_glm5_defaults_count_744b_with_40b_active():
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GlmMoeDsaConfig())
    n = count(GlmMoeDsaConfig().to_dict())
    assert n.total == sum(v.numel() for v in model.state_dict().values())
    assert 743e9 < n.total < 745e9 and 40e9 < n.active < 42e9


def test_weight_and_optimizer_bytes_match_a_real_adam_step(tmp_path):
    """One rank: fp32 weights, gradients and both Adam moments are 16 bytes a parameter, to the byte.
    (Parameters no token reached, and the DSA indexer, which the loss does not train, get zero
    gradients first, as the plan counts every parameter as trained.)"""
    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml")
    model, config = built(recipe.model, tmp_path)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    real = sum(t.numel() * t.element_size() for p in model.parameters() for t in (p, p.grad))
    real += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim())
    real += sum(b.numel() * b.element_size() for k, b in model.named_buffers() if k.endswith("e_score_correction_bias"))
    plan = make_plan(recipe)
    planned = sum(v for k, v in plan.trainer.items() if k.startswith("weights+grads+Adam"))
    assert planned == real


def test_activation_bytes_match_what_autograd_saves(tmp_path):
    """A Qwen3-MoE layer (SDPA attention: no score matrix kept) at 2048 tokens: the tensors autograd
    saves for backward, parameters excluded, against the plan's per-layer count (stated tolerance 10%)."""
    from torch.autograd.graph import saved_tensors_hooks

    model, config = built(ModelCfg(arch="qwen3_moe"), tmp_path)
    model.config._attn_implementation = "sdpa"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = 2048
    h = torch.randn(1, tokens, config["hidden_size"], requires_grad=True)
    pos = torch.arange(tokens)[None]
    with saved_tensors_hooks(keep, lambda t: t):
        model.model.layers[1](h, position_embeddings=model.model.rotary_emb(h, pos), attention_mask=None, position_ids=pos)
    assert sum(saved.values()) == pytest.approx(layer_activation_bytes(config, tokens, 4), rel=0.10)


def test_the_flagship_fits_and_a_smaller_gpu_does_not():
    p = subprocess.run(prl_cmd("plan", FLAGSHIP), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "fits" in p.stdout and "743.911 B" in p.stdout, p.stdout + p.stderr
    for key in ("plan.mfu", "network_gb_s", "completion_fraction", "trainer step", "rollout decode"):
        assert key.split(".")[-1] in p.stdout
    small = subprocess.run(prl_cmd("plan", FLAGSHIP, "--set", "plan.gpu_memory_gb=80"), capture_output=True, text=True,
                           timeout=120)
    assert small.returncode == 1 and "DOES NOT FIT: a trainer GPU needs" in small.stdout, small.stdout
    assert "experts (16 B/param over ep)" in small.stdout.split("DOES NOT FIT")[1]


def test_expert_parallelism_divides_the_expert_memory():
    base = make_plan(load_recipe(FLAGSHIP))
    wider = make_plan(load_recipe(FLAGSHIP, ["trainer.parallel.ep=64"]))
    key = "weights+grads+Adam, experts (16 B/param over ep)"
    assert wider.trainer[key] == pytest.approx(2 * base.trainer[key])
    assert base.trainer[key] / GB == pytest.approx(base.counts.routed / 128 * 16 / GB)


def test_run_refuses_what_is_not_built_and_dry_run_shows_the_plan():
    dry = subprocess.run(prl_cmd("run", FLAGSHIP, "--dry-run"), capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "prl plan: fits" in dry.stdout and "prl run would refuse" in dry.stdout
    real = subprocess.run(prl_cmd("run", FLAGSHIP, "--no-tui"), capture_output=True, text=True, timeout=120)
    assert real.returncode == 2 and "needs NCCL on GPUs" in real.stdout + real.stderr


def test_sharded_checkpoints_across_trainer_hosts_need_a_shared_folder():
    """Without `cluster.shared_checkpoints` a sharded checkpoint of 16 trainer hosts could not be read
    back by every rank: refused as not built; `auto` falls back to rank 0 gathering."""
    def without_shared(recipe):
        return recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"shared_checkpoints": None})})

    sharded = load_recipe(FLAGSHIP, ["trainer.checkpoint_format=sharded"])
    assert not any("checkpoint_format" in item for item in sharded.not_built())
    assert any("needs cluster.shared_checkpoints" in item for item in without_shared(sharded).not_built())
    assert not any("checkpoint_format" in item for item in without_shared(load_recipe(FLAGSHIP)).not_built())


def test_the_flagship_header_names_exactly_what_run_refuses():
    """The recipe's header says what `prl run` refuses; it must be what `not_built()` lists today."""
    line = next(ln for ln in FLAGSHIP.read_text().splitlines() if "refuses what is not built yet" in ln)
    named = [item.strip() for item in line.split("):", 1)[1].rstrip(".").replace(" = ", "=").split(",")]
    refused = load_recipe(FLAGSHIP).not_built()
    assert len(named) == len(refused), (named, refused)
    for item in named:
        key = item.split("=")[0].split(" ")[0]
        assert any(r.startswith(key) for r in refused), (item, refused)
