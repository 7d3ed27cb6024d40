"""A reward model against the rule it was fitted to: does RL on a reward model's score raise the true reward?

    .venv/bin/python bench/reward_model.py [--steps 60] [--fit-steps 3000] [--out DIR]

1. The reward model: a Qwen3 sequence classifier (hidden 128, 3 layers) over prl's character tokenizer, fitted by
   regression to the reverse task's rule reward (edit similarity to the reversed word) on completions near and far
   from the answer (`tests/reward_fixture.py`); its correlation with the rule on 500 new completions is printed.
2. Two runs of `recipes/reverse-tiny.toml` from the same warm start, `--steps` RL steps each, one after the other:
   `rule` learns from the task's reward, `model` from the reward model's score alone (`reward.task_weight = 0`).
   Both are scored by the recipe's held-out set with the rule (greedy) every 10 steps.

Ends with one JSON line: `model_gain_over_rule_gain` (the held-out rule reward's gain from step 0 to the last step,
the reward-model run's over the rule run's), each run's held-out curve, and the fit's correlation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from distill import ROOT, figures, run

sys.path.insert(0, str(ROOT / "tests"))
from reward_fixture import examples, fit_reward_model  # noqa: E402


def correlation(folder: Path) -> float:
    """The fitted model's Pearson correlation with the rule on 500 completions it was not fitted on."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from prl.model.tiny import char_tokenizer

    model, tok = AutoModelForSequenceClassification.from_pretrained(folder).eval(), char_tokenizer()
    test = examples(500, seed=99)
    with torch.no_grad():
        pred = [model(input_ids=torch.tensor([tok(p + c).input_ids])).logits[0, 0].item() for p, c, _ in test]
    return torch.corrcoef(torch.tensor([pred, [r for *_, r in test]]))[0, 1].item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fit-steps", type=int, default=3000)
    ap.add_argument("--reward-model", type=Path, default=None, help="a fitted folder to use instead of fitting one")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="trainer.loss.kl_coef of both runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="prl-rm-"))
    folder = args.reward_model or fit_reward_model(out / "reward-model", steps=args.fit_steps, hidden=128, layers=4,
                                                   batch=128, lr=1e-3)
    corr = correlation(folder)
    both = (f"rl.max_steps={args.steps}", f"trainer.loss.kl_coef={args.kl_coef}")
    rule = figures(run(out, "rule", *both))
    model = figures(run(out, "model", *both, f'reward.model.path="{folder}"', "reward.task_weight=0"))
    gains = {}
    for name, f in (("rule", rule), ("model", model)):
        held = f["heldout_by_step"]
        gains[name] = held[max(held)] - held[min(held)]
        print(f"{name}: held-out rule reward by step {held} (gain {gains[name]:+.4f}), training reward (last 5 steps) "
              f"{f['train_reward_last5']}, {f['rl_s']} s of RL")
    print(f"reward model: correlation with the rule {corr:.3f} on 500 new completions")
    print(json.dumps({"model_gain_over_rule_gain": round(gains["model"] / max(gains["rule"], 1e-9), 3),
                      "rule_gain": round(gains["rule"], 4), "model_gain": round(gains["model"], 4),
                      "fit_correlation": round(corr, 3), "steps": args.steps, "rule": rule, "model": model}))


if __name__ == "__main__":
    main()
