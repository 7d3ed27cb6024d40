"""Fault injection in real runs: SIGKILL and SIGSTOP of each role at a random moment (seeds printed,
`PRL_FAULT_SEED` repeats one). Each run must finish all its steps with the reward improving, train
every prompt index at most once (the trainer's ledger), restart what was hit (restart events), and
leave nothing running."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, import_or_skip, prl_cmd
from test_run import assert_nothing_left, events

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "reverse-tiny.toml"
STEPS = 40
FAST = ["--set", f"rl.max_steps={STEPS}", "--set", "trainer.checkpoint_every=4",
        "--set", "run.hang_timeout_s=10"]


def fault_rng(name: str) -> random.Random:
    seed = int(os.environ.get("PRL_FAULT_SEED", random.randrange(1 << 30)))
    print(f"\n{name}: PRL_FAULT_SEED={seed}")
    return random.Random(seed)


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        prl_cmd("run", RECIPE, "--no-tui", "--set", f"run.output_dir={tmp_path}", *FAST, *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(run_dir: Path, proc: subprocess.Popen, done) -> list[dict]:
    """Wait on the run's own events until `done(events)`; a run that ends first fails the test."""
    while True:
        if (run_dir / "metrics.jsonl").exists():
            evs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
            if done(evs):
                return evs
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first (rc {proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.2)


def rl_step_reached(step: int):
    return lambda evs: any(e["kind"] == "trainer_step" and e.get("stage") == "rl" and e["step"] >= step for e in evs)


def restarted(unit: str, count: int = 1):
    return lambda evs: sum(e["kind"] == "restart" and e["name"] == unit for e in evs) >= count


def pid_of(run_dir: Path, name: str) -> int:
    return [e for e in events(run_dir, "process") if e["name"] == name and e.get("pid")][-1]["pid"]


def trainer_rank(run_dir: Path) -> int:
    """The worker process of the trainer's torchrun (rank 0), not torchrun itself."""
    leader = psutil.Process(pid_of(run_dir, "trainer"))
    return next(c.pid for c in leader.children(recursive=True) if "prl.trainer" in " ".join(c.cmdline()))


def finish(proc: subprocess.Popen, run_dir: Path) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    check_run(run_dir)
    return out


def check_run(run_dir: Path) -> None:
    """All steps trained once each, no prompt index in two steps, the reward improved, nothing left."""
    ledger = [json.loads(ln) for ln in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in ledger) == list(range(STEPS)), "every step in the ledger exactly once"
    prompts = [i for e in ledger for i in e["prompts"]]
    assert len(prompts) == len(set(prompts)), "a prompt index was trained twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done" and summary["rl_steps"] == STEPS
    rewards = [e["reward"] for e in sorted(events(run_dir, "orch_step"), key=lambda e: e["step"])]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward: first 10 steps {first:.3f}, last 10 {last:.3f}; wall {summary['wall_s']} s")
    assert last - first > 0.03, rewards
    assert_nothing_left(run_dir)


def process(name: str):
    """The pid of the named process (its latest start), looked up when the fault strikes."""
    return lambda run_dir: pid_of(run_dir, name)


def two_faults(tmp_path: Path, name: str, first, second, recovered, *args: str) -> Path:
    """A run with fault `first` after a random RL step and, once `recovered(events)`, fault `second`
    after a later one; then the checks of every fault test. A fault: (what, pid of it, signal)."""
    rng = fault_rng(name)
    steps = rng.randrange(2, 12), rng.randrange(14, 30)
    for (what, _, sig), at in zip((first, second), steps):
        print(f"{sig.name} {what} after RL step {at}")
    proc = start(tmp_path, *args)
    run_dir = tmp_path / "reverse-tiny"
    for (_, target, sig), at, wait in zip((first, second), steps, (recovered, None)):
        wait_for(run_dir, proc, rl_step_reached(at))
        os.kill(target(run_dir), sig)
        if wait:
            wait_for(run_dir, proc, wait)
    finish(proc, run_dir)
    return run_dir


def test_server_and_trainer_killed_in_one_run(tmp_path):
    """Two servers: one SIGKILLed (its groups go to the other, it restarts and rejoins with the
    current weights), then the trainer's rank SIGKILLed (torchrun restarts from the newest checkpoint
    and replays the kept batches)."""
    rejoined = lambda evs: restarted("inference-1")(evs) and any(  # noqa: E731
        e["kind"] == "server_state" and e["name"] == "inference-1" and e["state"] == "up" for e in evs)
    run_dir = two_faults(tmp_path, "server+trainer kill", ("inference-1", process("inference-1"), signal.SIGKILL),
                         ("the trainer's rank", trainer_rank, signal.SIGKILL), rejoined, "--set", "inference.num_servers=2")
    assert [e["name"] for e in events(run_dir, "restart")] == ["inference-1", "trainer"]
    assert events(run_dir, "resumed"), "the restarted trainer resumed from a checkpoint"
    replayed = [e["step"] for e in events(run_dir, "trainer_step") if e.get("replayed")]
    print(f"replayed steps: {replayed}")


def test_hung_server_and_hung_trainer_are_restarted(tmp_path):
    """SIGSTOP: the processes stay alive but answer nothing; the orchestrator reports them after
    run.hang_timeout_s and the driver kills and restarts them. One server: the run waits for it."""
    run_dir = two_faults(tmp_path, "server+trainer stop", ("inference-0", process("inference-0"), signal.SIGSTOP),
                         ("the trainer's rank", trainer_rank, signal.SIGSTOP), restarted("inference-0"))
    causes = {e["name"]: e["cause"] for e in events(run_dir, "restart")}
    assert set(causes) == {"inference-0", "trainer"} and all("hung" in c for c in causes.values()), causes


def test_orchestrator_killed_then_hung(tmp_path):
    """The orchestrator SIGKILLed, then SIGSTOPped: restarted both times, it asks the trainer where to
    continue (after the batches the trainer already holds) and the data order goes on."""
    orchestrator = process("orchestrator")
    run_dir = two_faults(tmp_path, "orchestrator kill+stop", ("the orchestrator", orchestrator, signal.SIGKILL),
                         ("the orchestrator", orchestrator, signal.SIGSTOP), restarted("orchestrator"))
    restarts = events(run_dir, "restart")
    assert [e["name"] for e in restarts] == ["orchestrator", "orchestrator"]
    assert "hung" in restarts[1]["cause"]
    positions = [e["data_position"] for e in events(run_dir, "orch_step")]
    assert positions == sorted(positions), "the data order continues across restarts"


def test_a_process_past_its_restarts_stops_the_run(tmp_path):
    proc = start(tmp_path, "--set", "run.max_restarts=1", "--set", "rl.max_steps=500")
    run_dir = tmp_path / "reverse-tiny"
    wait_for(run_dir, proc, rl_step_reached(1))
    os.kill(pid_of(run_dir, "inference-0"), signal.SIGKILL)
    wait_for(run_dir, proc, lambda evs: any(e["kind"] == "server_state" and e["state"] == "up" for e in evs))
    os.kill(pid_of(run_dir, "inference-0"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "inference-0" in out and "after 1 restarts of inference-0 (run.max_restarts = 1)" in out
    assert_nothing_left(run_dir)


def test_kv_master_killed_mid_run_costs_only_recomputation(tmp_path):
    """`inference.kv_pool` on 2 servers: SIGKILL of `mooncake_master` after a random RL step. The
    master is restarted like any process; the servers' store clients reconnect to it (Mooncake
    mounts their memory again), so the pool serves prompts again after the restart, and any store
    operation that failed meanwhile only cost recomputation (`pool_errors`). The run finishes every
    step with the usual checks."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    at = fault_rng("kv-master").randrange(2, 12)
    print(f"SIGKILL kv-master after RL step {at}")
    proc = start(tmp_path, "--set", "inference.kv_pool.enabled=true", "--set", "inference.kv_pool.chunk_tokens=4",
                 "--set", "inference.kv_pool.memory_gb=0.05", "--set", "inference.num_servers=2",
                 "--set", "inference.kv_pool.retry_s=2")
    run_dir = tmp_path / "reverse-tiny"
    wait_for(run_dir, proc, rl_step_reached(at))
    os.kill(pid_of(run_dir, "kv-master"), signal.SIGKILL)
    killed_at = len((run_dir / "metrics.jsonl").read_text().splitlines())  # events before this one predate it
    wait_for(run_dir, proc, restarted("kv-master"))
    finish(proc, run_dir)
    evs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restart = next(i for i, e in enumerate(evs) if e["kind"] == "restart" and e["name"] == "kv-master")
    before, last = {}, {}
    for i, e in enumerate(evs):
        if e["kind"] == "server" and (i < killed_at or i > restart):
            (before if i < killed_at else last)[e["name"]] = e
    print({n: {k: v for k, v in m.items() if k.startswith("pool_")} for n, m in last.items()})
    hits = lambda ms: sum(m["pool_hit_tokens"] for m in ms.values())  # noqa: E731
    assert hits(last) > hits(before), "the pool served prompts again after the master's restart"


def test_a_hang_stops_the_run_when_no_restarts_are_allowed(tmp_path):
    """`run.max_restarts = 0`: a hung server (SIGSTOP) is still found after `hang_timeout_s` (at its
    minimum here); the run stops, naming the server and the hang, restarts nothing, and leaves
    nothing running."""
    proc = start(tmp_path, "--set", "run.max_restarts=0", "--set", "run.hang_timeout_s=5", "--set", "sft.steps=0")
    run_dir = tmp_path / "reverse-tiny"
    wait_for(run_dir, proc, lambda evs: any(e["kind"] == "server" for e in evs))  # the orchestrator watches it
    os.kill(pid_of(run_dir, "inference-0"), signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the hang was never acted on:\n{out[-3000:]}") from None
    assert proc.returncode == 1, out[-3000:]
    assert "inference-0" in out and "killed by prl as hung" in out and "run.max_restarts = 0" in out, out[-3000:]
    assert not events(run_dir, "restart")
    assert_nothing_left(run_dir)
