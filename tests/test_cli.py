"""The `prl` command as a user types it: `--version`, `-h`, and every command given bad input (missing
files, wrong keys, wrong types, a directory that is not a run) answers with a short message naming
what is wrong and a non-zero exit, never a traceback; nothing starts."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, prl_cmd

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"


def prl(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(prl_cmd(*args), capture_output=True, text=True, timeout=120, cwd=cwd)


def test_version_and_short_help():
    from prl import __version__

    p = prl("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"prl {__version__}", p
    for args in (("-h",), ("run", "-h"), ("ckpt", "export", "-h"), ("stop", "-h"), ("keys", "-h")):
        p = prl(*args)
        assert p.returncode == 0 and "Usage:" in p.stdout, (args, p.stdout, p.stderr)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Files and directories a user can get wrong."""
    d = tmp_path_factory.mktemp("bad")
    (d / "notoml.toml").write_text("[trainer\nlr = 1")
    (d / "unknown_key.toml").write_text("[trainer]\nlrr = 1e-3\n")
    (d / "wrong_type.toml").write_text("[trainer]\nlr = 'fast'\n")
    (d / "binary.toml").write_bytes(b"\xff\xfe\x00garbage")
    (d / "notarun").mkdir()
    (d / "corrupt").mkdir()
    (d / "corrupt" / "recipe.json").write_text("{not json")
    (d / "corrupt" / "metrics.jsonl").write_text("")
    done = d / "done"
    done.mkdir()
    (done / "recipe.json").write_text("{}")
    (done / "metrics.jsonl").write_text(
        json.dumps({"kind": "run", "src": "driver", "state": "running", "pid": 1, "name": "done", "started": 1.0}) + "\n"
        + json.dumps({"kind": "run", "src": "driver", "state": "done", "ended": 2.0}) + "\n")
    return d


