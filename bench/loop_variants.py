"""reverse-tiny's RL loop under recipe variants, side by side: vs_trl's prl side (the same warm start, constant
learning rate, no checkpoints or eval in the window) for each variant in turn, `--pairs` rounds alternating, each
`--wall` seconds of RL after weights version 0.

    .venv/bin/python bench/loop_variants.py --variant stream=trainer.weight_transfer="stream" \
        --variant collective=trainer.weight_transfer="collective" [--wall 40] [--pairs 2] [--seed 0]

A variant is NAME=KEY=VALUE[,KEY=VALUE...]; `base` (the recipe as shipped) always runs first in each round. Per
variant, the means over its runs: samples trained per second, the trainer's step gap and its parts (waiting for a
batch, forward and backward, publishing), the wait's share of the gap, the batch reward of the last 10 steps.
The last line is one JSON object: those means per variant and `samples_per_s_<variant>_over_base`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import run_prl, warm_start  # noqa: E402

FIGURES = ("samples_per_s", "trainer_step_gap_s", "trainer_mean_wait_s", "trainer_mean_fwd_bwd_s",
           "trainer_mean_publish_s", "reward_at_wall")


def variant(text: str) -> tuple[str, tuple[str, ...]]:
    name, _, sets = text.partition("=")
    if not name or not sets or "=" not in sets:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, tuple(sets.split(","))


def figures(result: dict) -> dict:
    row = {k: result[k] for k in FIGURES}
    row["wait_share_of_step_gap"] = result["trainer_mean_wait_s"] / result["trainer_step_gap_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", type=variant, action="append", default=[], help="NAME=KEY=VALUE[,KEY=VALUE...]")
    ap.add_argument("--wall", type=float, default=40.0, help="seconds of RL per run")
    ap.add_argument("--pairs", type=int, default=2, help="rounds, each running every variant once")
    ap.add_argument("--seed", type=int, default=0, help="the warm start's run.seed")
    args = ap.parse_args()
    variants = {"base": (), **dict(args.variant)}
    out = Path(tempfile.mkdtemp(prefix="prl-loop-variants-"))
    warm = warm_start(out, args.seed)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for round_ in range(args.pairs):
        for name, sets in variants.items():
            row = figures(run_prl(out, warm, args.wall, f"{name}{round_}", sets))
            runs[name].append(row)
            print(f"{name} round {round_}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    means = {name: {k: statistics.mean(r[k] for r in rows) for k in rows[0]} for name, rows in runs.items()}
    report = {f"{name}_{k}": round(v, 4) for name, m in means.items() for k, v in m.items()}
    for name in variants:
        if name != "base":
            report[f"samples_per_s_{name}_over_base"] = round(means[name]["samples_per_s"]
                                                              / means["base"]["samples_per_s"], 3)
    print(f"runs in {out}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
