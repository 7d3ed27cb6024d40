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
    strays = processes_naming(run_dir)  # e.g. torchrun's workers, which live in sessions of their own
    assert not strays, f"processes of this run still alive outside its process groups: {strays}"


def processes_naming(run_dir: Path) -> list[str]:
    """Live processes whose command line names the run directory (every prl process's config does)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(p.info["cmdline"] or []):
                found.append(f"{p.pid} {' '.join(p.info['cmdline'])[:120]}")
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One short run that the tests below read; its weights go over the collective path too."""
    tmp = tmp_path_factory.mktemp("runs")
    p = prl_run(tmp, *QUICK, "--set", 'run.wandb={project="prl-test", mode="offline"}',
                "--set", 'trainer.weight_transfer="collective"')
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return tmp / "reverse-tiny", p


def test_weights_went_over_the_collective(finished_run):
    """Every version after the server was up was broadcast to it and staged there; the server
    applied them from what it staged (the folder stays the fallback, e.g. for v0 before it was up)."""
    run_dir, _ = finished_run
    sent = events(run_dir, "weights_sent")
    assert [e["version"] for e in sent] == list(range(len(sent))) and len(sent) >= 5
    assert all(e["servers"] == 1 and e["error"] is None and e["bytes"] > 0 for e in sent[1:]), sent
    staged = [e["collective_staged"] for e in events(run_dir, "server")]  # polled once a second
    assert staged == sorted(staged) and staged[-1] >= 1


def test_run_trains_and_advances_versions(finished_run):
    run_dir, p = finished_run
    assert "first 5 RL steps" in p.stdout
    steps = events(run_dir, "orch_step")
    assert [e["step"] for e in steps] == [0, 1, 2, 3]
    assert all(0 <= e["off_policy_max"] <= 2 for e in steps), "no trained token older than max_off_policy_steps"
    for e in steps:  # every model token's age is counted (stale_policy "mask": none older trained, none dropped)
        assert sum(e["off_policy_hist"].values()) == round(e["completion_len"] * 128)  # 128: rl.batch_size
        assert e["stale_dropped_total"] == 0
        assert e["len_batch_max"] <= e["len_generated_max"] and e["len_generated_p90"] > 0
    rl_steps = [e for e in events(run_dir, "trainer_step") if e["stage"] == "rl"]
    assert [e["step"] for e in rl_steps] == [0, 1, 2, 3]
    assert all(0.5 < e["routing_agreement"] <= 1.0 for e in rl_steps), "R3 routing reached the trainer"
    served = [e["version"] for e in events(run_dir, "weights")]
    # batch 3 needs version >= 3 - max_async_level (1) served; the orchestrator stops after it
    assert served == sorted(served) and served[0] == 0 and served[-1] >= 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["rl_steps"] == 4
    assert events(run_dir, "error") == [], "a successful run reports no error (client disconnects are not errors)"
    assert (run_dir / "logs" / "trainer.log").exists() and (run_dir / "logs" / "inference-0.log").exists()
    assert_nothing_left(run_dir)


def test_status_after_the_run(finished_run):
    run_dir, _ = finished_run
    p = subprocess.run(prl_cmd("status", run_dir), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "150"})
    assert p.returncode == 0, p.stderr
    for word in ("reverse-tiny", "done", "inference-0", "orchestrator", "trainer", "reward", "4/4"):
        assert word in p.stdout


