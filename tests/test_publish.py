"""Publishing weights bucket by bucket (`prl.trainer.publish`): one safetensors file per decoder
layer plus one for the rest, gathered from FSDP2 shards, equal to the whole state converted at once
(Hugging Face names for vLLM, in-memory names for the embedded engine, block-FP8 tensors)."""

import pytest
import torch
import torch.distributed as dist

from prl.model.weights import read_weights


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_model(group, tmp_path_factory):
    from torch.distributed.fsdp import fully_shard

    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    model = build_model(write_model_dir(ModelCfg(arch="qwen3_moe"), tmp_path_factory.mktemp("m") / "model"), seed=5)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, plain


def test_buckets_are_layers_then_the_rest():
    from prl.trainer.publish import buckets

    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.10.a", "model.layers.2.a",
             "model.layers.0.b", "model.norm.weight", "lm_head.weight"]
    assert buckets(names) == [["model.layers.0.a", "model.layers.0.b"], ["model.layers.2.a"], ["model.layers.10.a"],
                              ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]]


@pytest.mark.parametrize("hf_format", [False, True])
def test_bucketed_folder_equals_the_whole_state(sharded_model, tmp_path, hf_format):
    from prl.model.hf_format import to_checkpoint_format
    from prl.trainer.publish import publish
    from prl.transport.sinks import FolderSink

    model, plain = sharded_model
    path = publish(model, FolderSink(tmp_path, keep=2), 3, hf_format=hf_format)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) == len(model.model.layers) + 1, files
    got, manifest = read_weights(path)
    assert manifest["version"] == 3 and manifest["format"] == ("hf" if hf_format else "memory")
    want = to_checkpoint_format(model, plain) if hf_format else plain
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fp8_tensors_are_quantised_in_their_bucket(sharded_model, tmp_path):
    from prl.model.fp8_checkpoint import SCALE_SUFFIX, dequantize_state_dict
    from prl.trainer.publish import publish
    from prl.transport.sinks import FolderSink

    model, plain = sharded_model
    names = [k for k in plain if k.endswith("self_attn.q_proj.weight")]
    got, _ = read_weights(publish(model, FolderSink(tmp_path, keep=2), 1, fp8_names=names))
    assert all(got[n].dtype == torch.float8_e4m3fn and n + SCALE_SUFFIX in got for n in names)
    back = dequantize_state_dict(got)
    for n in names:
        assert (back[n] - plain[n]).abs().max() <= plain[n].abs().max() / 8  # E4M3 rounding per block


def test_fp8_in_checkpoint_names_equals_the_whole_state_converted(sharded_model, tmp_path):
    """For vLLM (`hf_format`) with FP8: every bucket in checkpoint names with each expert's FP8 weight and
    scales, equal to the whole state converted at once; an FP8 name of the model that no bucket can place
    fails the version."""
    from prl.model.fp8 import apply_fp8
    from prl.model.fp8_checkpoint import SCALE_SUFFIX, tensor_names, to_fp8_checkpoint
    from prl.trainer.publish import publish
    from prl.transport.sinks import FolderSink

    model, plain = sharded_model
    names = tensor_names(apply_fp8(model, swap=False)["fp8"])
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    got, manifest = read_weights(publish(model, FolderSink(tmp_path, keep=2), 2, fp8_names=names, hf_format=True))
    want = to_fp8_checkpoint(model, plain, names)
    assert manifest["format"] == "hf" and sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
                           want[k].view(torch.uint8) if want[k].dtype == torch.float8_e4m3fn else want[k]) for k in want)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" + SCALE_SUFFIX in got
    with pytest.raises(RuntimeError, match="in no bucket"):
        publish(model, FolderSink(tmp_path / "bad", keep=2), 3, fp8_names=[*names, "model.layers.0.nope"],
                hf_format=True)
