"""Held-out evaluation: the estimators against enumeration, the recipe's refusals, and real runs:
eval sets scored inside a run on the rollout servers (each point once, under the version it
scores, never trained on), and `prl eval` on the run's checkpoints giving the same figures."""

import asyncio
import collections
import itertools
import json
import math
import random
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, prl_cmd
from prl.envs import Trajectory
from prl.evaluation.estimators import MAJ_SUBSETS, best_at_k, maj_at_k, pass_at_k
from prl.evaluation.runner import figures
from prl.recipe import RecipeError, load_recipe
from test_run import assert_nothing_left, events

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"


# ---- estimators ----
def test_pass_and_best_at_k_equal_the_mean_over_every_k_subset():
    rng = random.Random(0)
    for n in range(1, 7):
        for k in range(1, n + 1):
            rewards = [rng.choice([0.0, 0.25, 1.0, 1.0]) for _ in range(n)]
            subsets = list(itertools.combinations(rewards, k))
            c = sum(r >= 1.0 for r in rewards)
            assert pass_at_k(n, c, k) == pytest.approx(sum(max(s) >= 1.0 for s in subsets) / len(subsets))
            assert best_at_k(rewards, k) == pytest.approx(sum(max(s) for s in subsets) / len(subsets))
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0


def test_maj_at_k_votes_within_each_subset():
    answers, correct = ["a", "b", "b", "c"], [True, False, False, False]
    assert maj_at_k(answers, correct, 1) == pytest.approx(1 / 4)
    # k = 3: {a,b,b} -> b; {a,b,c} -> a (tie, given first); {a,b,c} -> a; {b,b,c} -> b
    assert maj_at_k(answers, correct, 3) == pytest.approx(2 / 4)
    big = [str(i % 3) for i in range(40)]  # C(40, 20) subsets: a seeded sample of them, the same each time
    assert maj_at_k(big, [a == "0" for a in big], 20) == maj_at_k(big, [a == "0" for a in big], 20)


def majority_by_enumeration(answers: list[str], correct: list[bool], k: int) -> float:
    """maj@k over every k-subset, counted apart from the estimator: the answer most members give, on a
    tie the one whose earliest member comes first."""
    wins = subsets = 0
    for subset in itertools.combinations(range(len(answers)), k):
        votes = collections.Counter(answers[i] for i in subset)
        top = max(votes.values())
        winner = min(i for i in subset if votes[answers[i]] == top)
        wins += correct[winner]
        subsets += 1
    return wins / subsets


def test_maj_at_k_past_the_subset_cap_estimates_the_exact_mean():
    answers = ["a"] * 5 + ["b"] * 6 + ["c"] * 5  # C(16, 8) = 12870 subsets, past MAJ_SUBSETS
    correct = [a == "a" for a in answers]
    assert math.comb(16, 8) > MAJ_SUBSETS
    exact = majority_by_enumeration(answers, correct, 8)
    assert exact == pytest.approx(0.413, abs=1e-3)  # ties, won by the earlier a, matter: 0.133 if won by the later
    tolerance = 4 * math.sqrt(exact * (1 - exact) / MAJ_SUBSETS)  # four standard errors of the sampled mean
    for seed in range(3):
        assert maj_at_k(answers, correct, 8, seed=seed) == pytest.approx(exact, abs=tolerance), seed


def test_figures_attribute_tokens_of_later_versions_to_the_start_version():
    def traj(reward, versions, mask=None):
        return Trajectory([1], [5] * len(versions), [0.0] * len(versions), versions, reward, mask=mask,
                          answer=str(reward))

    groups = [[traj(1.0, [3, 3, 4, 4]), traj(0.0, [3, 4])],
              [traj(0.5, [3, -1, 4], mask=[1, 0, 1]), traj(1.0, [3, 3])]]
    out = figures(groups, [1, 2], 1.0, version=3)
    assert out["later_share"] == pytest.approx(4 / 10)  # environment tokens (mask 0) are not the model's
    assert out["pass@1"] == pytest.approx(0.5) and out["pass@2"] == pytest.approx(1.0)
    assert out["reward"] == pytest.approx(2.5 / 4) and out["completion_len"] == pytest.approx(10 / 4)
    assert out["best@2"] == pytest.approx(1.0) and "maj@2" in out


