"""Export of a LoRA run's checkpoints (adapters alone on the step-0 base): a PEFT adapter folder, the merged
Hugging Face folder, prl's merge of the one into the base, the trainer's logprobs from the merged model, `prl
eval`'s model folder, and one clear line for each bad input."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, prl_cmd

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "reverse-tiny-lora.toml"
STEP = 2
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("runs")
    p = subprocess.run(prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp}", "--set", "sft.steps=3",
                               "--set", "rl.max_steps=2", "--set", f"trainer.checkpoint_every={STEP}",
                               "--set", "eval.heldout.examples=8"),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return tmp / "reverse-tiny-lora"


@pytest.fixture(scope="module")
def exports(lora_run, tmp_path_factory) -> Path:
    from prl.trainer.export import export

    out = tmp_path_factory.mktemp("exports")
    export(lora_run, str(STEP), out / "adapter")
    export(lora_run, str(STEP), out / "merged", merged=True)
    export(lora_run, "0", out / "base")
    return out


def checkpoint(lora_run: Path, step: int) -> tuple[dict, dict]:
    from prl.trainer.checkpoint import read_model_state

    return read_model_state(lora_run / "checkpoints" / f"step_{step}")


def test_the_adapter_folder_is_a_peft_lora_adapter(lora_run, exports):
    config = json.loads((exports / "adapter" / "adapter_config.json").read_text())
    state, manifest = checkpoint(lora_run, STEP)
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 32.0, "bias": "none"}
    assert config["target_modules"] == ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "o_proj", "q_a_proj",
                                        "q_b_proj", "up_proj"]
    tensors = load_file(exports / "adapter" / "adapter_model.safetensors")
    adapters = {k: v for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))}
    assert {PREFIX + k + ".weight" for k in adapters} == set(tensors)  # dense targets keep their names
    for name, t in adapters.items():  # as trained: B not scaled, [out, r] / A [r, in]
        assert torch.equal(tensors[PREFIX + name + ".weight"], t)
    assert all(t.abs().max() > 0 for k, t in adapters.items() if k.endswith(".lora_B")), "RL moved no adapter"
    assert manifest["lora"]["base"] == "step_0"


def test_prl_merge_of_the_adapter_equals_the_merged_export(exports, tmp_path):
    from prl.model.peft_adapter import merge_adapter

    mine = merge_adapter(exports / "adapter", exports / "base", tmp_path / "mine")
    ours, want = load_file(mine / "model.safetensors"), load_file(exports / "merged" / "model.safetensors")
    assert set(ours) == set(want)
    assert all(torch.equal(ours[k], want[k]) for k in want)
    base = load_file(exports / "base" / "model.safetensors")
    assert sum(not torch.equal(base[k], want[k]) for k in want) == 21  # every target, nothing else
    assert (mine / "tokenizer.json").is_file() and (mine / "config.json").is_file()


def test_the_merged_model_gives_the_trainers_logprobs(lora_run, exports):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.model.build import build_model
    from prl.model.lora import apply_lora

    trainer_model = build_model(lora_run / "model")
    base, _ = checkpoint(lora_run, 0)
    trainer_model.load_state_dict(base)
    lora = checkpoint(lora_run, STEP)[1]["lora"]
    apply_lora(trainer_model, trainer_model.config.model_type, lora["rank"], lora["alpha"], 0.0, lora["targets"])
    missing, unexpected = trainer_model.load_state_dict(checkpoint(lora_run, STEP)[0], strict=False)
    assert not unexpected and not any(k.endswith((".lora_A", ".lora_B")) for k in missing)
    hf = AutoModelForCausalLM.from_pretrained(exports / "merged", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(exports / "base", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(exports / "merged")
    ids = torch.tensor([tok(t).input_ids for t in ("rev:abcd=dcba", "rev:xyzw=wzyx", "rev:hell=lleh")])
    with torch.no_grad():
        got, want, before = (m.eval()(ids).logits.log_softmax(-1) for m in (hf, trainer_model, plain))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (before - want).abs().max() > 1e-3  # the adapters change the model


def test_eval_serves_the_merged_checkpoint(lora_run, exports, tmp_path):
    from prl.launch.evaluate import checkpoint_model

    folder, number = checkpoint_model(lora_run, "latest", tmp_path / "model")
    assert number == STEP
    ours, want = load_file(folder / "model.safetensors"), load_file(exports / "merged" / "model.safetensors")
    assert all(torch.equal(ours[k], want[k]) for k in want)


def cli(*args: str):
    from typer.testing import CliRunner

    from prl.cli import app

    result = CliRunner().invoke(app, list(map(str, args)))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def refused(*args: str, says: str) -> None:
    result = cli(*args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.stderr


def test_bad_inputs_get_one_line(lora_run, exports, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("weights", "rollouts", "logs", "evals"))
    refused("ckpt", "export", run, "--step", "99", "--out", tmp_path / "x", says="no checkpoint for step '99'")
    refused("ckpt", "export", run, "--fp8", "--out", tmp_path / "x", says="add --merged")
    shard = run / "checkpoints" / "step_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused("ckpt", "export", run, "--merged", "--out", tmp_path / "x", says="sha256 does not match")
    shutil.rmtree(run / "checkpoints" / "step_0")
    refused("ckpt", "export", run, "--merged", "--out", tmp_path / "x", says="step-0 checkpoint) is missing")
    plain = cli("ckpt", "export", lora_run, "--step", "0", "--merged", "--out", tmp_path / "step0")
    assert plain.exit_code == 0 and (tmp_path / "step0" / "model.safetensors").is_file()  # every weight: as is
    refused("ckpt", "merge", exports / "adapter", exports / "adapter", "--out", tmp_path / "y", says="no model.safetensors")
    refused("ckpt", "merge", exports / "base", exports / "base", "--out", tmp_path / "y", says="not a PEFT adapter folder")
