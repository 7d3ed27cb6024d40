"""A user's code that fails during a real run (`prl run` with every process): one line naming the user's
function, file and line and the example, no restart, no traceback; `env.on_error = "drop"` finishes, counting;
`task.options` and `env.options` reach the user's code; a `respond` that returns text or is not a coroutine is
named."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, prl_cmd

pytestmark = pytest.mark.slow

REWARD = '''
def reward(completion, example, fail_if_starts=None):
    """Raises on a sampled completion (never on the launch probe's "" or answer) of the examples whose answer
    starts with `fail_if_starts` (a task option)."""
    if completion not in ("", example["answer"]) and example["answer"].startswith(fail_if_starts):
        return 1 / 0
    return float(completion.strip() == example["answer"])
'''

ENV = '''
from prl.envs import MultiTurnEnv


class Echo(MultiTurnEnv):
    @classmethod
    def from_context(cls, ctx):
        env = cls(**cls.context_args(ctx))
        env.say = ctx.cfg.options["say"]
        return env

    async def respond(self, ep, text, example):
        return self.say  # text, not token ids

    def score(self, ep, example):
        return 0.0


class Plain(Echo):
    def respond(self, ep, text, example):
        return None


class Broken(Echo):
    @classmethod
    def from_context(cls, ctx):
        return ctx.cfg.options["missing"]
'''


def recipe(tmp_path: Path) -> Path:
    """reverse-tiny without its eval set, 3 RL steps, no warm start, and the user's modules beside it."""
    text = (ROOT / "recipes" / "reverse-tiny.toml").read_text().split("# Held-out evaluation")[0]
    (tmp_path / "mytask.py").write_text(REWARD)
    (tmp_path / "myenv.py").write_text(ENV)
    path = tmp_path / "r.toml"
    path.write_text(text.replace("steps = 60", "steps = 0").replace("max_steps = 120", "max_steps = 3"))
    return path


def run(tmp_path: Path, *sets: str, dry: bool = False) -> subprocess.CompletedProcess:
    args = ["--dry-run"] if dry else ["--no-tui"]
    sets = ("run.output_dir=runs", "task.reward=mytask:reward", *sets)
    return subprocess.run(prl_cmd("run", recipe(tmp_path), *args, *[a for s in sets for a in ("--set", s)]),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


def events(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / "runs" / "reverse-tiny" / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_a_reward_that_raises_stops_the_run_in_one_line_naming_its_file_and_line(tmp_path):
    p = run(tmp_path, "task.options={fail_if_starts = ''}")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("prl run: failed:"))
    assert f"reward ({tmp_path / 'mytask.py'}:6) raised ZeroDivisionError: division by zero (example " in line, line
    assert "user_error.json" in line and "env.on_error = 'drop'" in line, line
    written = json.loads((tmp_path / "runs" / "reverse-tiny" / "user_error.json").read_text())
    assert "ZeroDivisionError" in written["traceback"] and written["example"]["answer"] and written["index"] >= 0
    assert not events(tmp_path, "restart"), "the user's error is not a fault to restart from"


def test_with_on_error_drop_the_run_finishes_counting_what_it_dropped(tmp_path):
    p = run(tmp_path, "task.options={fail_if_starts = 'a'}", "env.on_error=drop", "env.max_error_share=0.5")
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    counted = sum(e["user_errors"] for e in events(tmp_path, "orch_step"))
    said = events(tmp_path, "user_error")
    assert counted >= 1 and len(said) >= min(counted, 20), (counted, said)
    assert all("mytask.py:6) raised ZeroDivisionError" in e["line"] for e in said)
    assert not events(tmp_path, "restart")


def test_an_environment_whose_respond_returns_text_is_named_and_gets_its_options(tmp_path):
    p = run(tmp_path, "env.kind=myenv:Echo", "env.options={say = 'hello from options'}", "env.format=tiny",
            "env.max_total_tokens=64")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "Echo.respond returned text ('hello from options'); it returns token ids or None" in out, out[-3000:]
    assert not events(tmp_path, "restart")


def test_a_respond_that_is_not_a_coroutine_is_refused_before_anything_starts(tmp_path):
    p = run(tmp_path, "env.kind=myenv:Plain", "env.options={say = 'x'}", dry=True)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert "respond must be a coroutine: write `async def respond(...)`" in out, out
    assert not (tmp_path / "runs").exists()


def test_a_task_option_the_users_function_does_not_take_is_refused_before_anything_starts(tmp_path):
    p = run(tmp_path, "task.options={tolerance = 0.1}", dry=True)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "task.options 'tolerance': task.reward mytask:reward takes no such keyword argument" in out, out


def test_a_demonstration_that_raises_in_the_warm_start_stops_the_run_naming_it(tmp_path):
    """The trainer builds the warm start's demonstrations from the user's environment: its error is the user's too,
    named in one line, the trainer not restarted."""
    (tmp_path / "demoenv.py").write_text(
        "from myenv import Echo\n\n\nclass Demo(Echo):\n    def demonstration(self, index):\n"
        "        raise KeyError(f'no demo {index}')\n")
    p = run(tmp_path, "env.kind=demoenv:Demo", "env.options={say = 'x'}", "env.format=tiny", "env.max_total_tokens=64",
            "sft.steps=2")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert f"demonstration ({tmp_path / 'demoenv.py'}:6) raised KeyError: 'no demo 0' (example 0)" in out, out[-3000:]
    assert not events(tmp_path, "restart")


def test_what_a_users_rollout_and_dataset_return_is_checked_where_it_crosses_into_prl():
    """A custom environment's `rollout` and a task's dataset function are named when they return what prl cannot
    use (checked as the orchestrator takes them; no run needed to see the line)."""
    from prl.envs import Trajectory
    from prl.orchestrator.orchestrator import checked_group
    from prl.recipe.schema import TaskCfg
    from prl.tasks import make_task
    from prl.usercode import UserCodeError

    class Mine:
        pass

    good = Trajectory([1], [2, 3], [0.0, 0.0], [0, 0], 0.5)
    assert checked_group(Mine(), [good, good], 2) == [good, good]
    cases = [([good], "Mine.rollout returned a list of 1; it returns a list of rl.group_size = 2"),
             ((good, good), "Mine.rollout returned a tuple"),
             ([good, Trajectory([1], [2, 3], [0.0], [0, 0], 0.5)], "logprobs, versions and mask differ in length (2, 1"),
             ([good, Trajectory([1], [2], [0.0], [0], 2.0)], "Mine.rollout: the reward is 2.0, outside [0, 1]")]
    for trajs, words in cases:
        with pytest.raises(UserCodeError, match=re.escape(words)):
            checked_group(Mine(), trajs, 2)
    task = make_task(TaskCfg(name="custom", dataset="test_user_code:no_prompt", reward="exact"), 0)
    with pytest.raises(UserCodeError, match=re.escape("task.dataset test_user_code:no_prompt returned a dict with keys "
                                                      "['question']; it returns a dict with \"prompt\"")):
        task.example(0)


def no_prompt(index, seed, min_len, max_len):
    return {"question": "2+2"}


def test_an_environment_that_cannot_be_built_is_refused_before_anything_starts(tmp_path):
    p = run(tmp_path, "env.kind=myenv:Broken", "env.options={say = 'x'}", "env.max_total_tokens=64", "sft.steps=0",
            dry=True)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert f"from_context ({tmp_path / 'myenv.py'}:27) raised KeyError: 'missing'; nothing was started" in out, out


def test_blame_names_the_innermost_frame_outside_the_libraries_and_never_prls_own(tmp_path, monkeypatch):
    """Raised in the user's file, or in a library it called: the user's, at their line. Raised inside prl under the
    user's code (a server that kept failing under a user's `rollout`): prl's."""
    import importlib

    from prl.usercode import blame

    (tmp_path / "mine_blamed.py").write_text(
        "import json\nfrom prl.tasks import checked_reward\n\n\ndef own():\n    return 1 / 0\n\n\n"
        "def library():\n    return json.loads('{')\n\n\ndef prls():\n    return checked_reward('1')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = importlib.import_module("mine_blamed")
    caught = {}
    for name in ("own", "library", "prls"):
        try:
            getattr(mine, name)()
        except Exception as e:  # noqa: BLE001
            caught[name] = blame(e)
    assert str(caught["own"]).startswith(f"own ({tmp_path / 'mine_blamed.py'}:6) raised ZeroDivisionError")
    assert str(caught["library"]).startswith(f"library ({tmp_path / 'mine_blamed.py'}:10) raised JSONDecodeError")
    assert caught["prls"] is None