# ---- held out ----
def training_prompts_of(recipe) -> set[str]:
    """Every prompt training can draw, generated from the task alone: the RL stream's indices up to its reach
    and the warm start's demonstrations (drawn from run.seed + 7919)."""
    from prl.tasks import make_task

    rl, warm = make_task(recipe.task, recipe.run.seed), make_task(recipe.task, recipe.run.seed + 7919)
    demos = recipe.sft.steps_for(recipe.model) * recipe.sft.batch_size
    return ({rl.example(i)["prompt"] for i in range(recipe.training_reach())}
            | {warm.example(i)["prompt"] for i in range(demos)})


def reverse_tiny_sets(overrides=()):
    from prl.envs import make_env
    from prl.evaluation.sets import build_sets, run_streams
    from prl.model.tiny import char_tokenizer

    recipe = load_recipe(RECIPE, list(overrides))
    tok = char_tokenizer()
    cfg = SimpleNamespace(env=recipe.env, task=recipe.task, run=recipe.run, sampling=recipe.sampling,  # as resolved
                          training_reach=recipe.training_reach(),
                          warm_start_examples=recipe.sft.steps_for(recipe.model) * recipe.sft.batch_size, sft=None)
    train_env = make_env(recipe.env, recipe.task, recipe.run.seed, tok, recipe.sampling, recipe.rl.group_size, False)
    sets = build_sets(recipe.eval, recipe.task, recipe.env, recipe.sampling, recipe.run.seed, tok,
                      training=run_streams(cfg, train_env, tok))
    return recipe, {s.name: s for s in sets}


def replaced_among(recipe, examples: int) -> int:
    """Of the indices from 1000000000 on, the training prompts passed over before `examples` others."""
    from prl.tasks import make_task

    task, seen, kept, index = make_task(recipe.task, recipe.run.seed), training_prompts_of(recipe), 0, 1_000_000_000
    while kept < examples:
        kept += task.example(index)["prompt"] not in seen
        index += 1
    return index - 1_000_000_000 - examples


def test_the_held_out_set_of_reverse_tiny_holds_no_training_prompt():
    recipe, sets = reverse_tiny_sets()
    s, seen = sets["heldout"], training_prompts_of(recipe)
    prompts = [s.env.example(i)["prompt"] for i in s.indices()]
    assert len(prompts) == len(set(s.indices())) == 64 and not set(prompts) & seen
    assert s.verbatim_share == 0.0
    # the indices from 1000000000 on, skipping exactly those whose prompt training draws
    naive = [s.env.example(1_000_000_000 + i)["prompt"] for i in range(64 + s.replaced)]
    assert list(s.indices()) == [1_000_000_000 + i for i, p in enumerate(naive) if p not in seen]
    assert s.replaced == sum(p in seen for p in naive) > 10, "a quarter of the first 64 are training prompts"


def test_a_set_the_user_places_keeps_its_indices_and_reports_its_share():
    recipe, sets = reverse_tiny_sets(["eval.heldout.first_index=5000", "eval.own.examples=16",
                                      'eval.own.task.name="sort"'])
    placed, seen = sets["heldout"], training_prompts_of(recipe)
    assert list(placed.indices()) == list(range(5000, 5064)) and placed.replaced is None
    share = sum(placed.env.example(i)["prompt"] in seen for i in range(5000, 5064)) / 64
    assert placed.verbatim_share == pytest.approx(share, abs=1e-4) and share > 0.1
    assert sets["own"].replaced is None and sets["own"].verbatim_share == 0.0  # sort's prompts: none of reverse's


