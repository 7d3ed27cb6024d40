"""Fault injection in real runs: SIGKILL and SIGSTOP of each role at a random moment (seeds printed,
`PRL_FAULT_SEED` repeats one). Each run must finish all its steps with the reward improving, train
every prompt index at most once (the trainer's ledger), each step on the batch the orchestrator
shipped for it, restart what was hit (restart events), and leave nothing running. A restarted
trainer must replay what it trained past its checkpoint to the same losses (the run's lineage is an
unfaulted run's); a restarted KV-pool master must serve pool hits again."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
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


def start(tmp_path: Path, *args: str, recipe: Path = RECIPE) -> subprocess.Popen:
    return subprocess.Popen(
        prl_cmd("run", recipe, "--no-tui", "--set", f"run.output_dir={tmp_path}", *FAST, *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(run_dir: Path, proc: subprocess.Popen, done) -> list[dict]:
    """Wait on the run's own events until `done(events)`; a run that ends first fails the test. Reads
    only what was appended since the last look, so a poll stays short however long the run."""
    evs: list[dict] = []
    offset, partial = 0, b""
    while True:
        path = run_dir / "metrics.jsonl"
        if path.exists():
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            *lines, partial = (partial + chunk).split(b"\n")
            evs += [json.loads(ln) for ln in lines if ln.strip()]
            if done(evs):
                return evs
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first (rc {proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)


def rl_step_reached(step: int):
    return lambda evs: any(e["kind"] == "trainer_step" and e.get("stage") == "rl" and e["step"] >= step for e in evs)


def three_steps_past_a_checkpoint(step: int):
    """An RL step `step` or later that is the third after a checkpoint (trainer.checkpoint_every = 4) was
    trained: a trainer stopped now has three steps to replay after its restart, the second trained
    with the optimizer state and the third with the learning rate it restored. Stays true once met (a
    poll that comes a step late still strikes; `check_trainer_restart` holds wherever the fault lands)."""
    return lambda evs: any(e["kind"] == "trainer_step" and e.get("stage") == "rl" and e["step"] >= step
                           and e["step"] % 4 == 2 for e in evs)


def restarted(unit: str, count: int = 1):
    return lambda evs: sum(e["kind"] == "restart" and e["name"] == unit for e in evs) >= count


def pid_of(run_dir: Path, name: str) -> int:
    return [e for e in events(run_dir, "process") if e["name"] == name and e.get("pid")][-1]["pid"]


def trainer_rank(run_dir: Path) -> int:
    return rank_of_trainer(pid_of(run_dir, "trainer"))


def rank_of_trainer(pid: int) -> int:
    """The rank 0 of the trainer process `pid`: the worker of its torchrun (not torchrun itself), or the process
    itself when its one rank runs alone."""
    leader = psutil.Process(pid)
    return next(p.pid for p in [leader, *leader.children(recursive=True)]
                if "prl.trainer" in " ".join(p.cmdline()) and "torch.distributed.run" not in p.cmdline())


def finish(proc: subprocess.Popen, run_dir: Path) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    check_run(run_dir)
    return out


def check_run(run_dir: Path) -> None:
    """All steps trained once each, no prompt index in two steps, each step's prompts those of the
    batch the orchestrator shipped for it, the reward improved, nothing left."""
    check_ledger(run_dir, STEPS)
    rewards = [e["reward"] for e in sorted(events(run_dir, "orch_step"), key=lambda e: e["step"])]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"reward: first 10 steps {first:.3f}, last 10 {last:.3f}; wall {summary['wall_s']} s")
    assert last - first > 0.03, rewards
    assert_nothing_left(run_dir)


def check_ledger(run_dir: Path, steps: int) -> None:
    """All `steps` steps trained once each, no prompt index in two steps, each step's prompts those of
    the batch the orchestrator shipped for it, the run done."""
    ledger = [json.loads(ln) for ln in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in ledger) == list(range(steps)), "every step in the ledger exactly once"
    prompts = [i for e in ledger for i in e["prompts"]]
    assert len(prompts) == len(set(prompts)), "a prompt index was trained twice"
    check_data_order(run_dir, {e["step"]: e["prompts"] for e in ledger}, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    # the summary counts the orchestrator's reward points: one stopped or killed between shipping a batch
    # and logging it leaves that step out (the ledger above holds every step trained)
    assert summary["state"] == "finished" and steps - 2 <= summary["rl_steps"] <= steps


def check_data_order(run_dir: Path, ledger: dict[int, list[int]], steps: int = STEPS) -> None:
    """The data order of an unfaulted run: the orchestrator ships step s with data position the lowest
    prompt index not trained by steps 0..s (`DataCursor`), so the prompts the ledger holds (what the
    trainer trained) give the position the orchestrator logged for each step; a trainer that trained
    another step's batch (or one not shipped) breaks it. No prompt below the last position is missing
    from the ledger: nothing a restarted orchestrator skipped was lost."""
    positions = {e["step"]: e["data_position"] for e in events(run_dir, "orch_step")}
    assert len(positions) >= steps - 2, f"orch_step events for only {sorted(positions)}"
    trained: set[int] = set()
    for s in sorted(ledger):
        trained.update(ledger[s])
        want = next(i for i in range(len(trained) + 1) if i not in trained)
        if s in positions:  # a restarted orchestrator may not have logged every step
            assert positions[s] == want, f"step {s}: trained prompts {ledger[s]}, the orchestrator's position {positions[s]}"
    last = positions[max(positions)]
    assert set(range(last)) <= trained, f"prompts below {last} never trained: {sorted(set(range(last)) - trained)}"


def check_trainer_restart(run_dir: Path) -> None:
    """After the trainer's restart the model's lineage is an unfaulted run's: it resumed from its
    newest checkpoint and went on from there, every step once and in order; the steps it had trained
    past that checkpoint before the fault were replayed (not trained anew, so not in the ledger twice),
    each with the loss and gradient norm of the first time (the same batch from the same weights,
    optimizer state and learning rate)."""
    evs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cut = max(i for i, e in enumerate(evs) if e["kind"] == "restart" and e["name"] == "trainer")
    rl = [(i, e) for i, e in enumerate(evs) if e["kind"] == "trainer_step" and e.get("stage") == "rl"]
    first = {e["step"]: e for i, e in rl if i < cut}
    again = [e for i, e in rl if i > cut]
    [resumed] = [e["step"] for e in evs[cut:] if e["kind"] == "resumed"]
    saved = max(e["step"] for e in evs[:cut] if e["kind"] == "checkpoint")
    assert saved <= resumed <= max(first) + 1, f"resumed at {resumed}: checkpoint {saved}, trained {sorted(first)}"
    assert [e["step"] for e in again] == list(range(resumed, STEPS)), "from its checkpoint, every step once, in order"
    replayed = [e["step"] for e in again if e["replayed"]]
    trained_past = list(range(resumed, max(first) + 1))  # the ledger may also hold the step the fault cut short
    assert replayed in (trained_past, trained_past + [max(first) + 1]), f"replayed {replayed}, trained {sorted(first)}"
    print(f"trainer resumed at step {resumed}, replayed {replayed}")
    for s in replayed:
        if s in first:
            for key in ("loss", "grad_norm"):
                assert again[s - resumed][key] == pytest.approx(first[s][key], rel=1e-5, abs=2e-6), \
                    f"replayed step {s}: {key} {again[s - resumed][key]}, the first time {first[s][key]}"


def process(name: str):
    """The pid of the named process (its latest start), looked up when the fault strikes."""
    return lambda run_dir: pid_of(run_dir, name)


def two_faults(tmp_path: Path, name: str, first, second, recovered, *args: str, second_when=rl_step_reached) -> Path:
    """A run with fault `first` after a random RL step and, once `recovered(events)`, fault `second`
    after a later one (`second_when(step)`: the moment, from that step on); then the checks of every
    fault test. A fault: (what, pid of it, signal)."""
    rng = fault_rng(name)
    steps = rng.randrange(2, 12), rng.randrange(14, 30)
    for (what, _, sig), at in zip((first, second), steps):
        print(f"{sig.name} {what} after RL step {at}")
    proc = start(tmp_path, *args)
    run_dir = tmp_path / "reverse-tiny"
    moments = (rl_step_reached, second_when)
    for (_, target, sig), at, wait, when in zip((first, second), steps, (recovered, None), moments):
        wait_for(run_dir, proc, when(at))
        os.kill(target(run_dir), sig)
        if wait:
            wait_for(run_dir, proc, wait)
    finish(proc, run_dir)
    return run_dir


def test_server_and_trainer_killed_in_one_run(tmp_path):
    """Two servers: one SIGKILLed (its groups go to the other, it restarts and rejoins with the
    current weights), then the trainer's rank SIGKILLed (torchrun restarts from the newest checkpoint
    and replays the kept batches). The weights go by the stream from both trainer ranks: the restarted
    server misses it, so a version is written whole for it (it rejoins with that one) and later
    versions are streamed to it again."""
    rejoined = lambda evs: restarted("inference-1")(evs) and any(  # noqa: E731
        e["kind"] == "server_state" and e["name"] == "inference-1" and e["state"] == "up" for e in evs)
    run_dir = two_faults(tmp_path, "server+trainer kill", ("inference-1", process("inference-1"), signal.SIGKILL),
                         ("the trainer's rank", trainer_rank, signal.SIGKILL), rejoined,
                         "--set", "inference.num_servers=2", "--set", "trainer.nproc=2",
                         "--set", 'trainer.weight_transfer="stream"', second_when=three_steps_past_a_checkpoint)
    assert [e["name"] for e in events(run_dir, "restart")] == ["inference-1", "trainer"]
    check_trainer_restart(run_dir)
    sent = events(run_dir, "weights_sent")
    assert all(e["senders"] == 2 for e in sent) and sent[-1]["servers"] == 2 and sent[-1]["error"] is None, sent[-3:]
    missed = [e["version"] for e in sent if e["error"]]  # the restarted server was not in the stream
    assert missed, "the restarted server missed a version's stream"
    back = [e for e in events(run_dir, "server_state") if e["name"] == "inference-1" and e["state"] == "up"]
    assert back, "inference-1 came back"


def stop_while_generating(run_dir: Path, proc: subprocess.Popen, name: str) -> int:
    """SIGSTOP the server `name` the moment its own `/metrics` shows a request running (a stopped
    server finishes nothing, so a kill after this catches that request in flight); its pid. A run
    that ends first fails the test."""
    from prl.transport.ports import url_of
    secret = (run_dir / "secret").read_text().strip()
    pid = pid_of(run_dir, name)
    with httpx.Client(headers={"Authorization": f"Bearer {secret}"}, timeout=5) as client:
        while True:
            try:
                if client.get(url_of(run_dir, name, "http://127.0.0.1:1") + "/metrics").json()["running"] > 0:
                    os.kill(pid, signal.SIGSTOP)
                    return pid
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # not up yet
            if proc.poll() is not None:
                raise AssertionError(f"the run ended first (rc {proc.returncode}):\n{proc.stdout.read()[-4000:]}")
            time.sleep(0.01)


def test_a_server_killed_mid_conversation_loses_no_group(tmp_path):
    """code-tiny from random init on two servers: every conversation has two turns (a program, the
    sandbox's verdict, a second program). inference-1 is SIGKILLed after a random RL step, once its
    `/metrics` shows a request running (stopped at once, then killed), while conversations are inside or between turns: the turns it
    ran are re-issued on the other server (`reissued` events) and conversations whose earlier turn ran
    on it take their next turn there (`moved`), with their tokens so far; it restarts and rejoins.
    Every step trains once, no prompt is lost or trained twice, nothing is left running. That the kill
    catches a request is asserted; which turns it catches depends on timing, so those counts are
    printed (`tests/test_budget.py` moves a conversation between turns on purpose)."""
    steps, at = 8, fault_rng("server kill mid-conversation").randrange(1, 4)
    print(f"SIGKILL inference-1 after RL step {at}")
    proc = start(tmp_path, "--set", f"rl.max_steps={steps}", "--set", "sft.steps=0", "--set", "inference.num_servers=2",
                 recipe=ROOT / "recipes" / "code-tiny.toml")
    run_dir = tmp_path / "code-tiny"
    wait_for(run_dir, proc, rl_step_reached(at))
    os.kill(stop_while_generating(run_dir, proc, "inference-1"), signal.SIGKILL)  # not while idle
    wait_for(run_dir, proc, restarted("inference-1"))
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    check_ledger(run_dir, steps)
    assert_nothing_left(run_dir)
    reissued = [e for e in events(run_dir, "reissued") if e["name"] == "inference-1"]
    moved = [e for e in events(run_dir, "moved") if e["name"] == "inference-1"]
    print(f"{len(reissued)} requests re-issued ({sum(e['later_turn'] for e in reissued)} later turns), "
          f"{len(moved)} conversations moved off inference-1")
    assert reissued, "the kill caught no request on inference-1"
    turns = [e["env_turns_mean"] for e in events(run_dir, "orch_step") if "env_turns_mean" in e]
    assert turns and min(turns) > 1.5, f"conversations of one turn: {turns}"


def test_hung_server_and_hung_trainer_are_restarted(tmp_path):
    """SIGSTOP: the processes stay alive but answer nothing; the orchestrator reports them after
    run.hang_timeout_s and the driver kills and restarts them. One server: the run waits for it."""
    run_dir = two_faults(tmp_path, "server+trainer stop", ("inference-0", process("inference-0"), signal.SIGSTOP),
                         ("the trainer's rank", trainer_rank, signal.SIGSTOP), restarted("inference-0"),
                         second_when=three_steps_past_a_checkpoint)
    causes = {e["name"]: e["cause"] for e in events(run_dir, "restart")}
    assert set(causes) == {"inference-0", "trainer"} and all("hung" in c for c in causes.values()), causes
    check_trainer_restart(run_dir)


def test_orchestrator_killed_then_hung(tmp_path):
    """The orchestrator SIGKILLed, then SIGSTOPped: restarted both times, it asks the trainer where to
    continue (after the batches the trainer already holds) and the data order goes on. With partial
    rollouts (half a step's groups over-provisioned) groups finish far out of order: the restarted
    orchestrator starts again at the lowest prompt not trained and skips those trained past it, so no
    prompt is lost and none trained twice (`check_run`). The weights go by the stream from two trainer
    ranks: the restarted orchestrator asks the server for the version it serves, whose folder holds no
    tensors, and the server answers that it serves it. The examples are rows of a dataset file whose epochs wrap
    within the run: the cursor is the same across restarts for a file source."""
    orchestrator = process("orchestrator")
    data = reverse_files(tmp_path)
    run_dir = two_faults(tmp_path, "orchestrator kill+stop", ("the orchestrator", orchestrator, signal.SIGKILL),
                         ("the orchestrator", orchestrator, signal.SIGSTOP), restarted("orchestrator"),
                         "--set", "rl.overprovision=0.5", "--set", "trainer.nproc=2",
                         "--set", 'trainer.weight_transfer="stream"', *data)
    assert not [e for e in events(run_dir, "server_state") if e["state"] == "down"], "no server was taken out"
    restarts = events(run_dir, "restart")
    assert [e["name"] for e in restarts] == ["orchestrator", "orchestrator"]
    assert "hung" in restarts[1]["cause"]
    positions = [e["data_position"] for e in events(run_dir, "orch_step")]
    assert positions == sorted(positions), "the data order continues across restarts"


def reverse_files(tmp_path: Path) -> list[str]:
    """The examples as dataset files (`task.data`; the training file's 300 rows are fewer than the run draws, so
    its epochs wrap), a held-out file for the eval set, and the `--set`s that use them."""
    from prl.tasks.builtin import reverse_dataset

    for name, rows, seed in (("train.jsonl", 300, 0), ("heldout.jsonl", 64, 1)):
        examples = [reverse_dataset(i, seed, 3, 6) for i in range(rows)]
        (tmp_path / name).write_text("".join(json.dumps(e) + "\n" for e in examples))
    return ["--set", f'task.data="{tmp_path}/train.jsonl"', "--set", 'task.reward="prl.tasks.builtin:edit_similarity"',
            "--set", "task.max_prompt_tokens=20", "--set", f'eval.heldout.data="{tmp_path}/heldout.jsonl"']


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
    served = lambda evs: any(e["kind"] == "server" and e["pool_hit_tokens"] > 0 for e in evs)  # noqa: E731
    wait_for(run_dir, proc, lambda evs: rl_step_reached(at)(evs) and served(evs))  # a report shows pool hits
    os.kill(pid_of(run_dir, "kv-master"), signal.SIGKILL)
    killed_at = len((run_dir / "metrics.jsonl").read_text().splitlines())  # events before this one predate it
    wait_for(run_dir, proc, restarted("kv-master"))
    finish(proc, run_dir)
    evs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restart = next(i for i, e in enumerate(evs) if e["kind"] == "restart" and e["name"] == "kv-master")
    before, since, last = {}, {}, {}  # per server: its last report before the kill, first after the restart, last
    for i, e in enumerate(evs):
        if e["kind"] == "server" and (i < killed_at or i > restart):
            (before if i < killed_at else last)[e["name"]] = e
            if i > restart:
                since.setdefault(e["name"], e)
    print({n: {k: v for k, v in m.items() if k.startswith("pool_")} for n, m in last.items()})
    hits = lambda ms: sum(m["pool_hit_tokens"] for m in ms.values())  # noqa: E731
    assert hits(before) > 0, "the pool served prompts before the kill"
    # counted from a report made after the restart (it holds every hit before the kill, however late
    # the servers reported those): the hits that grow from there came from the restarted master
    assert hits(last) > hits(since), f"no pool hit after the master's restart: {hits(since)} then {hits(last)}"


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
