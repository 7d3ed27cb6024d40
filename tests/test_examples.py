"""The tutorial's examples, run as docs/tutorial.md shows them: every file the tutorial shows is the
file under examples/ (and every example file is shown), and every command block (`cd examples/NAME`,
then commands) is run from a copy of that folder, so a run writes nothing into the checkout. Two
substitutions only: `../../bin/prl` is this interpreter's `python -m prl` (what bin/prl execs once
.venv exists; bin/prl itself would reinstall .venv when pyproject.toml changed), and `prl run` gets
`--no-tui` and an output folder under the test's tmp_path. Plus: a bad `env.kind` is refused before
anything starts, in one line naming the key."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, prl_cmd
from prl.recipe.load import tomllib

DOC = ROOT / "docs" / "tutorial.md"
EXAMPLES = ROOT / "examples"
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')


def fenced_blocks() -> list[tuple[str, str, str]]:
    """(language, the rest of the fence line, body) of every fenced block of the tutorial."""
    return FENCE.findall(DOC.read_text())


def shown_files() -> dict[str, str]:
    return {m.group(1): body for _, attrs, body in fenced_blocks() if (m := TITLE.search(attrs))}


def command_blocks() -> dict[str, list[str]]:
    """Example folder name -> the commands its block runs there."""
    out = {}
    for lang, _, body in fenced_blocks():
        if lang == "bash":
            first, *rest = [line for line in body.splitlines() if line.strip()]
            assert first.startswith("cd examples/"), f"a command block that is not an example's: {body!r}"
            out[first.removeprefix("cd examples/")] = rest
    return out


DATA = EXAMPLES / "data"  # the shipped dataset files and their generator (recipes/math-tiny.toml), not a guide


def example_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in EXAMPLES.rglob("*")
            if p.is_file() and p.suffix in (".py", ".toml") and "__pycache__" not in p.parts and DATA not in p.parents}


def test_every_file_the_tutorial_shows_is_the_example_file_and_every_example_file_is_shown():
    shown = shown_files()
    assert set(shown) == example_files()
    for path, body in shown.items():
        assert (ROOT / path).read_text() == body, f"docs/tutorial.md shows another {path} than the file"


def test_every_example_has_a_command_block():
    assert set(command_blocks()) == {p.name for p in EXAMPLES.iterdir() if p.is_dir() and p != DATA}


def argv_of(line: str, output_dir: Path) -> list[str]:
    argv = shlex.split(line)
    if argv[0] == "../../bin/prl":
        extra = ["--no-tui", "--set", f"run.output_dir={output_dir}"] if argv[1] == "run" else []
        return prl_cmd(*argv[1:], *extra)
    if argv[0] == "../../.venv/bin/python":
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"docs/tutorial.md shows a command this test does not run: {line}")


def run_example(name: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """The example's commands, in order, in a copy of its folder: (the run's folder, each command's output)."""
    work = tmp_path / name
    shutil.copytree(EXAMPLES / name, work, ignore=shutil.ignore_patterns("runs", "__pycache__", "tiny-*"))
    outputs = []
    for line in command_blocks()[name]:
        p = subprocess.run(argv_of(line, tmp_path / "runs"), cwd=work, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, f"{line}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        outputs.append(p.stdout + p.stderr)
    run_name = tomllib.loads((work / "recipe.toml").read_text())["run"]["name"]
    return tmp_path / "runs" / run_name, outputs


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["kind"] == kind]


