"""Online difficulty filtering (`rl.filter_groups = "uniform"`): the filter's decision and its bound,
the recipe keys, and real runs of reverse-tiny whose reward makes chosen prompts uniform: a filtered
group is never trained, its prompt is consumed exactly once (also across an orchestrator killed mid-run),
every step's batch is full, and past the bound uniform groups are trained, counted, instead of the run
sampling forever."""

import json
import os
import signal
import subprocess
import zlib
from pathlib import Path

import pytest

from conftest import ROOT, prl_cmd
from prl.orchestrator.buffer import Group, GroupBuffer, GroupFilter, uniform
from prl.recipe.schema import Recipe
from prl.tasks.builtin import reverse_dataset
from prl.transport.batch import Sample
from test_faults import pid_of, restarted, rl_step_reached, wait_for
from test_run import assert_nothing_left, events

HARD = 24  # prompts below this reward 0 whatever the completion (a task too hard at first: every group uniform)
GROUPS, BOUND = 8, 2  # groups per step (rl.batch_size 64 / group_size 8), rl.max_filtered_per_step


def dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    """reverse's examples, each knowing its index (for `reward`)."""
    return {**reverse_dataset(index, seed, min_len, max_len), "index": index}


def reward(completion: str, example: dict) -> float:
    """0 for the prompts `constant` names (their groups are uniform); for the others a pseudo-random
    function of the completion's text, which spreads unless all of a group's completions are equal."""
    if constant(example["index"]):
        return 0.0
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def constant(index: int) -> bool:
    return index < HARD or index % 2 == 1


# ---- the decision ----
def group(index: int, rewards: list[float]) -> Group:
    return Group(index, [Sample([1], [2], [0.0], [0], 0.0, r) for r in rewards])


def test_a_group_is_uniform_when_its_rewards_spread_at_most_min_std():
    assert uniform(group(0, [0.0] * 4)) and uniform(group(0, [0.3] * 4)) and uniform(group(0, [1.0]))
    assert not uniform(group(0, [0.0, 0.0, 0.0, 1.0]))
    spread = group(0, [0.0, 0.5])  # population std 0.25 exactly
    assert uniform(spread, 0.25) and not uniform(spread, 0.2499)


def test_the_filter_drops_up_to_its_bound_per_step_then_keeps():
    f = GroupFilter("uniform", 0.0, 2, max_steps=2)
    buf = GroupBuffer(2, "mask", f)
    assert buf.add(group(0, [1.0, 0.0]))  # spread: buffered
    assert not buf.add(group(1, [0.0, 0.0])) and not buf.add(group(2, [1.0, 1.0]))
    assert buf.add(group(3, [0.0, 0.0])), "past the bound a uniform group is kept"
    assert [g.prompt_index for g in buf.groups] == [0, 3] and len(buf.lengths.generated) == 8
    assert f.shipped(0) == {"groups_filtered": 2, "groups_filtered_total": 2, "filtered_prompts": [1, 2]}
    assert not buf.add(group(4, [0.0, 0.0])), "the next step counts from 0"
    assert f.shipped(1) == {"groups_filtered": 1, "groups_filtered_total": 3, "filtered_prompts": [4]}
    assert buf.add(group(5, [0.0, 0.0])), "nothing is dropped once the last step shipped"
    off = GroupBuffer(2, "mask")
    assert off.add(group(6, [0.0, 0.0])) and off.filter.shipped(0)["groups_filtered"] == 0


def test_the_recipe_keys_and_the_training_reach():
    rl = {"batch_size": 64, "group_size": 8, "max_steps": 10}
    assert Recipe.model_validate({"rl": rl}).training_reach() == 80
    on = Recipe.model_validate({"rl": {**rl, "filter_groups": "uniform"}})
    assert on.rl.filter_bound() == 8 and on.training_reach() == 160, "unset: a step's groups"
    bounded = Recipe.model_validate({"rl": {**rl, "filter_groups": "uniform", "max_filtered_per_step": 3}})
    assert bounded.training_reach() == 110
    with pytest.raises(ValueError, match="rl.filter_min_std"):
        Recipe.model_validate({"rl": {**rl, "filter_min_std": 0.1}})  # no effect without filter_groups
    with pytest.raises(ValueError, match="filter_min_std"):
        Recipe.model_validate({"rl": {**rl, "filter_groups": "uniform", "filter_min_std": -1}})
    with pytest.raises(ValueError, match="max_filtered_per_step"):  # an eval set where filtering can reach
        Recipe.model_validate({"rl": {**bounded.rl.model_dump()}, "eval": {"h": {"first_index": 100}}})


