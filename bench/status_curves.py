"""`prl status --curves` on a long run: wall time of the command (process start included) for a
1,000-step run's metrics.jsonl, against `prl status` without curves, side by side.

The metrics file is synthetic but has a real run's event mix per step (orchestrator step, trainer
step, weights relay, a server report per server per second, rollouts, beats; 8 servers by default).

    .venv/bin/python bench/status_curves.py [--steps 1000] [--servers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_metrics(path: Path, steps: int, servers: int) -> int:
    rng = random.Random(0)
    lines = [{"t": 0, "src": "driver", "kind": "run", "state": "done", "name": "long", "max_steps": steps}]
    for i in range(steps):
        t = float(i)
        lines.append({"t": t, "src": "orchestrator", "kind": "orch_step", "step": i, "reward": rng.random(),
                      "reward_std": 0.1, "completion_len": 11.0, "stale_dropped": 0, "stale_dropped_total": i // 10,
                      "off_policy_mean": 0.6, "off_policy_max": 1, "inflight": 64, "served_version": i,
                      "buffered": 3, "wait_s": 0.01, "data_position": 16 * i})
        lines.append({"t": t, "src": "trainer", "kind": "trainer_step", "stage": "rl", "step": i, "total": steps,
                      "loss": rng.random(), "mismatch_kl": 1e-3, "grad_norm": 1.0, "lr": 1e-3, "tokens": 3000,
                      "tokens_per_s": 2000.0, "wait_s": 0.1, "fwd_bwd_s": 0.5, "publish_s": 0.05, "version": i + 1})
        lines.append({"t": t, "src": "orchestrator", "kind": "weights", "version": i + 1, "relay_s": 0.05})
        for s in range(servers):
            lines.append({"t": t, "src": "orchestrator", "kind": "server", "name": f"inference-{s}", "version": i,
                          "running": 8, "waiting": 0, "paused": False, "tokens_per_s": 900.0, "busy_frac": 0.8,
                          "busy_s": t, "generated_tokens": 1000 * i})
        lines.append({"t": t, "src": "orchestrator", "kind": "rollouts", "inflight": 64, "buffered": 3})
        lines.append({"t": t, "src": "orchestrator", "kind": "beat"})
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    return len(lines)


def best_of(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp()) / "long"
    run.mkdir()
    n = write_metrics(run / "metrics.jsonl", args.steps, args.servers)
    base = [sys.executable, "-m", "prl", "status", str(run)]
    plain, curves = best_of(base, args.repeats), best_of([*base, "--curves"], args.repeats)
    print(f"{args.steps} steps, {n} events ({(run / 'metrics.jsonl').stat().st_size / 1e6:.1f} MB): "
          f"prl status {plain:.2f} s, prl status --curves {curves:.2f} s ({curves / plain:.2f}x)")
    print(json.dumps({"steps": args.steps, "events": n, "status_s": round(plain, 3), "curves_s": round(curves, 3)}))


if __name__ == "__main__":
    main()