CASES = {
    "run: no recipe": (["run"], "give a recipe"),
    "run: missing file": (["run", "{d}/missing.toml"], "not found"),
    "run: a directory": (["run", "{d}/notarun"], "notarun"),
    "run: not TOML": (["run", "{d}/notoml.toml"], "notoml.toml"),
    "run: not text": (["run", "{d}/binary.toml"], "binary.toml"),
    "run: unknown key": (["run", "{d}/unknown_key.toml"], "lrr"),
    "run: wrong type": (["run", "{d}/wrong_type.toml"], "trainer.lr"),
    "run: --set wrong type": (["run", str(RECIPE), "--set", "trainer.lr=fast", "--dry-run"], "trainer.lr"),
    "run: --set no value": (["run", str(RECIPE), "--set", "trainer.lr", "--dry-run"], "--set"),
    "run: --set unknown section": (["run", str(RECIPE), "--set", "trainr.lr=1", "--dry-run"], "trainr"),
    "run: recipe and --resume": (["run", str(RECIPE), "--resume", "{d}/notarun"], "not both"),
    "run: --resume not a run": (["run", "--resume", "{d}/notarun"], "not a prl run directory"),
    "run: --resume not a run, dry": (["run", "--resume", "{d}/notarun", "--dry-run"], "not a prl run directory"),
    "run: --resume missing": (["run", "--resume", "{d}/missing", "--dry-run"], "missing"),
    "run: --resume corrupt": (["run", "--resume", "{d}/corrupt", "--dry-run"], "recipe.json"),
    "run: unknown option": (["run", str(RECIPE), "--bogus"], "--bogus"),
    "run: a data file that is not there": (["run", str(ROOT / "recipes/math-tiny.toml"), "--dry-run", "--set",
                                             'task.data="{d}/none.jsonl"'], "no such file"),
    "run: whole-sample objective under CP": (
        ["run", str(RECIPE), "--dry-run", "--set", 'trainer.loss.correction="gspo_token"', "--set",
         'trainer.loss.normalize="token"', "--set", 'model.arch="glm_moe_dsa"', "--set", "trainer.nproc=2",
         "--set", "trainer.parallel.cp=2"], "trainer.loss.correction = 'gspo_token' needs trainer.parallel.cp = 1"),
    "plan: missing file": (["plan", "{d}/missing.toml"], "not found"),
    "plan: unknown key": (["plan", "{d}/unknown_key.toml"], "lrr"),
    "plan: whole-sample objective under CP": (
        ["plan", str(RECIPE), "--set", 'trainer.loss.correction="seq_mask"', "--set", "trainer.nproc=2", "--set",
         "trainer.parallel.cp=2"], "trainer.loss.correction = 'seq_mask' needs trainer.parallel.cp = 1"),
    "doctor: missing file": (["doctor", "{d}/missing.toml"], "not found"),
    "doctor: wrong type": (["doctor", "{d}/wrong_type.toml"], "trainer.lr"),
    "status: not a run": (["status", "{d}/notarun"], "notarun"),
    "status --json: not a run": (["status", "--json", "{d}/notarun"], "not a prl run directory"),
    "status --json: missing": (["status", "--json", "{d}/missing"], "no such directory"),
    "runs: missing": (["runs", "{d}/missing"], "no such directory"),
    "samples: not a run": (["samples", "{d}/notarun"], "not a prl run directory"),
    "stop: not a run": (["stop", "{d}/notarun"], "not a prl run directory"),
    "stop: finished run": (["stop", "{d}/done"], "not running"),
    "report: not a run": (["report", "{d}/notarun", "--out", "{d}/r.html"], "notarun"),
    "ckpt export: not a run": (["ckpt", "export", "{d}/notarun", "--out", "{d}/x"], "notarun"),
    "ckpt export: bad step": (["ckpt", "export", "{d}/done", "--out", "{d}/x", "--step", "abc"], "checkpoint"),
    "keys: unknown section": (["keys", "trainr"], "trainr"),
    "sandbox run: missing file": (["sandbox", "run", "{d}/missing.py"], "missing.py"),
    "unknown command": (["frobnicate"], "frobnicate"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_message_not_a_traceback(case, bad):
    args, words = CASES[case]
    p = prl(*(a.format(d=bad) for a in args))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Traceback" not in out, out
    assert words in out, out
    assert len(out.strip().splitlines()) <= 12, out


def test_stop_refuses_a_pid_that_is_no_longer_the_driver(tmp_path):
    """A run whose driver died without a word (SIGKILL) leaves `running` and a pid in its log; that pid
    may now be another program's: `prl stop` names it and kills nothing."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "metrics.jsonl").write_text(json.dumps(
            {"kind": "run", "src": "driver", "state": "running", "pid": other.pid, "name": "x", "started": 1.0}) + "\n")
        p = prl("stop", tmp_path)
        assert p.returncode == 2 and "is gone or is another program" in p.stderr, p
        assert other.poll() is None, "prl stop must not signal a pid that is not the run's driver"
    finally:
        other.kill()
        other.wait()


def test_a_task_whose_own_code_fails_is_one_line_not_a_traceback(tmp_path):
    """The user's dataset or reward raising (a missing field, a wrong signature, a division by an empty
    completion's length) is their bug: `prl run --dry-run` names the task and the exception in one
    line, exit 2, nothing started."""
    (tmp_path / "broken.py").write_text(
        "def data(index, seed, **kw):\n    return {'prompt': 'ab', 'target': 'ba'}\n\n"
        "def score(completion, example):\n    return 1.0 / len(completion) + example['answer']\n")
    (tmp_path / "recipe.toml").write_text("[task]\nname = 'custom'\ndataset = 'broken:data'\nreward = 'broken:score'\n")
    p = prl("run", "recipe.toml", "--dry-run", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out and "ZeroDivisionError" in out and "custom" in out, out


def test_the_checks_before_a_run_leave_torch_unimported():
    """`prl run`'s checks of a recipe (tokenizer, task, prompts, built-in objective) run before any process starts,
    on the path of every run's start-up: they import no torch (1-1.5 s of a core), which the processes import."""
    code = ("import sys; from prl.launch.checks import load; from prl.launch.driver import preflight; "
            f"preflight(load({str(RECIPE)!r}, [])); print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.split()[-1] == "False", p.stdout[-2000:] + p.stderr[-2000:]