def test_status_json_and_runs_list_the_run(finished_run):
    """`prl status --json` gives the dashboard's state as data; `prl runs` lists the run with its state,
    steps and last reward."""
    run_dir, _ = finished_run
    p = subprocess.run(prl_cmd("status", "--json", run_dir), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    state = json.loads(p.stdout)
    rewards = [e["reward"] for e in events(run_dir, "orch_step")]
    assert (state["name"], state["state"], state["rl_steps"], state["max_steps"]) == ("reverse-tiny", "finished", 4, 4)
    assert state["last_reward"] == rewards[-1] and state["summary"]["rl_steps"] == 4 and state["pid"] is None
    assert state["servers"]["inference-0"]["version"] >= 2 and state["processes"]["trainer"]["state"] == "done"
    p = subprocess.run(prl_cmd("runs", run_dir.parent), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    [row] = [line.split() for line in p.stdout.splitlines() if line.startswith("reverse-tiny")]
    assert row[:4] == ["reverse-tiny", "finished", "4/4", f"{rewards[-1]:.3f}"], p.stdout


def test_prl_stop_stops_a_run_from_another_terminal(tmp_path):
    """`prl stop RUN_DIR` is Ctrl-C from elsewhere: every process stops, the run is recorded as
    interrupted (`prl runs`: stopped), a second stop is refused, and `prl run --resume RUN_DIR
    --dry-run` prints the resumed plan without touching the run directory."""
    import hashlib

    proc = start_background(tmp_path)
    run_dir = tmp_path / "reverse-tiny"
    wait_for_rl_step(run_dir, proc)
    p = subprocess.run(prl_cmd("stop", run_dir), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0 and "stopped" in p.stdout, p.stdout + p.stderr
    assert proc.wait(60) == 130, "the driver had exited when prl stop returned"
    assert "interrupted" in proc.stdout.read()
    assert_nothing_left(run_dir)
    assert "stopped" in subprocess.run(prl_cmd("runs", tmp_path), capture_output=True, text=True, timeout=60).stdout
    again = subprocess.run(prl_cmd("stop", run_dir), capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "not running" in again.stderr, again

    def snapshot() -> dict[str, str]:
        return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(run_dir.rglob("*")) if f.is_file()}

    before = snapshot()
    dry = subprocess.run(prl_cmd("run", "--resume", run_dir, "--dry-run", "--set", "rl.max_steps=600"),
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "max_steps = 600" in dry.stdout and "trainer" in dry.stdout, dry.stdout + dry.stderr
    assert snapshot() == before, "a dry run writes nothing"


def wandb_files(run_dir: Path, count: int = 1) -> list[Path]:
    from wandb_file import finished_files

    return finished_files(run_dir, count)


def test_wandb_offline_run_holds_the_metrics_and_recipe(finished_run):
    """What W&B would upload (read from its offline run file): one row per RL step against `rl_step`,
    the orchestrator's and trainer's values as metrics.jsonl has them, SFT steps on their own axis,
    the recipe as config."""
    from wandb_file import config, history, run_id

    run_dir, _ = finished_run
    (f,) = wandb_files(run_dir)
    rows = history(f)
    rl = [r for r in rows if "rl_step" in r]
    assert [r["rl_step"] for r in rl] == [0, 1, 2, 3]
    rewards = {e["step"]: e["reward"] for e in events(run_dir, "orch_step")}
    losses = {e["step"]: e["loss"] for e in events(run_dir, "trainer_step") if e["stage"] == "rl"}
    assert [r["orchestrator/reward"] for r in rl] == [rewards[s] for s in range(4)]
    assert [r["trainer/loss"] for r in rl] == [losses[s] for s in range(4)]
    # A server idle over its 10 s window (its first poll, a weight load) honestly reports 0 tokens/s.
    tps = [r["inference/tokens_per_s"] for r in rl if "inference/tokens_per_s" in r]
    assert tps and all(v >= 0 for v in tps) and max(tps) > 0
    assert [r["sft/step"] for r in rows if "sft/step" in r] == list(range(10))
    cfg = config(f)
    assert cfg["rl"]["max_steps"] == 4 and cfg["run"]["name"] == "reverse-tiny"
    assert run_id(f) == json.loads((run_dir / "wandb.json").read_text())["id"]


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
    # the sharded checkpoint of step 4 against the weights v4 published (gathered) from the same state
    trainer_model.load_state_dict(read_weights(run_dir / "weights" / "v4")[0])
    ids = torch.tensor([tok("rev:abcd=").input_ids])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, trainer_model(ids).logits)
    bad = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--step", "99", "--out", tmp_path / "x"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no checkpoint for step" in bad.stderr


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
    from wandb_file import history, run_id

    first, second = wandb_files(run_dir, 2)
    assert run_id(second) == run_id(first), "the resumed run logs to the same W&B run"
    assert [r["rl_step"] for r in history(second) if "rl_step" in r] == [4, 5]


def test_stale_rollouts_are_dropped_and_counted(tmp_path):
    p = prl_run(tmp_path, "--set", "sft.steps=5", "--set", "rl.max_steps=4", "--set", "rl.stale_policy=drop",
                "--set", "rl.max_async_level=2", "--set", "rl.max_off_policy_steps=0")
    assert p.returncode == 0, p.stdout[-4000:]
    steps = events(tmp_path / "reverse-tiny", "orch_step")
    assert all(e["off_policy_max"] == 0 and e["stale_tokens"] == 0 for e in steps)
    assert steps[-1]["stale_dropped_total"] > 0 and sum(steps[-1]["dropped_by_len_decile"]) > 0


def start_background(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp_path}", "--set", "sft.steps=5",
                "--set", "rl.max_steps=500", *args),
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
    """With run.max_restarts = 0 a dead process stops the run (tests/test_faults.py: restarts)."""
    proc = start_background(tmp_path, "--set", "run.max_restarts=0")
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
    keys = []
    for part in latest.glob("*.safetensors"):
        with safe_open(part, "pt") as f:
            keys += list(f.keys())
    assert any(k.endswith("_scale_inv") for k in keys)
    assert [e["version"] for e in events(run_dir, "weights")][-1] >= 1
    assert "FP8 (reference)" in (run_dir / "logs" / "inference-0.log").read_text()
    out = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--fp8", "--out", tmp_path / "hf8"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"weight_block_size"' in (tmp_path / "hf8" / "config.json").read_text()


def chromium() -> str:
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("Debian's chromium is not installed (bin/test installs it as root)")
    return path


def test_report_renders_in_headless_chromium(finished_run, tmp_path):
    """`prl report` of the finished run, rendered by Chromium: the DOM it shows holds the reward curve
    with the values of metrics.jsonl, step for step, and the screenshot has the curve's colour."""
    import re

    run_dir, _ = finished_run
    page = tmp_path / "report.html"
    p = subprocess.run(prl_cmd("report", run_dir, "--out", page), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    browser = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=300).stdout
    [reward] = re.findall(r'<polyline[^>]*data-curve="reward"[^>]*>', dom)
    shown = json.loads(re.search(r"data-values=[\"']([^\"']*)[\"']", reward).group(1))
    steps = json.loads(re.search(r"data-steps=[\"']([^\"']*)[\"']", reward).group(1))
    logged = {e["step"]: e["reward"] for e in events(run_dir, "orch_step")}
    assert steps == sorted(logged) and shown == pytest.approx([logged[s] for s in steps], abs=1e-6)
    assert len(re.search(r'points="([^"]*)"', reward).group(1).split()) == len(steps)
    for section in ("Curves", "Step time", "Inference servers", "Restarts and errors", "Recipes", "reverse-tiny"):
        assert section in dom
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1300,900", page.as_uri()],
                   capture_output=True, timeout=300)
    from PIL import Image

    colours = dict((c, n) for n, c in Image.open(shot).convert("RGB").getcolors(1 << 24))
    assert colours.get((0x1F, 0x77, 0xB4), 0) > 50, "the run's curves are drawn in its colour"
    check_reward_png(run_dir, tmp_path / "report_png")


def check_reward_png(run_dir: Path, png_dir: Path) -> None:
    """The reward PNG beside the report has the run's colour at every (step, reward) of metrics.jsonl."""
    from PIL import Image

    from prl.report_png import SIZE, bounds, to_pixel

    logged = [(e["step"], e["reward"], e["reward_std"]) for e in events(run_dir, "orch_step")]
    series = [("run", "#1f77b4", [(s, r) for s, r, _ in logged])]
    lims = bounds(series, [("#1f77b4", [(s, r - sd, r + sd) for s, r, sd in logged])])
    img = Image.open(png_dir / "reward.png").convert("RGB")
    assert img.size == SIZE and {p.name for p in png_dir.iterdir()} >= {"reward.png", "loss.png", "mismatch_kl.png"}
    for s, r, _ in logged:
        x, y = to_pixel(s, r, lims)
        assert img.getpixel((round(x), round(y))) == (0x1F, 0x77, 0xB4), f"step {s}: no point at its reward"


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path, monkeypatch):
    """`prl run --resume` runs every check `prl run` runs before it writes anything: a refused resume
    (a setting not built yet; a task that does not import, found by the pre-flight) starts nothing
    and leaves every file of the run directory byte for byte as it was."""
    import hashlib
    import io

    from rich.console import Console

    from prl.launch import driver
    from prl.recipe.schema import Recipe

    run_dir = tmp_path / "run"
    files = {"recipe.json": json.dumps(Recipe().model_dump(mode="json")), "metrics.jsonl": '{"kind": "run"}\n',
             "trained.jsonl": '{"step": 0, "prompts": [1]}\n{"step": 1, "prompts": [2]}\n',
             "checkpoints/step_0/manifest.json": "{}", "weights/v1/manifest.json": "{}",
             "weights/v2/manifest.json": "{}", "rollouts/step_1.pt": "x"}
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)

    def snapshot() -> dict[str, str]:
        return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(run_dir.rglob("*")) if p.is_file()}

    started = []
    monkeypatch.setattr(driver, "execute", lambda *a, **k: started.append(a) or driver.Outcome("failed", "", 1))
    before = snapshot()
    refusals = {"kv_pool.protocol = 'rdma'": ["inference.kv_pool.enabled=true", "inference.kv_pool.protocol=rdma"],
                "task.dataset": ["task.name=custom", "task.dataset=no_such_module:data",
                                 "task.reward=no_such_module:reward"]}
    for words, overrides in refusals.items():
        out = io.StringIO()
        rc = driver.run(None, resume=run_dir, overrides=overrides, force=False, tui=False,
                        console=Console(file=out, width=200))
        assert rc == 2 and words in out.getvalue() and not started, out.getvalue()
        assert snapshot() == before, f"the refused resume ({words}) changed the run directory"
