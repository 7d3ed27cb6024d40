"""`prl run` end to end with real processes: the inference server, the orchestrator and a torchrun
trainer on loopback. Checks versions, staleness, status, export, resume, and that nothing survives
a finished, interrupted or crashed run."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, prl_cmd

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "reverse-tiny.toml"
QUICK = ["--set", "sft.steps=10", "--set", "rl.max_steps=4", "--set", "trainer.checkpoint_every=2",
         "--set", "trainer.router_replay=true"]


def prl_run(tmp_path: Path, *args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp_path}", *args),
                          capture_output=True, text=True, timeout=timeout)


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def group_members(pgid: int) -> list[str]:
    """Live (not zombie) processes of a process group, as 'pid name'. A zombie has exited; whether
    it is reaped is up to its new parent (this machine's init), not prl."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def assert_nothing_left(run_dir: Path) -> None:
    """Every process group the driver started (torchrun workers, vLLM's engine) is gone."""
    pids = {e["pid"] for e in events(run_dir, "process") if e.get("pid")}
    assert pids
    alive = {pid: group_members(pid) for pid in pids}
    alive = {pid: members for pid, members in alive.items() if members}
    assert not alive, f"process groups still alive: {alive}"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    p = prl_run(tmp, *QUICK)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return tmp / "reverse-tiny", p


def test_run_trains_and_advances_versions(finished_run):
    run_dir, p = finished_run
    assert "first 5 RL steps" in p.stdout
    steps = events(run_dir, "orch_step")
    assert [e["step"] for e in steps] == [0, 1, 2, 3]
    assert all(0 <= e["off_policy_max"] <= 2 for e in steps), "no trained token older than max_off_policy_steps"
    rl_steps = [e for e in events(run_dir, "trainer_step") if e["stage"] == "rl"]
    assert [e["step"] for e in rl_steps] == [0, 1, 2, 3]
    assert all(0.5 < e["routing_agreement"] <= 1.0 for e in rl_steps), "R3 routing reached the trainer"
    served = [e["version"] for e in events(run_dir, "weights")]
    # batch 3 needs version >= 3 - max_async_level (1) served; the orchestrator stops after it
    assert served == sorted(served) and served[0] == 0 and served[-1] >= 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["rl_steps"] == 4
    assert (run_dir / "logs" / "trainer.log").exists() and (run_dir / "logs" / "inference-0.log").exists()
    assert_nothing_left(run_dir)


def test_status_after_the_run(finished_run):
    run_dir, _ = finished_run
    p = subprocess.run(prl_cmd("status", run_dir), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "150"})
    assert p.returncode == 0, p.stderr
    for word in ("reverse-tiny", "done", "inference-0", "orchestrator", "trainer", "reward", "4/4"):
        assert word in p.stdout


def test_export_round_trips_logits(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.model.build import build_model
    from prl.model.weights import read_weights

    run_dir, _ = finished_run
    out = tmp_path / "hf"
    p = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--step", "latest", "--out", out),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    hf = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    trainer_model = build_model(run_dir / "model")
    trainer_model.load_state_dict(read_weights(run_dir / "checkpoints" / "step_4")[0])
    ids = torch.tensor([tok("rev:abcd=").input_ids])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, trainer_model(ids).logits)
    bad = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--step", "99", "--out", tmp_path / "x"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no checkpoint for step" in bad.stderr


def test_resume_continues_steps_and_data(finished_run):
    run_dir, _ = finished_run
    before = events(run_dir, "orch_step")
    p = subprocess.run(prl_cmd("run", "--resume", run_dir, "--no-tui", "--set", "rl.max_steps=6"),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:]
    resumed = events(run_dir, "resumed")
    assert resumed and resumed[-1]["step"] == 4
    after = events(run_dir, "orch_step")[len(before):]
    assert [e["step"] for e in after] == [4, 5]
    assert after[0]["data_position"] > before[-1]["data_position"], "the data order continues"
    assert_nothing_left(run_dir)


def test_stale_rollouts_are_dropped_and_counted(tmp_path):
    p = prl_run(tmp_path, "--set", "sft.steps=5", "--set", "rl.max_steps=4",
                "--set", "rl.max_async_level=2", "--set", "rl.max_off_policy_steps=0")
    assert p.returncode == 0, p.stdout[-4000:]
    steps = events(tmp_path / "reverse-tiny", "orch_step")
    assert all(e["off_policy_max"] == 0 for e in steps)
    assert steps[-1]["stale_dropped_total"] > 0


def start_background(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp_path}", "--set", "sft.steps=5",
                "--set", "rl.max_steps=500"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_rl_step(run_dir: Path, proc: subprocess.Popen) -> None:
    """Waits on the run's own events: a busy machine is slower, not broken; a dead run fails at once."""
    while not ((run_dir / "metrics.jsonl").exists() and any(e["stage"] == "rl" for e in events(run_dir, "trainer_step"))):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.3)


def test_ctrl_c_stops_everything(tmp_path):
    proc = start_background(tmp_path)
    run_dir = tmp_path / "reverse-tiny"
    wait_for_rl_step(run_dir, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert_nothing_left(run_dir)


def test_dead_inference_server_stops_the_run(tmp_path):
    proc = start_background(tmp_path)
    run_dir = tmp_path / "reverse-tiny"
    wait_for_rl_step(run_dir, proc)
    server = next(e for e in events(run_dir, "process") if e["name"] == "inference-0")
    os.kill(server["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "inference-0" in out and "exited with code -9" in out and "inference-0.log" in out
    assert_nothing_left(run_dir)


def test_default_recipe_learns(tmp_path):
    """The acceptance run: recipes/reverse-tiny.toml as shipped, warm start included."""
    p = prl_run(tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:]
    summary = json.loads((tmp_path / "reverse-tiny" / "summary.json").read_text())
    print(f"\nreverse-tiny: {summary}")
    assert summary["last5_reward"] - summary["first5_reward"] >= 0.15, summary
    assert_nothing_left(tmp_path / "reverse-tiny")


def test_fp8_on_both_sides(tmp_path):
    """trainer.fp8 and inference.fp8: the trainer publishes block-FP8 weights, the server serves them."""
    from safetensors import safe_open

    p = prl_run(tmp_path, "--set", "sft.steps=3", "--set", "rl.max_steps=3", "--set", "trainer.fp8=true",
                "--set", "inference.fp8=true")
    assert p.returncode == 0, p.stdout[-4000:]
    run_dir = tmp_path / "reverse-tiny"
    [fp8] = events(run_dir, "fp8")
    assert fp8["backend"] == "reference" and fp8["fp8_layers"] > 0
    latest = max((run_dir / "weights").glob("v*"), key=lambda d: int(d.name[1:]))
    with safe_open(latest / "model.safetensors", "pt") as f:
        assert any(k.endswith("_scale_inv") for k in f.keys())
    assert [e["version"] for e in events(run_dir, "weights")][-1] >= 1
    assert "FP8 (reference)" in (run_dir / "logs" / "inference-0.log").read_text()
    out = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--fp8", "--out", tmp_path / "hf8"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"weight_block_size"' in (tmp_path / "hf8" / "config.json").read_text()