def test_a_held_out_set_training_covers_is_refused_before_anything_starts(tmp_path):
    """reverse with words of 3 letters: 512 prompts, every one a training prompt."""
    p = subprocess.run(prl_cmd("run", RECIPE, "--dry-run", "--set", "task.max_len=3", "--set",
                               f"run.output_dir={tmp_path}"), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "eval.heldout: only 0 of indices" in out, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def orchestrator_sets(recipe, run_dir):
    """The recipe's eval sets as the orchestrator of its resolved config builds them."""
    from prl.envs import make_env
    from prl.evaluation.sets import build_sets, run_streams
    from prl.launch.configs import resolve
    from prl.model.tiny import char_tokenizer

    cfg, tok = next(c for c in resolve(recipe, run_dir) if c.role == "orchestrator"), char_tokenizer()
    train_env = make_env(cfg.env, cfg.task, cfg.run.seed, tok, cfg.sampling, cfg.rl.group_size, cfg.router_replay)
    sets = build_sets(cfg.eval, cfg.task, cfg.env, cfg.sampling, cfg.run.seed, tok, training=run_streams(cfg, train_env, tok))
    return cfg, {s.name: list(s.indices()) for s in sets}


def test_prl_eval_builds_the_held_out_set_the_run_scored(tmp_path):
    """sft.steps unset: a tiny model warms up 40 steps, and prl eval (model.path now the checkpoint, where
    unset steps mean none) still leaves out those demonstrations' prompts, so it scores the run's examples."""
    from prl.launch.evaluate import serving_recipe

    recipe = load_recipe(RECIPE)
    recipe = recipe.model_copy(update={"sft": recipe.sft.model_copy(update={"steps": None})})
    run_cfg, run_sets = orchestrator_sets(recipe, tmp_path / "run")
    served = serving_recipe(recipe, tmp_path / "run" / "evals" / "model_step_120", tmp_path / "run" / "evals" / "step_120", [])
    eval_cfg, eval_sets = orchestrator_sets(served, tmp_path / "run" / "evals" / "step_120")
    assert run_cfg.warm_start_examples == eval_cfg.warm_start_examples == 40 * 32
    assert eval_sets == run_sets
    without_demos = recipe.model_copy(update={"sft": recipe.sft.model_copy(update={"steps": 0})})
    assert orchestrator_sets(without_demos, tmp_path / "other")[1] != run_sets, "the demonstrations change the set"


LOOPING_ENV = """from prl.envs import SingleTurnEnv


class Looping(SingleTurnEnv):
    \"\"\"The task's first 50 examples over and over: every example is one training draws.\"\"\"

    def example(self, index):
        return self.task.example(index % 50)
"""


def test_a_held_out_set_the_environment_covers_is_refused_before_anything_starts(tmp_path):
    """The task alone has the set's prompts; the environment the run draws from does not: the launch checks
    the environment's examples, as the orchestrator builds them, and refuses in one line."""
    (tmp_path / "looping_env.py").write_text(LOOPING_ENV)
    p = subprocess.run(prl_cmd("run", RECIPE, "--dry-run", "--set", 'env.kind="looping_env:Looping"', "--set",
                               f"run.output_dir={tmp_path}"), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "eval.heldout: only 0 of indices" in out, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def test_training_past_the_prompts_compared_warns_at_launch():
    """1300 steps of 16 groups reach past the 20000 RL prompts a set is compared with: the dry run says so."""
    import io

    from rich.console import Console

    from prl.evaluation.sets import TRAINING_SCAN, scan_warnings
    from prl.launch.driver import dry_run

    assert scan_warnings(load_recipe(RECIPE)) == []
    recipe = load_recipe(RECIPE, ["rl.max_steps=1300"])
    reach = recipe.training_reach()
    assert reach > TRAINING_SCAN == 20_000
    out = io.StringIO()
    assert dry_run(recipe, Console(file=out, width=10_000)) == 0
    [line] = [x for x in out.getvalue().splitlines() if "warning" in x]
    assert line.startswith("prl run: warning: eval.heldout: ") and f"{reach} RL examples" in line and "20000" in line
    assert "demonstrations" not in line  # 60 x 32 of them, all compared


# ---- the eval's share of the in-flight budget ----
class CountingPool:
    """Stands in for the orchestrator around an in-run eval: its in-flight budget (set by the test) and a
    server pool that answers each request after a moment, noting the samples in flight and the budget."""

    def __init__(self, log_path, budget: int):
        from prl.metrics import EventLog

        from prl.model.tiny import char_tokenizer
        from prl.orchestrator.samples import SampleWriter

        self.log, self.changed, self.budget = EventLog(log_path, "orchestrator"), asyncio.Condition(), budget
        self.inflight, self.seen = 0, []  # (samples in flight, budget) at each request
        self.samples = SampleWriter(log_path.parent, 4, 0, char_tokenizer())  # where the set's completions go

    def inflight_budget(self) -> int:
        return self.budget

    def eval_sampler(self, index: int):
        return self

    async def generate(self, req, conversation=None):
        from prl.inference.protocol import Completion, GenerateResponse

        self.inflight += req.n
        self.seen.append((self.inflight, self.budget))
        await asyncio.sleep(0.01)
        self.inflight -= req.n
        return GenerateResponse(completions=[Completion(token_ids=[5], logprobs=[0.0], versions=[3],
                                                        finish_reason="stop")] * req.n)


def test_an_eval_set_never_holds_more_than_its_share_of_the_inflight_budget(tmp_path):
    """4 samples per example, max_share 0.25: at a budget of 8 (one group, where KV pressure leaves it) not
    even one example fits, so the set waits, asking for a budget of 16; at 32 two examples run at once."""
    from prl.evaluation.sets import build_sets
    from prl.model.tiny import char_tokenizer
    from prl.orchestrator.evals import InRunEvals

    recipe = load_recipe(RECIPE, ["eval.heldout.examples=6", "eval.heldout.samples=4", "eval.heldout.pass_k=[1,4]",
                                  "eval.heldout.temperature=1.0", "eval.heldout.max_share=0.25"])
    [s] = build_sets(recipe.eval, recipe.task, recipe.env, recipe.sampling, 0, char_tokenizer())
    orch = CountingPool(tmp_path / "metrics.jsonl", budget=8)
    evals = InRunEvals(orch, [s], max_steps=3)

    async def budget_grows():
        await asyncio.sleep(0.3)
        assert orch.seen == [] and evals.wanted() == 16, "nothing fits in 0.25 x 8: the set waits for 16"
        async with orch.changed:
            orch.budget = 32
            orch.changed.notify_all()

    async def main():
        await asyncio.gather(evals.run_point(s, 3, 3), budget_grows())

    asyncio.run(main())
    assert all(inflight <= 0.25 * budget for inflight, budget in orch.seen), orch.seen
    assert max(inflight for inflight, _ in orch.seen) == 8, "its share of 32: two examples at once"
    assert evals.wanted() == 0 and [e["examples"] for e in events_of(tmp_path, "eval")] == [6]


def events_of(folder, kind: str) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == kind]


# ---- refusals ----
@pytest.mark.parametrize("overrides, words", [
    (["eval.h.pass_k=[1,4]"], "k = 4 is larger than eval.h.samples"),
    (["eval.h.first_index=100"], "eval.h.first_index (100) overlaps the training indices"),
    (["eval.h.threshold=1.5"], "eval.h.threshold"),
    (["eval.h.samples=4"], "greedy samples are all the same"),
    (["eval.h.pass_k=[0]"], "distinct k >= 1"),
    (['eval."h x".examples=2'], "a set's name takes"),
    (["eval.h.max_tokens=4000"], "longer than model.max_position_embeddings"),
    (["eval.h.at_start=false", "eval.h.every=0", "eval.h.at_end=false"], "no step to score"),
    (["eval.h.samples=40", "eval.h.temperature=1.0"], "exceed its share of the in-flight budget"),
    (['eval.h.task.name="reverse"', 'eval.h.task.reward="prl.tasks.builtin:exact_match"', "eval.h.task.max_len=6",
      "eval.h.first_index=0"], "overlaps the training indices"),  # the training examples, another reward
])
def test_bad_eval_sets_are_refused_naming_the_key(overrides, words):
    from prl.launch.checks import load  # the schema's checks and the launch's (the set's longest sample)

    with pytest.raises(RecipeError) as e:
        load(RECIPE, overrides)
    assert words in str(e.value)


def test_prl_eval_refuses_bad_arguments_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    cases = [
        ([], "give a run directory"),
        ([tmp_path / "nowhere"], "not a prl run directory"),
        (["--model", tmp_path / "nope", "--recipe", RECIPE], "no such folder"),
        (["--model", tmp_path / "empty"], "--model needs --recipe"),
        ([tmp_path / "empty", "--set", "model.num_layers=1"], "--set model.num_layers: a run's checkpoint holds the run's"),
    ]
    for args, words in cases:
        p = subprocess.run(prl_cmd("eval", *args), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and words in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


# ---- prl eval ----
def test_prl_eval_ends_its_scoring_when_a_server_exits(tmp_path):
    """A real server killed while a set is being scored: `score` raises the one-line EvalError, and by then
    the scoring (every example's request) has ended; nothing of it runs on while the servers stop."""
    import httpx

    from prl.launch.driver import prepare_new
    from prl.launch.evaluate import EvalError, score, serving
    from prl.transport import ports

    recipe = load_recipe(RECIPE, [f"run.output_dir={tmp_path}", "eval.heldout.examples=400"])
    work = tmp_path / "reverse-tiny"
    prepare_new(recipe, work, force=True)
    sup, cfg = serving(recipe, work)

    async def kill_while_scoring():
        scoring = asyncio.create_task(score(cfg, sup))
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {cfg.secret()}"}) as http:
            while True:  # until the set's requests are in the engine (the 400 examples take many rounds)
                assert not scoring.done(), scoring.exception()
                url = ports.url_of(cfg.run_dir, "inference-0", cfg.servers[0])
                try:
                    if (await http.get(f"{url}/metrics")).json()["running"] > 0:
                        break
                except httpx.TransportError:  # still starting
                    pass
                await asyncio.sleep(0.02)
        sup.kill(["inference-0"])
        with pytest.raises(EvalError, match="inference-0 exited with code -9"):
            await scoring
        left = [t.get_coro() for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert left == [], left

    sup.start_all()
    try:
        asyncio.run(kill_while_scoring())
    finally:
        sup.stop_all()
        sup.close()


# ---- a run ----
RUN_KEYS = ["rl.max_steps=4", "sft.steps=10", "rl.max_async_level=0",
            "eval.heldout.examples=16", "eval.heldout.every=2", "eval.heldout.pin_version=true",
            "eval.sampled.examples=8", "eval.sampled.samples=3", "eval.sampled.pass_k=[1,3]",
            "eval.sampled.temperature=1.0", "eval.sampled.every=2", "eval.sampled.seed=7"]


def run_with_evals(tmp_path, *extra) -> subprocess.CompletedProcess:
    """reverse-tiny for 4 synchronous steps (max_async_level 0: step s trains examples s*16..s*16+15, whatever
    else runs), scored by a greedy set pinned to its versions and a sampled one that is not."""
    args = ["--set", f"run.output_dir={tmp_path}", *[a for s in RUN_KEYS for a in ("--set", s)], *extra]
    return subprocess.run(prl_cmd("run", RECIPE, "--no-tui", *args), capture_output=True, text=True, timeout=900)


def eval_json(*args) -> dict:
    p = subprocess.run(prl_cmd("eval", *args, "--json"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout)


FIGURES = ("reward", "pass@1", "best@1", "maj@1", "completion_len")


def test_evals_in_a_run_are_logged_once_per_version_and_prl_eval_gives_the_same_figures(tmp_path):
    p = run_with_evals(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    run_dir = tmp_path / "reverse-tiny"
    logged = {(e["set"], e["step"]): e for e in events(run_dir, "eval")}
    assert len(logged) == len(events(run_dir, "eval")) == 6, "each (set, point) once"
    assert sorted(logged) == [(s, p) for s in ("heldout", "sampled") for p in (0, 2, 4)]
    assert all(e["version"] == e["step"] for e in logged.values()), "each starts under the version it scores"
    assert all(logged[("heldout", p)]["later_share"] == 0 for p in (0, 2, 4)), "pinned: every token its version's"
    assert all(0 <= e["later_share"] <= 1 and e["examples"] in (8, 16) for e in logged.values())
    recipe = load_recipe(RECIPE, RUN_KEYS)  # held out: no training prompt (RL's and the warm start's), those replaced
    assert all(logged[("heldout", p)]["verbatim_share"] == 0 for p in (0, 2, 4))
    assert {logged[("heldout", p)]["replaced"] for p in (0, 2, 4)} == {replaced_among(recipe, 16)}
    assert {"pass@3", "best@3", "maj@3"} <= set(logged[("sampled", 2)])
    # never trained on, never moving the data cursor: the ledger is the run's without evals
    ledger = [json.loads(ln) for ln in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert {e["step"]: sorted(e["prompts"]) for e in ledger} == {s: list(range(16 * s, 16 * s + 16)) for s in range(4)}
    kept = {e["step"] for e in events(run_dir, "checkpoint") + events(run_dir, "eval_weights")}
    assert kept >= {0, 2, 4} and 2 not in {e["step"] for e in events(run_dir, "checkpoint")}
    assert_nothing_left(run_dir)
    # the same weights, set and seeds outside the run: the same figures (greedy: exactly; the final
    # version, which nothing replaced under the sampled set: its seeded samples too)
    mid = eval_json(run_dir, "--step", "2", "--only", "heldout")
    assert set(mid["sets"]) == {"heldout"} and mid["step"] == 2
    assert {k: mid["sets"]["heldout"][k] for k in FIGURES} == {k: logged[("heldout", 2)][k] for k in FIGURES}
    end = eval_json(run_dir)
    assert end["step"] == 4
    for name in ("heldout", "sampled"):
        assert {k: end["sets"][name][k] for k in FIGURES} == {k: logged[(name, 4)][k] for k in FIGURES}, name
    assert end["sets"]["sampled"]["pass@3"] == logged[("sampled", 4)]["pass@3"]


def test_a_restarted_orchestrator_logs_each_eval_once(tmp_path):
    """The orchestrator is killed once its first eval is logged: the driver restarts it, it reads the evals
    logged and runs only the rest; the run ends after the final one."""
    args = ["--set", f"run.output_dir={tmp_path}", "--set", "rl.max_steps=6", "--set", "sft.steps=10",
            "--set", "eval.heldout.examples=8", "--set", "eval.heldout.every=2"]
    proc = subprocess.Popen(prl_cmd("run", RECIPE, "--no-tui", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "reverse-tiny"
    try:
        while not ((run_dir / "metrics.jsonl").exists() and events(run_dir, "eval")):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        pid = next(e["pid"] for e in events(run_dir, "process") if e.get("name") == "orchestrator" and e.get("pid"))
        import os

        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert [e["name"] for e in events(run_dir, "restart")] == ["orchestrator"]
    points = [(e["set"], e["step"]) for e in events(run_dir, "eval")]
    assert sorted(points) == [("heldout", p) for p in (0, 2, 4, 6)], points
    assert_nothing_left(run_dir)