# ---- real runs ----
def start(tmp_path: Path, steps: int) -> subprocess.Popen:
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    sets = [f"run.output_dir={tmp_path}", f"rl.max_steps={steps}", "sft.steps=10", "rl.batch_size=64",
            'rl.filter_groups="uniform"', f"rl.max_filtered_per_step={BOUND}", 'task.dataset="test_filtering:dataset"',
            'task.reward="test_filtering:reward"', "eval.heldout.examples=8", "run.hang_timeout_s=10"]
    return subprocess.Popen(prl_cmd("run", ROOT / "recipes" / "reverse-tiny.toml", "--no-tui",
                                    *[a for s in sets for a in ("--set", s)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def finish(proc: subprocess.Popen, run_dir: Path, steps: int) -> list[dict]:
    """The run's checks: every step once with a full batch, no prompt twice, a filtered prompt never
    trained nor filtered twice, only uniform prompts filtered, no other prompt skipped, each batch's data
    cursor counting the prompts filtered (as `groups_filtered` says). The orch_step events by step."""
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert not events(run_dir, "error"), events(run_dir, "error")
    ledger = {e["step"]: e["prompts"] for e in map(json.loads, (run_dir / "trained.jsonl").read_text().splitlines())}
    assert sorted(ledger) == list(range(steps)) and all(len(p) == GROUPS for p in ledger.values()), ledger
    trained = [i for s in sorted(ledger) for i in ledger[s]]
    steps_logged = {e["step"]: e for e in events(run_dir, "orch_step")}
    filtered = [i for e in steps_logged.values() for i in e["filtered_prompts"]]
    assert len(trained) == len(set(trained)) and len(filtered) == len(set(filtered)), (ledger, filtered)
    assert not set(filtered) & set(trained) and all(constant(i) for i in filtered), filtered
    assert all(e["groups_filtered"] <= BOUND for e in steps_logged.values())
    for s, e in steps_logged.items():  # past the bound: uniform groups trained, counted
        assert e["groups_uniform"] == sum(constant(i) for i in ledger[s]), (s, e["groups_uniform"], ledger[s])
    last = steps_logged[max(steps_logged)]["data_position"]
    skipped = [i for i in range(last) if not constant(i) and i not in trained]
    assert not skipped, f"prompts below {last} neither filtered nor trained: {skipped}"
    consumed = 0
    for s in range(steps):  # what each batch's cursor consumed: the steps trained and the groups filtered
        if s not in steps_logged:  # shipped, then killed before logging it: its count is unknown
            break
        consumed += GROUPS + steps_logged[s]["groups_filtered"]
        assert steps_logged[s]["data_position"] + steps_logged[s]["data_ahead"] == consumed, (s, steps_logged[s])
    assert_nothing_left(run_dir)
    return [steps_logged[s] for s in sorted(steps_logged)]


def test_uniform_groups_are_filtered_and_every_batch_is_full(tmp_path):
    """The first 24 prompts give every group the same reward: the first steps drop 2 groups each and
    train uniform ones (the run goes on); then only uniform groups are dropped, never trained."""
    steps = 6
    logged = finish(start(tmp_path, steps), tmp_path / "reverse-tiny", steps)
    assert logged[0]["groups_uniform"] == GROUPS and logged[0]["groups_filtered"] == BOUND, logged[0]
    assert logged[-1]["groups_filtered_total"] == sum(e["groups_filtered"] for e in logged) >= BOUND
    assert sum(e["groups_started"] for e in logged) >= steps * GROUPS + logged[-1]["groups_filtered_total"]
    print("groups filtered per step:", [e["groups_filtered"] for e in logged],
          "uniform trained:", [e["groups_uniform"] for e in logged])


def test_an_orchestrator_killed_mid_run_keeps_the_data_cursor_exact(tmp_path):
    """SIGKILL of the orchestrator after RL step 2: the driver restarts it, it continues from the cursor
    of the last batch the trainer holds, which counts the prompts filtered before it, so no filtered
    prompt runs again and none unfiltered is skipped (`finish`)."""
    steps = 6
    proc = start(tmp_path, steps)
    run_dir = tmp_path / "reverse-tiny"
    wait_for(run_dir, proc, rl_step_reached(2))
    os.kill(pid_of(run_dir, "orchestrator"), signal.SIGKILL)
    wait_for(run_dir, proc, restarted("orchestrator"))
    logged = finish(proc, run_dir, steps)
    assert [e["name"] for e in events(run_dir, "restart")] == ["orchestrator"]
    positions = [e["data_position"] for e in logged]
    assert positions == sorted(positions), positions
    print("steps logged:", [e["step"] for e in logged], "filtered:", [e["filtered_prompts"] for e in logged])