def assert_trained(run_dir: Path) -> None:
    """It started, took every RL step of its recipe and wrote its summary."""
    steps = json.loads((run_dir / "recipe.json").read_text())["rl"]["max_steps"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["rl_steps"] == steps, summary
    assert len([e for e in events(run_dir, "trainer_step") if e.get("stage") == "rl"]) == steps


def test_shipped_data_files_are_what_their_script_writes(tmp_path):
    """examples/data/word-problems is the generator's output at its defaults, and its test split shares no prompt
    with the files training reads."""
    subprocess.run([sys.executable, str(DATA / "make_word_problems.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    shipped = DATA / "word-problems"
    for name in ("train.jsonl", "sft.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
    prompts = {n: {json.loads(line)["prompt"] for line in (shipped / n).open()} for n in ("train.jsonl", "sft.jsonl",
                                                                                           "test.jsonl")}
    assert not prompts["test.jsonl"] & (prompts["train.jsonl"] | prompts["sft.jsonl"])


@pytest.mark.slow
def test_custom_data_example(tmp_path):
    """A data file, the math checker and a held-out row range of the same file: trained, and the set scored its 50
    rows at the start and the end."""
    run_dir, _ = run_example("custom_data", tmp_path)
    assert_trained(run_dir)
    evals = events(run_dir, "eval")
    assert [(e["step"], e["examples"], e["verbatim_share"]) for e in evals] == [(0, 50, 0.0), (4, 50, 0.0)], evals
    kept = [json.loads(line) for line in (run_dir / "samples" / "steps.jsonl").read_text().splitlines()]
    assert sorted({k["step"] for k in kept}) == [0, 1, 2, 3] and all(len(k["prompt"]) > 20 for k in kept)
    scored = (run_dir / "samples" / "eval_heldout.jsonl").read_text().splitlines()
    assert len(scored) == 100 and {json.loads(x)["step"] for x in scored} == {0, 4}  # every completion of both points
    shown = subprocess.run(prl_cmd("samples", run_dir, "--best"), capture_output=True, text=True)
    assert shown.returncode == 0 and "step 3" in shown.stdout and "completion: " in shown.stdout, shown


@pytest.mark.slow
def test_custom_task_example(tmp_path):
    run_dir, _ = run_example("custom_task", tmp_path)
    assert_trained(run_dir)
    assert all(0.0 <= e["reward"] <= 1.0 for e in events(run_dir, "orch_step"))


@pytest.mark.slow
def test_custom_env_example(tmp_path):
    """The guessing game: turns happened, the environment's tokens were appended (trained with mask 0),
    and `prl plan` used the workload the class declares (5 turns of 8 environment tokens)."""
    run_dir, outputs = run_example("custom_env", tmp_path)
    assert_trained(run_dir)
    steps = events(run_dir, "orch_step")
    assert max(s["env_turns_max"] for s in steps) > 1 and sum(s["env_tokens"] for s in steps) > 0
    plan = next(o for line, o in zip(command_blocks()["custom_env"], outputs) if " plan " in line)
    assert "5 turn(s), 32 environment tokens" in plan, plan


@pytest.mark.slow
def test_pretrained_example(tmp_path):
    """The run trains the folder make_model.py wrote: the run's model folder links its weights."""
    run_dir, _ = run_example("pretrained", tmp_path)
    assert_trained(run_dir)
    weights = run_dir / "model" / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tmp_path / "pretrained" / "tiny-qwen3-moe" /
                                                          "model.safetensors").resolve()


BAD_MODULES = {
    "not_an_env.py": "class Env:\n    pass\n",
    "no_seam.py": ("from prl.envs import Environment\n\n\nclass Env(Environment):  # multi_turn not declared\n"
                   "    def example(self, index):\n        return {}\n\n"
                   "    async def rollout(self, example, sampler):\n        return []\n"),
    "broken.py": "import no_such_dependency\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind,words", [
    ("no_such_module:Env", "no module named 'no_such_module'"),
    ("not_an_env:Env", "is not a subclass of prl.envs.Environment"),
    ("no_seam:Env", "declare multi_turn"),
    ("broken:Env", "No module named 'no_such_dependency'"),
    ("not_an_env:Missing", "has no 'Missing'"),
])
def test_a_bad_env_kind_is_refused_in_one_line_before_anything_starts(tmp_path, kind, words):
    for name, text in BAD_MODULES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "recipe.toml").write_text(f"[env]\nkind = {kind!r}\n")
    p = subprocess.run(prl_cmd("run", "recipe.toml", "--no-tui", "--set", f"run.output_dir={tmp_path / 'runs'}"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    named = [line for line in out.splitlines() if "env.kind" in line]
    assert p.returncode == 2 and "Traceback" not in out, out
    assert len(named) == 1 and named[0].startswith("recipe.toml: env.kind: ") and words in named[0], out
    assert not (tmp_path / "runs").exists()


# the seam itself, in this process (fast)

def test_the_builtin_kinds_declare_what_prl_branched_on_by_name():
    from prl.envs import env_class

    assert {k: (env_class(k).multi_turn, env_class(k).needs_sandbox) for k in ("single_turn", "tools", "code")} == {
        "single_turn": (False, False), "tools": (True, False), "code": (True, True)}


def test_a_users_class_is_asked_what_the_names_decided(tmp_path, monkeypatch):
    """A class of the user's own that needs the sandbox gets sandbox workers and their client, and its
    declared workload is the plan's and the length checks'; one that has one turn refuses turn credit."""
    from prl.envs import longest_sample
    from prl.launch.checks import checked
    from prl.launch.configs import resolve
    from prl.recipe.load import RecipeError, validate
    from prl.sizing.workload import workload

    (tmp_path / "user_envs.py").write_text(
        "from prl.envs import EnvWorkload, MultiTurnEnv, SingleTurnEnv\n\n\n"
        "class Runs(MultiTurnEnv):\n    needs_sandbox = True\n\n"
        "    @classmethod\n    def workload(cls, cfg, sampling):\n"
        "        return EnvWorkload(turns=3, env_tokens_per_turn=10, max_tokens=50)\n\n"
        "    async def respond(self, ep, text, example):\n        return None\n\n"
        "    def score(self, ep, example):\n        return 0.0\n\n\n"
        "class OneTurn(SingleTurnEnv):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = checked(validate({"env": {"kind": "user_envs:Runs"}, "sft": {"steps": 0}}, "r.toml"), "r.toml")
    assert longest_sample(recipe.env, recipe.task, recipe.sampling) == recipe.task.max_len * 2 + 8 + 50
    w = workload(recipe)
    assert (w.turns, w.env) == (3, 20)
    configs = resolve(recipe, tmp_path / "run")
    orchestrator = next(c for c in configs if c.role == "orchestrator")
    assert [c.name for c in configs if c.role == "sandbox"] == ["sandbox-0"] and len(orchestrator.sandboxes) == 1
    with pytest.raises(RecipeError, match="rl.credit = 'turn' needs a multi-turn environment"):
        checked(validate({"env": {"kind": "user_envs:OneTurn"}, "rl": {"credit": "turn"}}, "r.toml"), "r.toml")


def test_a_class_without_demonstrations_needs_the_warm_start_off(tmp_path, monkeypatch):
    from prl.launch.checks import checked
    from prl.recipe.load import RecipeError, validate

    (tmp_path / "no_demos.py").write_text(
        "from prl.envs import Environment\n\n\nclass Env(Environment):\n    multi_turn = False\n\n"
        "    def example(self, index):\n        return {}\n\n"
        "    async def rollout(self, example, sampler):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError, match="sft.steps: the warm start learns from demonstrations"):
        checked(validate({"env": {"kind": "no_demos:Env"}}, "r.toml"), "r.toml")
    assert checked(validate({"env": {"kind": "no_demos:Env"}, "sft": {"steps": 0}}, "r.toml"), "r.toml").env.kind == \
        "no_demos:Env"
