"""On-policy distillation from a teacher the run serves: the per-token advantages against the teacher's own forward
in transformers, a real run with a teacher, and the refusals."""

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, prl_cmd, run_each, start_server
from prl.envs import Trajectory
from prl.orchestrator.teacher import Teacher, distill_advantages
from prl.recipe.load import load_recipe
from prl.recipe.schema import TeacherCfg

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"


def teacher_folder(where: Path, seed: int = 1) -> Path:
    """A Hugging Face folder of prl's tiny model (random init from `seed`), with the student's tokenizer."""
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    folder = write_model_dir(ModelCfg(num_layers=2), where)
    build_model(folder, seed=seed).save_pretrained(folder)
    return folder


def test_distill_advantages_are_the_reverse_kl_beside_the_group_advantage():
    got = distill_advantages([-1.0, -2.0, -0.5, -3.0], [-1.5, -0.5, -9.0, -0.25], [1, 1, 0, 1], 0.4, 0.5, 2.0)
    assert got == pytest.approx([0.5 * 0.5 + 0.8, 0.5 * -1.5 + 0.8, 0.0, 0.5 * -2.75 + 0.8])
    assert distill_advantages([-1.0], [-2.0], None, -1.0, 1.0, 0.0) == [1.0]


def test_the_teachers_advantages_are_its_own_logprobs_in_transformers(tmp_path):
    """A real teacher server (`teacher-0` of a recipe with [teacher]): each model token's advantage is
    kl_coef * (the teacher's logprob in transformers' forward of its folder - the student's) + reward_weight * A,
    environment tokens 0; and the step's k1 estimate is their mean of student - teacher."""
    from prl.backends.embedded import EmbeddedBackend
    from prl.model.build import build_model
    from prl.orchestrator.frozen import FrozenServers

    folder = teacher_folder(tmp_path / "teacher")
    recipe = load_recipe(RECIPE, [f'teacher={{path = "{folder}", kl_coef = 0.5, reward_weight = 2.0}}'])
    proc, cfg, client = start_server(tmp_path / "run", recipe, name="teacher-0")
    trajs = [Trajectory([5, 6, 7], [8, 9, 10, 11], [-1.0, -2.0, -3.0, -0.5], [0] * 4, 1.0, mask=[1, 0, 1, 1]),
             Trajectory([12, 13], [14, 15], [-0.25, -4.0], [0] * 2, 0.0)]
    try:
        async def score():
            backend = EmbeddedBackend(f"http://{cfg.host}:{cfg.port}", cfg.secret())
            try:
                return await Teacher(recipe.teacher, FrozenServers("teacher", [backend], retry_s=30)).token_advantages(
                    trajs, [0.3, -0.7])
            finally:
                await backend.close()

        advantages, (total, count) = asyncio.run(score())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    reference = build_model(folder).eval()
    want, diffs = [], []
    for t, a in zip(trajs, [0.3, -0.7]):
        ids = [*t.prompt_ids, *t.completion_ids]
        with torch.no_grad():
            logp = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        n = len(t.prompt_ids)
        teacher = [logp[n + i - 1, tok].item() for i, tok in enumerate(t.completion_ids)]
        mask = t.mask or [1] * len(teacher)
        want.append([0.5 * (q - s) + 2.0 * a if m else 0.0 for q, s, m in zip(teacher, t.logprobs, mask)])
        diffs += [s - q for q, s, m in zip(teacher, t.logprobs, mask) if m]
    for got, expected in zip(advantages, want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    assert count == 5 and total == pytest.approx(sum(diffs), abs=1e-4)


def test_a_run_distils_from_a_teacher_it_serves(tmp_path):
    """`prl run` with [teacher] on a multi-turn environment (tool calls, the tools' answers in the completion): the
    teacher's server starts beside the run's, every step logs `teacher_kl` over the model's tokens, and the run ends
    well with no restart."""
    folder = teacher_folder(tmp_path / "teacher")
    sets = [f"run.output_dir={tmp_path}", "sft.steps=60", "rl.max_steps=3", "rl.credit='trajectory'",
            f'teacher.path="{folder}"']
    p = subprocess.run(prl_cmd("run", ROOT / "recipes" / "tool-tiny.toml", "--no-tui",
                               *(x for s in sets for x in ("--set", s))), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "teacher-0: started" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "tool-tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "orch_step"]
    assert len(steps) == 3 and all(e["teacher_kl"] > 0 for e in steps), steps  # two different models: KL above 0
    assert all(e["env_tokens"] > 0 for e in steps)  # the tools answered: tokens the teacher gives no advantage
    assert not [e for e in events if e["kind"] in ("error", "restart")]


def test_a_run_adds_the_kl_to_the_teacher_to_its_loss(tmp_path):
    """teacher.mode = "loss": the samples carry the teacher's logprobs and the trainer logs `kl_teacher`, its KL to
    the teacher over the loss tokens (k3: above 0 for two different models); the run ends well with no restart."""
    folder = teacher_folder(tmp_path / "teacher")
    sets = [f"run.output_dir={tmp_path}", "sft.steps=0", "rl.max_steps=3", "eval.heldout.examples=8",
            f'teacher={{path = "{folder}", mode = "loss", kl_coef = 0.5}}']
    p = subprocess.run(prl_cmd("run", RECIPE, "--no-tui", *(x for s in sets for x in ("--set", s))),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "reverse-tiny" / "metrics.jsonl").read_text().splitlines()]
    trained = [e for e in events if e["kind"] == "trainer_step" and e.get("stage") == "rl"]
    assert len(trained) == 3 and all(e["kl_teacher"] > 0 for e in trained), trained
    assert all(e["teacher_kl"] > 0 for e in events if e["kind"] == "orch_step")
    assert not [e for e in events if e["kind"] in ("error", "restart")]


def test_a_teacher_that_cannot_serve_the_student_is_refused_before_anything_starts(tmp_path):
    from prl.model.tiny import char_tokenizer

    other = teacher_folder(tmp_path / "other")
    folder = teacher_folder(tmp_path / "teacher")
    tok = char_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    cases = {f'teacher.path="{tmp_path}/nowhere"': "teacher.path:",
             f'teacher.path="{other}"': "has another vocabulary",
             f'teacher={{path = "{other}", kl_coef = 0.0}}': "teacher.kl_coef and teacher.reward_weight are both 0",
             (f'teacher.path="{folder}"', "inference.fp8=true", "trainer.fp8=true"):
                 "a teacher served with inference.fp8 is not built",
             (f'teacher={{path = "{folder}", mode = "loss"}}', "trainer.loss.kl_coef=0.1"): "the loss holds one KL",
             (f'teacher.path="{folder}"', "rl.filter_groups='uniform'"): "still carry the teacher's signal"}
    sets = [override if isinstance(override, tuple) else (override,) for override in cases]
    done = run_each([prl_cmd("run", RECIPE, "--dry-run", *(x for s in one for x in ("--set", s))) for one in sets])
    for (override, words), p in zip(cases.items(), done):
        out = p.stdout + p.stderr
        assert p.returncode == 2 and words in out and "Traceback" not in out, (override, out[-2000:])
    assert TeacherCfg(path="x").kl_coef == 1.0
