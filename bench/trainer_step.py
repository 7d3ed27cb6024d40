"""The trainer's step alone: forward, backward and optimizer on one RL batch, on one rank.

What a `prl run` step costs with nothing else on the cores: the ceiling of the run's samples/s (the
trainer cannot train faster than this), and the profile of where a step's time goes. The model and
trainer settings are reverse-tiny's (its GLM-5 model, one rank, one thread, fp32, shared prompts);
the batch is one the run trained (`--batch RUN_DIR/rollouts/step_000007.pt`, `--model` its folder,
`--recipe RUN_DIR/recipe.json` its trainer settings) or,
without one, 16 reverse prompts x 8 completions of 4 to 12 tokens with random routes (`--r3`).

    .venv/bin/python bench/trainer_step.py [--steps 20] [--compare] [--profile] [--batch PT --model DIR] [--r3]

`--compare` times the trainer's forward through the model's modules (`trainer.lean_forward`, the
default) against `model(...)` on the same batch, alternating; `--profile` prints torch.profiler's
table of a few steps. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from prl.recipe.load import load_recipe
from prl.recipe.schema import Recipe, TrainerCfg
from prl.trainer.model_setup import setup_model
from prl.trainer.step import forward_backward
from prl.transport.batch import Sample, TrainBatch, pack
from prl.transport.trees import segment_starts

ROOT = Path(__file__).resolve().parents[1]


def reverse_batch(model_dir: Path, r3: bool, layers: int, experts: int, k: int) -> list:
    """One reverse-tiny RL step's samples: 16 prompts x 8 completions, packed as the orchestrator does."""
    from prl.model.build import load_tokenizer
    from prl.tasks.builtin import reverse_dataset

    tok, rng = load_tokenizer(model_dir), random.Random(0)
    samples = []
    for i in range(16):
        prompt = tok(reverse_dataset(i, 0, 3, 6)["prompt"])["input_ids"]
        for _ in range(8):
            completion = [rng.randrange(4, 12) for _ in range(rng.randint(4, 12))]
            n = len(prompt) + len(completion) - 1
            routing = torch.stack([torch.randperm(experts)[:k] for _ in range(n * layers)]).view(n, layers, k) if r3 else None
            samples.append(Sample(prompt, completion, [-1.0] * len(completion), [0] * len(completion),
                                  rng.uniform(-1, 1), routing=None if routing is None else routing.to(torch.uint8)))
    return pack(samples, 1, 4096, share_prompts=True)[0]


def trainer(model_dir: Path, lean: bool, r3: bool, base: TrainerCfg | None = None):
    """The trainer's model, its replay and its optimizer, as a one-rank trainer of `base`'s settings holds them."""
    tcfg = (base or TrainerCfg()).model_copy(update={"lean_forward": lean, "router_replay": r3 or bool(base and base.router_replay)})
    dims = tcfg.parallel.dims(1)
    dims.build_meshes("cpu")
    built = setup_model(model_dir, tcfg, dims, torch.device("cpu"))
    model = built.par.model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    return tcfg, built, opt


def step(tcfg, built, opt, mbs) -> float:
    t0 = time.perf_counter()
    forward_backward(built.par.model, built.replay, mbs, "rl", tcfg, 1.0, torch.device("cpu"))
    built.par.finish_grads()
    built.par.clip_grad_norm(tcfg.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side (after 3 warm-up steps)")
    ap.add_argument("--batch", type=Path, default=None, help="a batch a run trained (RUN_DIR/rollouts/step_*.pt)")
    ap.add_argument("--model", type=Path, default=None, help="the model folder (default: reverse-tiny's tiny model)")
    ap.add_argument("--r3", action="store_true", help="routing replay on (random routes for a made batch)")
    ap.add_argument("--compare", action="store_true", help="also time model(...) instead of the lean forward")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of 5 lean steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recipe", type=Path, default=None, help="the trainer settings of a run (RUN_DIR/recipe.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = dist.FileStore(tempfile.mktemp(prefix="prl-trainer-step-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model_dir = args.model
    if model_dir is None:
        from prl.model.tiny import write_model_dir

        model_dir = write_model_dir(load_recipe(ROOT / "recipes/reverse-tiny.toml").model, Path(tempfile.mkdtemp()))
    base = Recipe.model_validate_json(args.recipe.read_text()).trainer if args.recipe else None
    sides = {"lean": trainer(model_dir, (base or TrainerCfg()).lean_forward, args.r3, base)}
    if args.compare:
        sides["model"] = trainer(model_dir, False, args.r3, base)
    cfg = sides["lean"][1].par.model.config
    if args.batch:
        batch = TrainBatch.from_dict(torch.load(args.batch, weights_only=True))
        mbs = batch.micro_batches[0]
    else:
        n_layers = len(sides["lean"][1].replay.routers) if sides["lean"][1].replay else 0
        mbs = reverse_batch(model_dir, args.r3, n_layers, cfg.n_routed_experts if hasattr(cfg, "n_routed_experts")
                            else cfg.num_experts, cfg.num_experts_per_tok)
    samples = int(sum(segment_starts(mb.position_ids).sum() for mb in mbs))  # a tree's members: one segment each
    times: dict[str, list[float]] = {n: [] for n in sides}
    for i in range(3 + args.steps):
        for name, side in sides.items():  # alternating: both sides see the same load
            t = step(*side, mbs)
            if i >= 3:
                times[name].append(t)
    if args.profile:
        profile(sides["lean"], mbs)
    report = {"threads": args.threads, "samples": samples, "tokens": sum(mb.input_ids.numel() for mb in mbs),
              **{f"{n}_step_s": round(statistics.median(t), 5) for n, t in times.items()},
              **{f"{n}_samples_per_s": round(samples / statistics.median(t), 1) for n, t in times.items()},
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    if args.compare:
        report["step_model_over_lean"] = round(statistics.median(times["model"]) / statistics.median(times["lean"]), 3)
    print(json.dumps(report))


def profile(side, mbs) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step(*side, mbs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
