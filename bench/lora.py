"""LoRA RL against full fine-tuning, side by side in one invocation: what a step costs and what RL learns.

    .venv/bin/python bench/lora.py [--rl-seconds 90] [--cost-seconds 45] [--lrs 3e-3,1e-2,3e-2] [--seeds 1]
        [--targets G1,G2,..] [--rank R] [--alpha A] [--skip-learning] [--skip-cost] [--skip-serving] [--keep DIR]

Learning: recipes/reverse-tiny.toml (full fine-tuning, its trainer.lr 1e-3) and recipes/reverse-tiny-lora.toml
(rank 8, alpha 32) at each learning rate of `--lrs` (LoRA wants about 10x full fine-tuning's), every run given
the same `--rl-seconds` of RL from its first RL step (bench/objectives.py's window: warm start and start-up
outside it), then stopped cleanly. Figures per run: RL steps, the orchestrator's reward gain (mean of the last 5
`orch_step`s minus the first 5: sampled at the recipe's temperature 1) and the held-out set's greedy reward
gain (its last point in the window minus step 0's); `lora_gain_over_full` is the best LoRA learning rate's
reward gain over full fine-tuning's (the goal: at least 0.9), `lora_heldout_gain_over_full` its held-out gain's.

Cost: the same larger model (hidden 512, 4 layers, 16 experts of 512: about 30 M parameters, so weights and
optimizer state are more than torch's own memory) with and without LoRA rank 8, no warm start (so the LoRA
trainer never holds a full optimizer), weights over the collective path, `--cost-seconds` of RL each. Per run:
bytes a version sends (`weights_sent`), the trainer's publish_s (the update, sender side), fwd_bwd_s (median),
and the trainer rank's peak RSS (`trainer_step.peak_rss_mb`, the process's high-water mark). The JSON line's
`lora_over_full_<figure>` are LoRA's over full's for bytes, update_s, step_s and peak_mem.

Serving (in this process, no servers): how the embedded engine takes an adapter. Unmerged, every target runs
its base GEMM plus two thin ones on every forward; merged on load, an update costs one `W + B' @ A` per target
(`prl.model.policy.Version.merge`, the base's targets cached) and forwards cost the base's. On reverse-tiny's
model and the larger one: the forward of a 64 x 16 batch, base (= merged) and unmerged (median of 20), and one
merge; `unmerged_over_merged_forward` and `merge_over_forward` per model.

Ends with one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from objectives import one  # noqa: E402  (the windowed `prl run`)
from weight_transfer import best  # noqa: E402  (median of timed calls)

from prl.metrics import read_events  # noqa: E402

FULL = ROOT / "recipes" / "reverse-tiny.toml"
LORA = ROOT / "recipes" / "reverse-tiny-lora.toml"
BIG = ["model.hidden_size=512", "model.num_layers=4", "model.num_experts=16", "model.expert_dim=512",
       "model.dense_dim=1024", "sft.steps=0", 'trainer.weight_transfer="collective"', "eval.heldout.every=0",
       "eval.heldout.at_start=false"]


def learning(args, out: Path) -> dict:
    runs = {}
    for seed in range(args.seeds):
        lora_sets = [f"trainer.lora.targets={json.dumps(args.targets)}"] if args.targets else []
        lora_sets += [f"trainer.lora.{k}={getattr(args, k)}" for k in ("rank", "alpha") if getattr(args, k)]
        variants = [("full", FULL, [])] + [(f"lora_lr{lr}", LORA, [f"trainer.lr={lr}", *lora_sets]) for lr in args.lrs]
        for name, recipe, sets in variants:
            fig = one(recipe, f"{name}_s{seed}", [*sets, f"run.seed={seed}"], args.rl_seconds, out)
            print(json.dumps({"run": f"{name}_s{seed}", **{k: fig.get(k) for k in (
                "rl_steps", "reward_first5", "reward_last5", "reward_gain", "heldout_reward_step0", "heldout_reward",
                "errors", "restarts")}}),
                file=sys.stderr, flush=True)
            runs.setdefault(name, []).append(fig)
    gains, held = mean_of(runs, reward_gain), mean_of(runs, heldout_gain)
    best = max((n for n in gains if n != "full"), key=gains.get)
    head = {f"{n}_reward_gain": round(g, 4) for n, g in gains.items()}
    head.update({f"{n}_heldout_gain": round(g, 4) for n, g in held.items()})
    out = {**head, "best_lora": best, "lora_gain_over_full": round(gains[best] / gains["full"], 3)}
    if held.get(best) is not None and held.get("full"):
        out["lora_heldout_gain_over_full"] = round(held[best] / held["full"], 3)
    return out


def reward_gain(fig: dict) -> float | None:
    return fig.get("reward_gain")


def heldout_gain(fig: dict) -> float | None:
    """The held-out set's greedy reward at the window's last eval point over step 0's."""
    if fig.get("heldout_reward") is None or fig.get("heldout_reward_step0") is None:
        return None
    return fig["heldout_reward"] - fig["heldout_reward_step0"]


