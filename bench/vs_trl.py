"""prl against TRL's GRPOTrainer on the same model, task, reward and batch, one after the other.

Both sides start from the same weights: reverse-tiny's GLM-5 model after prl's SFT warm start (a
`prl run` of the recipe's 60 SFT steps, exported with `prl ckpt export` as a Hugging Face folder;
`--warm DIR` reuses one). Then, each for `--wall` seconds of RL on the same cores:

- prl: the real `prl run recipes/reverse-tiny.toml` (inference server, orchestrator, torchrun
  trainer, asynchronous as the recipe sets it) with `model.path` = that folder, `sft.steps = 0`, a
  constant learning rate, no checkpoints and no held-out eval inside the window (TRL's side runs none;
  `bench/eval_overhead.py` measures what one costs); stopped with SIGTERM once `--wall` seconds have passed
  since the orchestrator received weights version 0.
- TRL: `GRPOTrainer` (synchronous, `model.generate`) on the same prompts in the same order, prl's
  reward function (`prl.tasks.builtin.edit_similarity`, loaded from its file), 16 prompts x 8
  completions per step, 12 completion tokens, temperature 1, learning rate 1e-3 constant, grad
  clip 1, `beta = 0` (no reference model), advantages centred on the group mean without dividing by
  the std (`scale_rewards = "none"`, as prl's `rl.advantage = "mean"`), the loss summed over
  completion tokens and divided by the step's tokens (`loss_type = "dapo"`, as prl), no gradient
  checkpointing (TRL's default turns it on; off is faster here), stopped after `--wall` seconds
  from the start of training.

Per side: samples trained per second over the window, the mean reward of the last 10 steps' batches
before the deadline (`reward_at_wall`; the curve is noisy, so compare it over repeated runs), of the
window's last third (`reward_late`, steadier), of the first step (`reward_start`) and of the 10 steps up to the
number both sides reached (`reward_at_equal_samples`: per sample, each step being 16 x 8 samples on both sides),
start-up seconds (not in the window), and the seconds each side took to reach a reward both hold late in the
window (`seconds_to_target`: the first time 5 batches in a row averaged `TARGET` = 0.95 of the lower side's
`reward_late`; on this task both sides level off at about the same reward well inside 90 s, so the reward at the
wall compares plateaus and the time to reach one compares speed). `--seed S` makes the warm start from
`run.seed = S` (the RL prompts stay seed 0's, TRL's order): repeat over seeds to compare over warm starts. TRL
runs with `--trl-threads` torch threads (default 2: the cores prl's server and trainer use, one thread each;
TRL is faster with 2 than with 1 on an idle machine, but far slower than with 1 when other work shares the
cores: run it on an idle machine; `load_avg_1m` in the JSON line is the load when it ended). Each side's reward
curve is written to `curves.json` in the bench's folder.
For prl, also its trainer's ceiling: after the runs, `bench/trainer_step.py` times the trainer's
forward, backward and optimizer alone (one rank, the run's trainer settings, nothing else on the cores)
on a batch the run trained mid-window; `prl_over_trainer_ceiling` is the run's samples/s over that
(1: the run trains as fast as its trainer alone could). `prl_trainer_step_gap_s` is the mean time
between two trainer steps of the run, `prl_trainer_mean_wait_s`, `_fwd_bwd_s` and `_publish_s` its parts
(`_publish_wait_s`: of the publish, the wait for the version before it to finish in the background), and
`prl_wait_share_of_step_gap`, `prl_publish_share_of_step_gap` their shares.
The last line is one JSON object; ratios are named `<a>_over_<b>`.

TRL is not a dependency of prl and is not installed into `.venv` (it would add accelerate,
datasets, pandas and pyarrow to the environment every test and run uses). It runs in a venv of its
own, as a subprocess of this bench:

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 transformers==5.19.0 trl==1.16.0
    .venv/bin/python bench/vs_trl.py [--wall 90] [--trl-python .venv-trl/bin/python] [--trl-threads 2] [--compiled] [--sync]

`--sync` runs prl a second time synchronously (`rl.max_async_level = 0`: every step's rollouts
sampled by the weights it trains, as TRL's). `--compiled` runs prl a second time with `inference.compile = true` (the embedded engine's forwards
through torch.compile). On reverse-tiny's GLM-5 model the server then recompiles shapes its warm-up
did not meet for a minute or more inside the window: not the default.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/reverse-tiny.toml"
PROMPTS_PER_STEP, GROUP, MAX_TOKENS, LR, LAST = 16, 8, 12, 1e-3, 10
TARGET = 0.95  # the reward both sides are timed to: this share of the lower of their late rewards


def prl_cmd(out: Path, name: str, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "prl", "run", str(RECIPE), "--no-tui", "--force",
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def warm_start(out: Path, seed: int = 0) -> Path:
    """The recipe's SFT warm start through prl (from the model and demonstrations of `run.seed` = `seed`), as a
    Hugging Face folder both sides load."""
    cmd = prl_cmd(out, "warm", "rl.max_steps=1", "trainer.checkpoint_every=0", f"run.seed={seed}")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"warm start failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    hf = out / "warm_hf"
    p = subprocess.run([sys.executable, "-m", "prl", "ckpt", "export", str(out / "warm"), "--step", "0",
                        "--out", str(hf)], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"export failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return hf


def run_prl(out: Path, warm: Path, wall: float, name: str = "prl", sets: tuple[str, ...] = ()) -> dict:
    """`prl run` from the warm weights for `wall` seconds after weights version 0 reached the orchestrator."""
    cmd = prl_cmd(out, name, f"model.path={warm}", "sft.steps=0", "rl.max_steps=100000",
                  "trainer.schedule=constant", f"trainer.lr={LR}", "trainer.checkpoint_every=0",
                  "eval.heldout.every=0", "eval.heldout.at_start=false", *sets)
    run_dir = out / name
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = None
    while proc.poll() is None:
        time.sleep(1)
        evs = read_events(run_dir)
        if t0 is None:
            t0 = next((e["t"] for e in evs if e["kind"] == "weights" and e.get("version") == 0), None)
        elif time.time() > t0 + wall + 1:
            proc.send_signal(signal.SIGTERM)  # the driver stops every process of the run
            break
        elif time.time() > t0 + wall / 2 and not (out / f"{name}_batch.pt").exists():
            keep_batch(run_dir, out / f"{name}_batch.pt")
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if t0 is None:
        raise SystemExit(f"prl run never started RL:\n{proc.stdout.read()[-3000:]}")
    return prl_figures(read_events(run_dir), t0, wall, t0 - start)


def keep_batch(run_dir: Path, dest: Path) -> None:
    """A copy of the latest batch the trainer received (mid-window: a batch of the run's trained policy)."""
    batches = sorted((run_dir / "rollouts").glob("step_*.pt"))
    if batches:
        shutil.copyfile(batches[-1], dest)


def trainer_ceiling(out: Path, warm: Path, name: str, steps: int = 20) -> dict:
    """The run's trainer alone on a batch it trained (`bench/trainer_step.py`: forward, backward and
    optimizer on one rank with the run's trainer settings, nothing else on the cores): samples/s."""
    batch = out / f"{name}_batch.pt"
    if not batch.exists():
        raise SystemExit(f"{name}: no batch kept for the trainer's ceiling")
    p = subprocess.run([sys.executable, str(ROOT / "bench/trainer_step.py"), "--batch", str(batch), "--model", str(warm),
                        "--recipe", str(out / name / "recipe.json"), "--steps", str(steps)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"trainer ceiling failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"trainer_ceiling_samples_per_s": r["lean_samples_per_s"], "trainer_ceiling_step_s": r["lean_step_s"]}


def prl_figures(evs: list[dict], t0: float, wall: float, startup: float) -> dict:
    steps = [e for e in evs if e["kind"] == "trainer_step" and e.get("stage") == "rl" and e["t"] <= t0 + wall]
    orch = [e for e in evs if e["kind"] == "orch_step" and e["t"] <= t0 + wall]
    if not steps or not orch:
        raise SystemExit("prl: no RL step within the window")
    return {
        "steps": len(steps),
        "samples_per_s": len(steps) * PROMPTS_PER_STEP * GROUP / wall,
        "reward_start": orch[0]["reward"],
        "reward_at_wall": statistics.mean(e["reward"] for e in orch[-LAST:]),
        "startup_s": startup,
        "trainer_fwd_bwd_s": statistics.median(e["fwd_bwd_s"] for e in steps),
        "trainer_wait_s": statistics.median(e["wait_s"] for e in steps),
        "trainer_publish_s": statistics.median(e["publish_s"] for e in steps),
        # the step's parts as means over the window: they add up to the mean time between two steps
        "trainer_step_gap_s": (steps[-1]["t"] - steps[0]["t"]) / max(len(steps) - 1, 1),
        **{f"trainer_mean_{k}": statistics.mean(e.get(k, 0.0) for e in steps[1:] or steps)
           for k in ("wait_s", "fwd_bwd_s", "publish_s", "publish_wait_s")},
        "curve": [(round(e["t"] - t0, 2), e["reward"]) for e in orch],
        "step_rewards": [e["reward"] for e in orch],
    }


def run_trl(out: Path, warm: Path, args) -> dict:
    result = out / "trl.json"
    spec = {"warm": str(warm), "wall": args.wall, "out": str(out / "trl"), "result": str(result),
            "threads": args.trl_threads}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.trl_threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    p = subprocess.run([args.trl_python, __file__, "--trl-worker", json.dumps(spec)], capture_output=True,
                       text=True, env=env)
    if p.returncode or not result.exists():
        raise SystemExit(f"TRL side failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return json.loads(result.read_text())


def trl_worker(spec: dict) -> None:
    """Runs under the TRL interpreter: GRPOTrainer for `wall` seconds of training."""
    import importlib.util

    start = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    mod_spec = importlib.util.spec_from_file_location("builtin", ROOT / "prl/tasks/builtin.py")
    builtin = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(builtin)
    # prl's RL prompts: task seed = run.seed (0), index = data position, in order
    rows = [builtin.reverse_dataset(i, 0, 3, 6) for i in range(PROMPTS_PER_STEP * 4000)]
    data = Dataset.from_list(rows)

    def reward(completions, answer, **_):
        return [builtin.edit_similarity(c, {"answer": a}) for c, a in zip(completions, answer)]

    log: dict = {"steps": [], "rewards": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            log["t0"] = time.time()

        def on_step_end(self, args, state, control, **k):
            log["steps"].append(time.time())
            control.should_training_stop = time.time() - log["t0"] >= spec["wall"]

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                log["rewards"].append((time.time(), logs["reward"]))

    cfg = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, seed=0, report_to=[], save_strategy="no", logging_steps=1,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP, max_completion_length=MAX_TOKENS,
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0,
        weight_decay=0.0, beta=0.0, scale_rewards="none", loss_type="dapo", gradient_checkpointing=False,
        shuffle_dataset=False, max_steps=100000, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["warm"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["warm"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    Path(spec["result"]).write_text(json.dumps(trl_figures(log, spec["wall"], log["t0"] - start)))


def trl_figures(log: dict, wall: float, startup: float) -> dict:
    t0 = log["t0"]
    ends = [t for t in log["steps"] if t <= t0 + wall]
    rewards = [r for t, r in log["rewards"] if t <= t0 + wall]
    gaps = [b - a for a, b in zip([t0] + ends, ends)]
    return {
        "steps": len(ends),
        "samples_per_s": len(ends) * PROMPTS_PER_STEP * GROUP / wall,
        "reward_start": rewards[0],
        "reward_at_wall": statistics.mean(rewards[-LAST:]),
        "startup_s": startup,
        "step_s": statistics.median(gaps),
        "curve": [(round(t - t0, 2), r) for t, r in log["rewards"] if t <= t0 + wall],
        "step_rewards": rewards,
    }


def seconds_to(curve: list, target: float, k: int = 5) -> float | None:
    """Seconds from the start of training until the mean reward of `k` batches in a row first reached `target`
    (None: never inside the window)."""
    for i in range(k, len(curve) + 1):
        if statistics.mean(r for _, r in curve[i - k:i]) >= target:
            return curve[i - 1][0]
    return None


def late_reward(curve: list, wall: float) -> float:
    """The mean batch reward of the window's last third: less noisy than the last 10 steps (under 2 s
    of either side's training here), the same span for both sides."""
    return statistics.mean(r for t, r in curve if t >= wall * 2 / 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wall", type=float, default=90.0, help="seconds of RL per side")
    ap.add_argument("--warm", type=Path, default=None, help="a warm-start HF folder (default: made by prl's SFT)")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--trl-threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also prl with inference.compile = true")
    ap.add_argument("--sync", action="store_true", help="also prl synchronous (rl.max_async_level = 0)")
    ap.add_argument("--prl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe setting for prl's runs (repeatable), e.g. rl.max_inflight_rollouts=256")
    ap.add_argument("--seed", type=int, default=0, help="the warm start's run.seed (the RL prompts stay run.seed 0's)")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    if not Path(args.trl_python).exists():
        raise SystemExit(f"{args.trl_python} missing: make the TRL venv first (see this file's docstring)")
    began = time.time()
    out = Path(tempfile.mkdtemp(prefix="prl-vs-trl-"))
    warm = args.warm or warm_start(out, args.seed)
    own = tuple(args.prl_set)
    sides = {"prl": run_prl(out, warm, args.wall, sets=own)}
    if args.compiled:  # the embedded engine's forwards compiled (the warm-up before version 0 is not in the window)
        sides["prl_compiled"] = run_prl(out, warm, args.wall, "prl_compiled", ("inference.compile=true", *own))
    if args.sync:
        sides["prl_sync"] = run_prl(out, warm, args.wall, "prl_sync", ("rl.max_async_level=0", *own))
    for name in list(sides):  # the trainer alone on one of the run's batches, after the runs: nothing else on the cores
        sides[name].update(trainer_ceiling(out, warm, name))
    sides["trl"] = trl = run_trl(out, warm, args)
    for r in sides.values():
        r["reward_late"] = late_reward(r["curve"], args.wall)
    # a reward every side holds late in the window: TARGET of the lowest side's late reward
    target = TARGET * min(r["reward_late"] for r in sides.values())
    for r in sides.values():
        r["seconds_to_target"] = seconds_to(r["curve"], target)
    (out / "curves.json").write_text(json.dumps({n: r.pop("curve") for n, r in sides.items()}))
    # per sample: every step trains 16 x 8 samples on both sides, so equal steps are equal samples
    equal = min(len(r["step_rewards"]) for r in sides.values())
    for r in sides.values():
        r["reward_at_equal_samples"] = statistics.mean(r.pop("step_rewards")[max(0, equal - LAST):equal])
        r["equal_samples"] = equal * PROMPTS_PER_STEP * GROUP
    for name, r in sides.items():
        print(f"{name}: {r['steps']} steps in {args.wall:.0f} s, {r['samples_per_s']:.1f} samples/s, reward "
              f"{r['reward_start']:.3f} -> {r['reward_at_wall']:.3f} (start-up {r['startup_s']:.0f} s)")
    report = {"wall_s": args.wall, "trl_threads": args.trl_threads, "load_avg_1m": round(os.getloadavg()[0], 2),
              "target_reward": round(target, 4),
              **{f"{n}_{k}": None if v is None else round(v, 4) for n, r in sides.items() for k, v in r.items()}}
    for name, r in sides.items():
        if name != "trl":
            report.update({
                f"samples_per_s_{name}_over_trl": round(r["samples_per_s"] / trl["samples_per_s"], 3),
                f"{name}_over_trainer_ceiling": round(r["samples_per_s"] / r["trainer_ceiling_samples_per_s"], 3),
                f"reward_at_wall_{name}_over_trl": round(r["reward_at_wall"] / trl["reward_at_wall"], 3),
                f"reward_late_{name}_over_trl": round(r["reward_late"] / trl["reward_late"], 3),
                f"reward_at_equal_samples_{name}_over_trl": round(r["reward_at_equal_samples"]
                                                                  / trl["reward_at_equal_samples"], 3),
                f"seconds_to_target_trl_over_{name}": None if None in (r["seconds_to_target"], trl["seconds_to_target"])
                else round(trl["seconds_to_target"] / r["seconds_to_target"], 3),
                f"{name}_wait_share_of_step_gap": round(r["trainer_mean_wait_s"] / r["trainer_step_gap_s"], 3),
                f"{name}_publish_share_of_step_gap": round(r["trainer_mean_publish_s"] / r["trainer_step_gap_s"], 3),
                f"reward_gain_{name}_over_trl": round((r["reward_at_wall"] - r["reward_start"])
                                                      / max(trl["reward_at_wall"] - trl["reward_start"], 1e-9), 3)})
    report["bench_s"] = round(time.time() - began, 1)
    print(f"runs and reward curves (seconds from the start of training, batch reward) in {out}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
