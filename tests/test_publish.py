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


def test_a_background_publish_sends_the_frozen_version_in_order(tmp_path):
    """Two ranks at ep 2, three steps: publishing each version on the background thread from its frozen copy while
    the next step changes the weights gives the same sealed versions, in the same order, with the same bytes as
    publishing inline before the step (tests/dist_publish.py holds the thread until the step is done)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from prl.model.tiny import write_model_dir
    from prl.model.weights import MANIFEST, published_versions, version_dir
    from prl.recipe.schema import ModelCfg

    model_dir = write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0),
                                tmp_path / "model")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).parent / "dist_publish.py"), str(model_dir), str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    serial, background = tmp_path / "serial", tmp_path / "background"
    assert published_versions(serial) == published_versions(background) == [1, 2, 3]
    manifests = [version_dir(background, v) / MANIFEST for v in (1, 2, 3)]
    assert [json.loads(m.read_text())["version"] for m in manifests] == [1, 2, 3]
    sealed_at = [m.stat().st_mtime_ns for m in manifests]
    assert sealed_at == sorted(sealed_at), "sealed in version order"
    previous = None
    for v in (1, 2, 3):
        want, _ = read_weights(version_dir(serial, v))
        got, _ = read_weights(version_dir(background, v))
        assert sorted(got) == sorted(want) and any("experts" in k for k in got)
        assert all(torch.equal(got[k], want[k]) for k in want), f"version {v}"
        if previous is not None:  # each step moved the weights: the versions differ
            assert not all(torch.equal(want[k], previous[k]) for k in want)
        previous = want


KILLED = """
import sys, threading, time
import torch.distributed as dist
from prl.model.build import build_model
from prl.model.policy import WHOLE
from prl.trainer.publish import Background, parts_of, publish
from prl.transport.sinks import FolderSink

class Stalling(FolderSink):
    def put(self, bucket):
        super().put(bucket)
        if self.final.name.endswith("2"):
            print("mid-publish", flush=True)
            time.sleep(600)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = build_model(sys.argv[1], seed=0)
sink, bg = Stalling(sys.argv[2], keep=3), Background()
publish(model, sink, 1)
parts = parts_of(model, WHOLE, frozen=True)
bg.submit(lambda: publish(model, sink, 2, parts=parts))
bg.wait()
"""


def test_a_trainer_killed_mid_publish_leaves_the_last_sealed_version_serving(tmp_path):
    import signal
    import subprocess
    import sys

    from prl.model.tiny import write_model_dir
    from prl.model.weights import published_versions, read_weights, version_dir
    from prl.recipe.schema import ModelCfg

    model_dir = write_model_dir(ModelCfg(num_experts=4, experts_per_token=2, num_layers=2), tmp_path / "model")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(model_dir), str(tmp_path / "weights")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-publish"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert published_versions(tmp_path / "weights") == [1]  # version 2 was never sealed
    got, manifest = read_weights(version_dir(tmp_path / "weights", 1))
    assert manifest["version"] == 1 and got


def test_the_trainer_reads_the_next_batch_ahead():
    """`ReadAhead`: the step read ahead is taken from the thread (read once), another step is read on the spot,
    and a read that failed on the thread is tried again in the trainer's (where its error is raised)."""
    import threading

    from prl.trainer.trainer import ReadAhead

    reads: list[int] = []
    landed = threading.Event()

    def read(step: int) -> str:
        if step == 7:
            landed.wait(60)  # the batch lands while the step before trains
        reads.append(step)
        return f"batch {step}"

    ahead = ReadAhead()
    ahead.start(7, read)
    assert ahead.thread.is_alive() and reads == []
    landed.set()
    assert ahead.take(7, read) == "batch 7" and reads == [7]
    assert ahead.take(8, read) == "batch 8" and reads == [7, 8]  # nothing read ahead for it

    def broken(step: int) -> str:
        raise OSError(f"batch {step} unreadable")

    ahead.start(9, broken)
    with pytest.raises(OSError, match="batch 9 unreadable"):
        ahead.take(9, broken)
