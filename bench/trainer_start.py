"""How long a one-rank trainer takes to start and to end: alone (the process `prl run` starts for
`trainer.nproc = 1` on one host) against the same trainer under torchrun (as more ranks run).

One prepared run folder per launch (reverse-tiny's model, no warm start, `--steps` RL batches already in its
rollout folder, as tests/test_trainer.py prepares them), the two launches alternating `--pairs` times, each
timed from its command to three points: the rank's first line ("trainer: rank 0 of 1"), its first RL step's
event in the run's metrics, and the command's exit.

    .venv/bin/python bench/trainer_start.py [--pairs 3] [--steps 2]

The last line is one JSON object: the medians per launch and `<point>_torchrun_over_alone`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def prepare(run_dir: Path, steps: int) -> Path:
    """A trainer's run folder with `steps` batches waiting (tests/test_trainer.py's); returns its config."""
    from test_trainer import prepare_trainer

    configs = prepare_trainer(run_dir, 1, steps, checkpoint_every=0)
    return Path(next(c for c in configs if c.role == "trainer").config_path)


def first_rl_step(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "trainer_step" and e.get("stage") == "rl":
            return e["t"]
    raise SystemExit(f"bench/trainer_start.py: no RL step in {run_dir}/metrics.jsonl")


def launch(run_dir: Path, config: Path, torchrun: bool) -> dict[str, float]:
    """Seconds from the command to the rank's first line, its first RL step, and its exit."""
    entry = ["-m", "prl.trainer", "--config", str(config)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *entry] if torchrun
           else [sys.executable, *entry, "--alone"])
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranked = None
    for line in p.stdout:
        if ranked is None and line.startswith("trainer: rank 0 of 1"):
            ranked = time.time() - t0
    p.wait()
    ended = time.time() - t0
    if p.returncode != 0 or ranked is None:
        raise SystemExit(f"bench/trainer_start.py: {shlex.join(cmd)} exited {p.returncode}")
    return {"rank_up_s": ranked, "first_step_s": first_rl_step(run_dir) - t0, "exit_s": ended}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"alone": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name in (("alone", "torchrun") if i % 2 == 0 else ("torchrun", "alone")):
                run_dir = Path(tmp) / f"{name}-{i}"
                config = prepare(run_dir, args.steps)
                results[name].append(launch(run_dir, config, name == "torchrun"))
                print(name, {k: round(v, 2) for k, v in results[name][-1].items()}, flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    out = {f"{n}_{k}": round(v, 3) for n, m in med.items() for k, v in m.items()}
    out.update({f"{k}_torchrun_over_alone": round(med["torchrun"][k] / med["alone"][k], 3) for k in med["alone"]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
