"""Long-tail rollouts: synchronous against asynchronous RL, and the staleness policies' length bias.

The real `prl run` (inference server, orchestrator, torchrun trainer) of reverse-tiny on the
`reverse_long_tail` task: word lengths log-normal (median 3 letters, p99 about 10x), so after the
warm start completion lengths are long-tailed too. One after the other on the same cores:

- `sync`: max_async_level 0 (every step waits for its slowest rollout);
- `async_mask`: max_async_level 2, max_off_policy_steps 2, stale_policy "mask" (the default policy);
- `async_drop`: the same with stale_policy "drop" (the old rule: stale groups are thrown away);
- `async_capacity`: async_mask with the in-flight budget driven by the engine's KV capacity
  (`inference.kv_capacity_tokens`) instead of a fixed count;
- `async_capacity_correct`: async_capacity with stale_policy "correct": the tokens past the window
  are trained under the importance correction instead of masked, so no generated token is wasted
  (what "mask" costs in throughput);
- `partial`: partial rollouts on top of sync (APRIL's setting): `rl.overprovision` 0.5 starts half a
  step's groups more, each step trains the first to finish and the rest carry into the next under new
  weights (max_off_policy_steps 1, so their first step's tokens are trained, not masked);
- `async_partial`: async_mask with the same over-provisioning.

For each: completion tokens trained per second (steady state, the first steps excluded; stale tokens
masked out are not counted), samples trained per second and the mean completion length (the runs'
policies drift apart, and async ones have learned to stop later on the same prompts: a longer mean
raises tokens per second without more work done per sample, so read both ratios), trainer
idle share, inference idle share, p90 length of the trajectories trained against all generated
(the length bias), stale tokens, and the reward at a fixed wall time (the shortest run's).

    .venv/bin/python bench/long_tail.py [--steps 100] [--skip 3] [--only VARIANT ...] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from async_overlap import measure  # the same steady-state accounting as the async bench

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["rl.max_async_level=2", "rl.max_off_policy_steps=2"]
VARIANTS = {
    "sync": ["rl.max_async_level=0", "rl.max_off_policy_steps=0"],
    "async_mask": [*ASYNC, "rl.stale_policy=mask"],
    "async_drop": [*ASYNC, "rl.stale_policy=drop"],
    "async_capacity": [*ASYNC, "rl.stale_policy=mask", "inference.kv_capacity_tokens=4096",
                       "rl.max_inflight_rollouts=512", "rl.kv_usage_target=0.9"],
    "async_capacity_correct": [*ASYNC, "rl.stale_policy=correct", "inference.kv_capacity_tokens=4096",
                               "rl.max_inflight_rollouts=512", "rl.kv_usage_target=0.9"],
    "partial": ["rl.max_async_level=0", "rl.max_off_policy_steps=1", "rl.overprovision=0.5"],
    "async_partial": [*ASYNC, "rl.stale_policy=mask", "rl.overprovision=0.5"],
}


def run(name: str, args, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "prl", "run", str(ROOT / "recipes/reverse-tiny.toml"), "--no-tui", "--force",
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}", "--set", "task.name=reverse_long_tail",
           "--set", "task.min_len=3", "--set", "task.max_len=40", "--set", "sampling.max_tokens=48",
           "--set", f"rl.max_steps={args.steps}", "--set", "trainer.checkpoint_every=0"]
    for item in [*VARIANTS[name], *args.set]:
        cmd += ["--set", item]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stdout[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def figures(events: list[dict], skip: int) -> dict:
    m = measure(events, skip)
    orch = [e for e in events if e["kind"] == "orch_step"]
    steady = [e for e in events if e["kind"] == "trainer_step" and e["stage"] == "rl"][skip - 1:]
    # completion tokens trained (rl.batch_size 128 of reverse-tiny); under "mask" the stale ones are not
    masked = [e["stale_tokens"] if e["stale_policy"] == "mask" else 0 for e in orch[skip:]]
    shipped = sum(e["completion_len"] * 128 for e in orch[skip:])
    trained, span = shipped - sum(masked), steady[-1]["t"] - steady[0]["t"]
    last = orch[-1]
    decodes, prefills = grown(events, steady[0]["t"], "decode_steps"), grown(events, steady[0]["t"], "prefill_forwards")
    # samples per second too: the policies drift to different completion lengths on the same prompts
    # (async runs' models stop later), so tokens per second alone credits longer answers as throughput
    samples = 128 * (len(steady) - 1)
    return {**m, "tokens_per_s": trained / span, "shipped_tokens_per_s": shipped / span,
            "samples_per_s": samples / span, "prefills_per_decode": prefills / max(1, decodes),
            "completion_len_mean": shipped / (128 * len(orch[skip:])),
            "len_accepted_p90": last["len_accepted_p90"], "len_generated_p90": last["len_generated_p90"],
            "len_bias_p90": last["len_accepted_p90"] / max(1.0, last["len_generated_p90"]),
            "stale_tokens": sum(e["stale_tokens"] for e in orch), "stale_dropped": last["stale_dropped_total"],
            "rl_start": steady[0]["t"], "rewards": [(e["t"], e["reward"]) for e in orch]}


def grown(events: list[dict], since: float, key: str) -> int:
    """How much a server counter grew from `since` on, summed over the servers (each its own count)."""
    per: dict[str, list[int]] = {}
    for e in events:
        if e["kind"] == "server" and e["t"] >= since:
            per.setdefault(e["name"], []).append(e.get(key, 0))
    return sum(v[-1] - v[0] for v in per.values())


def reward_at(r: dict, seconds: float) -> float:
    """Mean reward of the last 5 steps shipped within `seconds` of the run's first RL step."""
    seen = [x for t, x in r["rewards"] if t - r["rl_start"] <= seconds] or [r["rewards"][0][1]]
    return sum(seen[-5:]) / len(seen[-5:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=3, help="first RL steps excluded (start-up)")
    ap.add_argument("--only", nargs="*", default=None, help="variants to run (sync is always run)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for every variant")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="prl-long-tail-"))
    names = [n for n in VARIANTS if args.only is None or n == "sync" or n in args.only]
    res = {name: figures(run(name, args, out), args.skip) for name in names}
    horizon = min(r["rewards"][-1][0] - r["rl_start"] for r in res.values())
    for name, r in res.items():
        r["reward_at_horizon"] = reward_at(r, horizon)
        print(f"{name:22s} {r['tokens_per_s']:7.0f} tok/s ({r['shipped_tokens_per_s']:.0f} shipped)  "
              f"{r['samples_per_s']:5.0f} samples/s  mean length {r['completion_len_mean']:4.1f}  "
              f"trainer idle {r['trainer_idle']:4.0%}  inference idle "
              f"{r['inference_idle']:4.0%}  prefills/decode {r['prefills_per_decode']:.2f}  "
              f"p90 trained/generated {r['len_accepted_p90']:.0f}/{r['len_generated_p90']:.0f}"
              f"  stale tokens {r['stale_tokens']}  dropped {r['stale_dropped']}  reward at {horizon:.0f} s "
              f"{r['reward_at_horizon']:.3f}", flush=True)
    sync = res["sync"]
    line = {"horizon_s": round(horizon, 1)}
    for name, r in res.items():
        line[f"{name}_tokens_per_s"] = round(r["tokens_per_s"], 1)
        line[f"{name}_shipped_tokens_per_s"] = round(r["shipped_tokens_per_s"], 1)
        line[f"{name}_samples_per_s"] = round(r["samples_per_s"], 1)
        line[f"{name}_completion_len_mean"] = round(r["completion_len_mean"], 2)
        line[f"{name}_prefills_per_decode"] = round(r["prefills_per_decode"], 3)
        line[f"{name}_len_bias_p90"] = round(r["len_bias_p90"], 3)
        line[f"{name}_reward_at_horizon"] = round(r["reward_at_horizon"], 3)
        if name != "sync":
            line[f"{name}_over_sync"] = round(r["tokens_per_s"] / sync["tokens_per_s"], 3)
            line[f"{name}_samples_over_sync"] = round(r["samples_per_s"] / sync["samples_per_s"], 3)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