def mean_of(runs: dict[str, list[dict]], figure) -> dict[str, float]:
    out = {}
    for name, figs in runs.items():
        xs = [x for x in map(figure, figs) if x is not None]
        if xs:
            out[name] = statistics.mean(xs)
    return out


def cost_of(name: str, recipe: Path, seconds: float, out: Path) -> dict:
    fig = one(recipe, name, BIG, seconds, out)
    evs, _ = read_events(out / name / "metrics.jsonl")
    steps = [e for e in evs if e["kind"] == "trainer_step" and e.get("stage") == "rl"][1:]
    sent = [e for e in evs if e["kind"] == "weights_sent" and e.get("version", 0) > 0 and not e.get("error")]
    got = {"bytes": statistics.median(e["bytes"] for e in sent) if sent else None,
           "update_s": statistics.median(e["publish_s"] for e in steps) if steps else None,
           "step_s": statistics.median(e["fwd_bwd_s"] for e in steps) if steps else None,
           "peak_mem": max((e.get("peak_rss_mb") or 0 for e in steps), default=None),
           "errors": fig.get("errors"), "restarts": fig.get("restarts")}
    print(json.dumps({"run": name, **got}), file=sys.stderr, flush=True)
    return got


def cost(args, out: Path) -> dict:
    full = cost_of("cost_full", FULL, args.cost_seconds, out)
    lora = cost_of("cost_lora", LORA, args.cost_seconds, out)
    res = {f"full_{k}": v for k, v in full.items() if k not in ("errors", "restarts")}
    res.update({f"lora_{k}": v for k, v in lora.items() if k not in ("errors", "restarts")})
    for k in ("bytes", "update_s", "step_s", "peak_mem"):
        if full.get(k) and lora.get(k):
            res[f"lora_over_full_{k}"] = round(lora[k] / full[k], 4)
    return res


def timed(fn, reps: int = 20) -> float:
    """The median of `reps` calls after one warm-up call."""
    fn()
    return best(fn, reps)


def serving_of(name: str, cfg: dict, tmp: Path) -> dict:
    """Forward with the adapters unmerged vs merged into the weights, and one merge, on one model."""
    import copy

    import torch

    from prl.model.build import build_model
    from prl.model.lora import AdapterBase, adapter_params, apply_lora, wire_state
    from prl.model.policy import Version
    from prl.model.tiny import write_model_dir
    from prl.model.weights import write_weights
    from prl.recipe.schema import ModelCfg

    torch.set_num_threads(1)
    base = build_model(write_model_dir(ModelCfg(**cfg), tmp / name), seed=0).eval()
    lora = copy.deepcopy(base)
    apply_lora(lora, "glm_moe_dsa", 8, 32.0, 0.0, ["attention", "mlp", "shared_experts"])
    adapter = wire_state({k: v.detach() for k, v in adapter_params(lora).items()}, 4.0)
    write_weights(tmp / name / "v0", base.state_dict(), {"version": 0})
    source, form = AdapterBase(lambda v: tmp / name / f"v{v}"), Version.of({"adapter": {"base": 0}})
    form.merge(adapter, source)  # the base's targets read once, as a server does on its first adapter
    ids = torch.randint(3, 20, (64, 16))
    with torch.no_grad():
        merged_s, unmerged_s = timed(lambda: base(ids)), timed(lambda: lora(ids))
    merge_s = timed(lambda: form.merge(adapter, source), reps=5)
    return {f"{name}_merged_forward_s": round(merged_s, 5), f"{name}_unmerged_forward_s": round(unmerged_s, 5),
            f"{name}_merge_s": round(merge_s, 5), f"{name}_unmerged_over_merged_forward": round(unmerged_s / merged_s, 3),
            f"{name}_merge_over_forward": round(merge_s / merged_s, 3)}


def serving(out: Path) -> dict:
    tiny = {"hidden_size": 128, "expert_dim": 128, "dense_dim": 256, "num_layers": 3, "head_dim": 32}
    big = {"hidden_size": 512, "expert_dim": 512, "dense_dim": 1024, "num_layers": 4, "head_dim": 32, "num_experts": 16}
    res = {**serving_of("tiny", tiny, out), **serving_of("big", big, out)}
    print(json.dumps({"run": "serving", **res}), file=sys.stderr, flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rl-seconds", type=float, default=90.0)
    p.add_argument("--cost-seconds", type=float, default=45.0)
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[3e-3, 1e-2, 3e-2])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--targets", type=lambda s: s.split(","), default=None,
                   help="trainer.lora.targets of the LoRA runs, comma-separated (default: the recipe's)")
    p.add_argument("--rank", type=int, default=None, help="trainer.lora.rank of the LoRA runs (default: the recipe's)")
    p.add_argument("--alpha", type=float, default=None, help="trainer.lora.alpha of the LoRA runs")
    p.add_argument("--skip-learning", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--keep", type=Path, default=None)
    args = p.parse_args()
    out = args.keep or Path(tempfile.mkdtemp(prefix="prl-bench-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    res = {} if args.skip_serving else serving(out)
    if not args.skip_cost:
        res.update(cost(args, out))
    if not args.skip_learning:
        res.update(learning(args, out))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
