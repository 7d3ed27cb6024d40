"""Whole-run curves in `prl status`: one run with --curves, two runs overlaid on shared scales, the
numbers matching metrics.jsonl; and the live view's key reader on a real pseudo-terminal."""

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from conftest import prl_cmd


def write_run(run_dir: Path, name: str, steps: int, slope: float) -> list[float]:
    """A metrics.jsonl as a run writes it: the event kinds the curves read, plus others they skip."""
    run_dir.mkdir(parents=True)
    rewards, lines = [], [{"kind": "run", "src": "driver", "t": 0, "state": "done", "name": name, "max_steps": steps}]
    for i in range(steps):
        rewards.append(round(0.2 + slope * i, 4))
        lines += [
            {"kind": "orch_step", "src": "orchestrator", "t": i, "step": i, "reward": rewards[-1], "reward_std": 0.05,
             "off_policy_mean": 0.5, "stale_dropped_total": i // 4},
            {"kind": "server", "src": "orchestrator", "t": i, "name": "inference-0", "tokens_per_s": 100.0 + i,
             "version": i, "running": 1, "waiting": 0, "busy_frac": 0.5},
            {"kind": "beat", "src": "orchestrator", "t": i},
            {"kind": "trainer_step", "src": "trainer", "t": i, "stage": "rl", "step": i, "total": steps,
             "loss": 0.5 - 0.01 * i, "mismatch_kl": 1e-3, "tokens_per_s": 2000.0, "version": i + 1},
        ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return rewards


def status(*args) -> str:
    p = subprocess.run(prl_cmd("status", *args), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "160"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def rows(out: str, label: str) -> list[str]:
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(label))
    return lines[i:i + 2]


def test_one_run_with_curves(tmp_path):
    rewards = write_run(tmp_path / "a", "alpha", 30, 0.01)
    out = status(tmp_path / "a", "--curves")
    assert "curves (whole run)" in out
    [reward] = [ln for ln in out.splitlines() if "reward " in ln and "alpha" in ln and "±" in ln]
    assert f"{rewards[-1]:.3f} ±0.050" in reward and f"{min(rewards):.3f}" in reward
    assert "▁" in reward and "█" in reward, "a rising curve spans the scale"
    assert "curves" not in status(tmp_path / "a"), "curves only when asked"


def test_two_runs_overlaid_on_one_scale(tmp_path):
    write_run(tmp_path / "a", "alpha", 40, 0.01)
    write_run(tmp_path / "b", "beta", 20, 0.0)
    out = status(tmp_path / "a", tmp_path / "b")
    assert "alpha: done, 40 RL steps" in out and "beta: done, 20 RL steps" in out and "2 runs overlaid" in out
    alpha, beta = rows(out, "reward")
    assert "alpha" in alpha and "beta" in beta
    # shared scale: beta's flat 0.200 sits at the bottom of alpha's 0.200..0.590 range
    assert set(beta.split("│")[2].strip()) == {"▁"} and "█" in alpha.split("│")[2]
    same = status(tmp_path / "a", tmp_path / "a")
    assert str(tmp_path / "a") in same, "two runs of one name are told apart by their directories"


def test_bad_run_dir_is_named(tmp_path):
    p = subprocess.run(prl_cmd("status", tmp_path / "nothing", "--curves"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "has no metrics.jsonl" in p.stdout


def test_key_reader_on_a_terminal():
    """`c` arrives without Enter through a real pseudo-terminal; the terminal mode is restored."""
    program = ("import sys, time\nfrom prl.tui.keys import KeyReader\nwith KeyReader() as k:\n"
               "    print('ready', flush=True)\n    got = set()\n"
               "    while 'c' not in got:\n        got |= k.pressed(); time.sleep(0.05)\nprint('got c', flush=True)\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", program], stdin=slave, stdout=subprocess.PIPE, text=True)
    os.close(slave)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.write(master, b"c")
        assert proc.stdout.readline().strip() == "got c"
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
        proc.kill()


def test_a_diverged_run_still_shows_its_curves(tmp_path):
    """NaN and inf (a diverged loss) are left out of the curves instead of crashing status or report."""
    write_run(tmp_path / "a", "alpha", 10, 0.01)
    path = tmp_path / "a" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "trainer_step", "src": "trainer", "t": 11, "stage": "rl", "step": 10, "loss": NaN, '
                '"mismatch_kl": Infinity, "tokens_per_s": 1.0}\n')
    curves = status(tmp_path / "a", "--curves").split("curves (whole run)")[1]
    assert "loss" in curves and "nan" not in curves.lower() and "inf" not in curves.lower().replace("inference", "")
    p = subprocess.run(prl_cmd("report", tmp_path / "a", "--out", tmp_path / "r.html"), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "NaN" not in (tmp_path / "r.html").read_text(), p.stderr


def test_the_environments_figures_reach_status_and_the_report(tmp_path):
    """A multi-turn run's last step in `prl status` (turns, tool calls, forks, sandbox) and each figure
    per step in `prl report`'s Environment section, with its exact values."""
    from prl.report import build_report
    from prl.report_data import RunData

    write_run(tmp_path / "a", "agent", 3, 0.01)
    path = tmp_path / "a" / "metrics.jsonl"
    env = [{"kind": "orch_step", "src": "orchestrator", "t": 10 + i, "step": i, "reward": 0.3, "env_turns_mean": 1.5 + i,
            "env_turns_p50": 2, "env_turns_max": 3, "env_tool_calls_per_turn": 0.25, "env_tool_errors_per_turn": 0.0,
            "env_truncated_share": 0.1, "env_tokens": 40, "env_model_tokens": 90, "env_retokenize_forks": i,
            "sandbox_executions": 7, "sandbox_cached": 2, "sandbox_timeouts": 1, "sandbox_kills": 0, "sandbox_s": 1.25,
            "first_attempt_success": 0.5, "second_turn_success": 0.25} for i in range(3)]
    path.write_text(path.read_text() + "".join(json.dumps(e) + "\n" for e in env))
    out = status(tmp_path / "a")
    assert "turns 3.50 (p50 2, max 3)" in out and "re-tokenisation forks 2" in out, out
    assert "executions 7 (cached 2)" in out and "second turn 25%" in out, out
    page = build_report([RunData(tmp_path / "a")])
    assert "<h2>Environment</h2>" in page and "re-tokenisation forks" in page and "sandbox time" in page


def test_the_steps_exchanges_reach_status(tmp_path):
    """Expert or context parallelism: the last step's seconds of exchanges in flight and exposed, and
    the share hidden; a run without exchanges shows no such row."""
    write_run(tmp_path / "a", "ep", 2, 0.01)
    assert "exchanges" not in status(tmp_path / "a")
    path = tmp_path / "a" / "metrics.jsonl"
    step = {"kind": "trainer_step", "src": "trainer", "t": 9, "stage": "rl", "step": 1, "total": 2, "loss": 0.4,
            "comm_s": 1.25, "exposed_comm_s": 0.25, "fwd_bwd_s": 3.0}
    path.write_text(path.read_text() + json.dumps(step) + "\n")
    assert "1.25s in flight, 0.25s exposed (80% hidden behind compute)" in status(tmp_path / "a")


def test_the_models_signals_reach_status(tmp_path):
    """A reward model's and a judge's last step (scores, tokens, seconds, drops) and the KL to a teacher in `prl
    status`; a run without them shows none of these rows."""
    write_run(tmp_path / "a", "rm", 2, 0.01)
    assert "reward model" not in status(tmp_path / "a") and "judge" not in status(tmp_path / "a")
    path = tmp_path / "a" / "metrics.jsonl"
    step = {"kind": "orch_step", "src": "orchestrator", "t": 9, "step": 1, "reward": 0.4, "task_reward": 0.25,
            "reward_dropped": 3, "reward_model_score": 1.5, "reward_model_tokens": 640, "reward_model_s": 0.5,
            "judge_score": 7.25, "judge_tokens": 900, "judge_s": 2.0, "judge_unparsed": 2, "teacher_kl": 0.125}
    path.write_text(path.read_text() + json.dumps(step) + "\n")
    out = status(tmp_path / "a")
    assert "task reward 0.250  groups dropped 3" in out and "score 1.500  640 tokens in 0.50s" in out, out
    assert "score 7.250  900 tokens in 2.00s  unparsed 2" in out and "KL to the teacher 0.125" in out, out


def test_plain_output_prints_each_step_once_and_a_tenth_of_the_warm_start():
    """`--no-tui`: every RL step once, in order, even when the driver looks after several (and not a step a restarted
    trainer replays); a warm-start line per tenth."""
    from prl.launch.driver import progress_lines
    from prl.tui.state import RunState

    s, printed = RunState(), {"sft": -1, "rl": -1}
    for step in range(20):
        s.apply({"kind": "trainer_step", "stage": "sft", "step": step, "total": 20, "loss": 1.0})
    lines = progress_lines(s, printed)
    assert [x.split()[2] for x in lines] == [f"{k}/20" for k in range(2, 21, 2)]
    for step in (0, 1, 2, 1, 2, 3):  # steps 1 and 2 replayed after a restart
        s.apply({"kind": "orch_step", "step": step, "reward": 0.5})
        s.apply({"kind": "trainer_step", "stage": "rl", "step": step, "total": 4, "loss": 0.1, "version": step + 1})
    assert [x.split()[1] for x in progress_lines(s, printed)] == ["1/4", "2/4", "3/4", "4/4"]
    assert progress_lines(s, printed) == []


def test_plain_output_says_what_starts_and_what_restarts_from_this_launch_on():
    """`--no-tui` during start-up: each process started, the orchestrator's state, servers taken out and restarts;
    a resumed run's earlier notices (before this launch's `run` event) are not printed again."""
    from prl.launch.driver import progress_lines
    from prl.tui.state import RunState

    s = RunState()
    s.apply({"kind": "process", "t": 5.0, "name": "trainer", "state": "running", "pid": 7, "host": "local"})
    s.apply({"kind": "run", "t": 10.0, "state": "running", "started": 10.0})
    events = [{"kind": "process", "name": "inference-0", "state": "running", "pid": 8, "host": "local"},
              {"kind": "orchestrator", "state": "waiting for the trainer"},
              {"kind": "server_state", "name": "inference-0", "state": "down", "cause": "not answering"},
              {"kind": "restart", "name": "inference-0", "count": 1, "max_restarts": 3, "cause": "exited with code 1"},
              {"kind": "process", "name": "orchestrator", "state": "done"}]
    for e in events:
        s.apply({**e, "t": 11.0})
    printed = {"sft": -1, "rl": -1, "since": s.run["started"]}
    assert progress_lines(s, printed) == ["inference-0: started (pid 8 on local)", "orchestrator: waiting for the trainer",
                                          "inference-0: down (not answering)",
                                          "inference-0: restart 1 of 3 (exited with code 1)"]
