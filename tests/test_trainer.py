"""The trainer under real torchrun: 1 and 2 ranks (FSDP2, gloo) train the same batches to the same
weights; checkpoints (sharded or full) are sealed, resume on another number of ranks, and a damaged
one is refused by name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prl.model.tiny import write_model_dir
from prl.model.weights import read_weights
from prl.launch.configs import resolve
from prl.recipe.resolve import write_configs, write_secret
from prl.recipe.schema import Recipe
from prl.trainer.checkpoint import read_model_state
from prl.transport.batch import Sample, TrainBatch, pack
from prl.transport.rollouts import FilesystemRolloutTransport

pytestmark = pytest.mark.slow


def samples(step: int) -> list[Sample]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(8):
        p = torch.randint(4, 40, (4 + i % 3,), generator=g).tolist()
        c = torch.randint(4, 40, (3 + i % 5,), generator=g).tolist()
        out.append(Sample(p, c, (-torch.rand(len(c), generator=g) * 3).tolist(), [step] * len(c), float(i % 3) - 1.0))
    return out


def prepare_trainer(run_dir: Path, nproc: int, steps: int, **trainer) -> list:
    """A trainer's run folder (the tiny model, no warm start, `trainer` settings over these) with its configs written
    and `steps` batches of `samples` waiting in its rollout folder; returns the run's process configs."""
    recipe = Recipe.model_validate({"sft": {"steps": 0}, "rl": {"max_steps": steps, "batch_size": 8, "group_size": 4},
                                    "trainer": {"nproc": nproc, "micro_batch_tokens": 40, **trainer}})
    if not (run_dir / "model").exists():
        write_model_dir(recipe.model, run_dir / "model")
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    write_configs(configs, run_dir)
    transport = FilesystemRolloutTransport(run_dir / "rollouts")
    for step in range(steps):
        transport.send(TrainBatch(step, pack(samples(step), nproc, 40), data_position=8 * (step + 1)))
    return configs


def run_trainer(run_dir, nproc: int, steps: int, extra=(), checkpoint_format: str = "auto"):
    configs = prepare_trainer(run_dir, nproc, steps, checkpoint_every=2, checkpoint_format=checkpoint_format)
    return subprocess.run([*trainer_command(configs), *extra], capture_output=True, text=True, timeout=300)


def trainer_command(configs) -> list[str]:
    """The trainer's command as `prl run` starts it (its config as written): one rank alone, more under torchrun."""
    from prl.launch.processes import process_command

    return process_command(next(c for c in configs if c.role == "trainer"), sys.executable)


def test_one_and_two_ranks_agree_and_checkpoint(tmp_path):
    results = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"n{nproc}"
        p = run_trainer(run_dir, nproc, steps=2)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        results[nproc], manifest = read_weights(run_dir / "weights" / "v2")
        assert manifest["version"] == 2
        ckpt, meta = read_model_state(run_dir / "checkpoints" / "step_2")
        assert meta["step"] == 2 and meta["data_position"] == 16 and meta["format"] == "dcp"
        assert sorted(p.name for p in (run_dir / "checkpoints" / "step_2").glob("*.distcp")) == \
            [f"__{r}_0.distcp" for r in range(nproc)], "every rank wrote its own shards"
        assert all(torch.equal(ckpt[k], results[nproc][k]) for k in ckpt)
    diffs = [(results[1][k] - results[2][k]).abs().max().item() for k in results[1]]
    assert max(diffs) < 1e-5, "the loss is normalised by tokens across ranks, so 1 and 2 ranks agree"
    moved, _ = read_weights(tmp_path / "n1" / "weights" / "v0")
    assert any(not torch.equal(moved[k], results[1][k]) for k in moved), "training changed the weights"


@pytest.mark.parametrize("fmt, damaged", [("full", "optim.pt"), ("sharded", "__0_0.distcp")])
def test_corrupt_checkpoint_is_refused_by_name(tmp_path, fmt, damaged):
    run_dir = tmp_path / "run"
    assert run_trainer(run_dir, 1, steps=2, checkpoint_format=fmt).returncode == 0
    path = run_dir / "checkpoints" / "step_2" / damaged
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    p = run_trainer(run_dir, 1, steps=3, checkpoint_format=fmt)
    assert p.returncode != 0
    assert damaged in p.stdout + p.stderr and "corrupted" in p.stdout + p.stderr


@pytest.mark.parametrize("fmt, first, then", [("full", 2, 2), ("sharded", 2, 1), ("sharded", 2, 2)])
def test_resume_matches_an_uninterrupted_run(tmp_path, fmt, first, then):
    """Full: rank 0 alone reads the checkpoint and broadcasts model and optimizer state into the
    shards. Sharded: written by 2 ranks, resumed by 1 (the shards are resharded as they load)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, steps, nproc in ((straight, 4, then), (resumed, 2, first)):
        p = run_trainer(run_dir, nproc, steps=steps, checkpoint_format=fmt)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert read_model_state(resumed / "checkpoints" / "step_2")[1]["format"] == ("dcp" if fmt == "sharded" else "full")
    p = run_trainer(resumed, then, steps=4, checkpoint_format=fmt)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    a, _ = read_weights(straight / "weights" / "v4")
    b, _ = read_weights(resumed / "weights" / "v4")
    # 2 ranks and 1 agree to rounding (token-normalised loss); the same layout exactly
    assert max((a[k] - b[k]).abs().max().item() for k in a) < (1e-6 if first == then else 1e-5)


def dist_ckpt(tmp_path, mode: str, root0, root1) -> list[dict]:
    out = tmp_path / f"{mode}-out"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).parent / "dist_ckpt.py"), mode, str(root0), str(root1), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_sharded_checkpoint_where_each_rank_has_its_own_path_to_a_shared_folder(tmp_path):
    """Rank 1 reaches the checkpoint folder by another path (as a host with another workdir does):
    every rank writes into the same folder (rank 0 sends the folder's name, not its path), each rank
    hashes its own shard, and a resume on the same two paths restores the weights; a damaged shard
    that rank 1 hashes is reported by name on every rank."""
    shared = tmp_path / "shared"
    shared.mkdir()
    other = tmp_path / "host1"
    other.mkdir()
    (other / "checkpoints").symlink_to(shared)
    saved = dist_ckpt(tmp_path, "save", shared, other / "checkpoints")
    assert "error" not in saved[0], saved
    step = shared / "step_5"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp"]
    loaded = dist_ckpt(tmp_path, "load", shared, other / "checkpoints")
    assert [r.get("step") for r in loaded] == [5, 5], loaded
    assert loaded[0]["sum"] == pytest.approx(saved[0]["sum"], abs=1e-5)
    shard = step / "__0_0.distcp"  # sorted files [.metadata, __0_0, __1_0]: rank 1 hashes __0_0
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    broken = dist_ckpt(tmp_path, "load", shared, other / "checkpoints")
    assert all("__0_0.distcp" in r.get("error", "") and "corrupted" in r["error"] for r in broken), broken


def test_sharded_checkpoint_across_unshared_folders_is_refused_before_writing(tmp_path):
    """Each rank's checkpoint folder is its own (trainer hosts without a shared folder): every rank
    raises the same error naming the rank that cannot see rank 0's folder, and nothing is left."""
    a, b = tmp_path / "a", tmp_path / "b"
    results = dist_ckpt(tmp_path, "save", a, b)
    for r in results:
        assert "CheckpointError" in r.get("error", "") and "rank 1" in r["error"], results
        assert "cluster.shared_checkpoints" in r["error"]
    assert not any(a.iterdir()) and not any(b.rglob("*.distcp")), "nothing was written"
