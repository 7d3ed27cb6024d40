"""What a big dataset file costs each process of a run: a `task.data` jsonl of 1,000,000 rows against one of 1,000
rows, in memory (peak RSS) and in the time to open (index) it.

    .venv/bin/python bench/data_memory.py [--small 1000] [--big 1000000] [--keep DIR] [--run]

Two files of word-problem rows ({"prompt", "answer", "completion"}, about 120 bytes a row) are written into a
temporary folder (`--keep DIR`: there, and reused when already written). For each, a fresh Python process does
with the file what a run's orchestrator does (`--probe`): imports prl's task and eval modules (no torch) and warms
the `math` checker, then notes its RSS (the baseline); builds the task from `TaskCfg(data=file, reward="math",
rows=[0, n - held])` with `prl.tasks.make_task` (timing the open, which indexes the file) and an eval set over the
file's last `held` rows (`EvalCfg(data=file, rows=...)`, the set's task built as `prl.evaluation.sets` builds it);
reads the prompts of training's first `TRAINING_SCAN` indices and as many warm-start demonstrations from the same
file (another seed), as the orchestrator does to keep eval sets apart from training; draws examples 0..4999 and
those around the end of the first epoch (several epochs of the small file), and scores every drawn and held-out
example with `task.reward`. It reports its peak RSS (`ru_maxrss`), its baseline and its RSS at the end.

`--run` also starts a real run per file, `bin/prl run recipes/math-tiny.toml` with `task.data` and `sft.data` the
file (3 RL steps, 2 warm-start steps, the eval set at the start and the end only), and reads the peak RSS
(`VmHWM`) of its processes while it runs: the launcher (`prl run` itself, which checks the recipe's files), the
orchestrator and the trainer rank (`-m prl.orchestrator`, `-m prl.trainer`; not torchrun's agent). A few minutes.

Ends with one JSON line: `extra_mb` (the 1M-row process's peak RSS minus the 1k-row one's, MB), `rss_1m_over_1k`,
`open_s_*`, and with `--run` `run_<process>_extra_mb` per process; `under_200_mb` says whether every extra is
below 200 MB.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "math-tiny.toml"
LIMIT_MB = 200  # what the big file may cost a process beyond the small one
CHUNK_ROWS = 100_000  # rows formatted and written at a time
NAMES = ["ana", "ben", "carla", "dev", "emma", "farid", "gus", "hana", "ivan", "june", "kofi", "lena", "mo", "nia"]
THINGS = ["apples", "pens", "books", "stamps", "marbles", "cards", "shells", "coins", "cookies", "stickers"]
ROLES = {"orchestrator": "prl.orchestrator", "trainer": "prl.trainer"}  # a run's processes by their -m module


def problem(rng: random.Random) -> str:
    """One row as a jsonl line: an addition or a subtraction word problem (the tiny tokenizer's alphabet)."""
    n, t, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(5, 25), rng.randint(1, 20)
    if rng.random() < 0.5:
        p, w = f"{n} has {a} {t} and gets {b} more, how many {t} does {n} have now=", f"{a}+{b}={a + b}"
    else:
        b = min(b, a - 1)
        p, w = f"{n} had {a} {t} and gave away {b}, how many {t} are left=", f"{a}-{b}={a - b}"
    return f'{{"prompt": "{p}", "answer": "{w.rpartition("=")[2]}", "completion": "{w}"}}\n'


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` rows into `path`, CHUNK_ROWS at a time (kept when the file already holds that many lines)."""
    if path.exists():
        with open(path, "rb") as f:
            if sum(1 for _ in f) == rows:
                return
    rng = random.Random(seed)
    with open(path, "w") as f:
        for start in range(0, rows, CHUNK_ROWS):
            f.write("".join(problem(rng) for _ in range(min(CHUNK_ROWS, rows - start))))


def rss_mb() -> float:
    """This process's resident set now (VmRSS), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def probe(path: str, n: int) -> dict:
    """In this (fresh) process: what a run's orchestrator does with `path` (module docstring); the figures."""
    import prl.tasks.data  # noqa: F401 - numpy, before the baseline
    from prl.evaluation.sets import TRAINING_SCAN
    from prl.recipe.schema import EvalCfg, TaskCfg
    from prl.tasks import WARM_START_SEED_OFFSET, checker, make_task
    from prl.tasks.files import open_source

    checker("math")("so 1+1=2", {"prompt": "1+1=", "answer": "2"})  # the checker's imports, before the baseline
    base = rss_mb()
    held = min(n // 10, 1000)
    t0 = time.perf_counter()
    cfg = TaskCfg(data=path, reward="math", rows=[0, n - held])
    task = make_task(cfg, seed=0)
    open_s = time.perf_counter() - t0
    eval_task = make_task(EvalCfg(data=path, rows=[n - held, n]).set_task(cfg), seed=0)
    warm = open_source(path, None, shuffle=True)  # the warm start's demonstrations (sft.data = the same file)
    seen = {task.example(i)["prompt"] for i in range(TRAINING_SCAN)}
    seen |= {warm.example(i, WARM_START_SEED_OFFSET)["prompt"] for i in range(TRAINING_SCAN)}
    count = task.rows
    draws = sorted(set(range(5000)) | set(range(max(0, count - 1000), count + 1000)))
    rewards = []
    for i in draws:
        ex = task.example(i)
        rewards.append(task.reward(f"the answer is {ex['answer']}" if i % 2 else "no idea", ex))
    for i in range(eval_task.rows):
        ex = eval_task.example(i)
        rewards.append(eval_task.reward(f"so {ex['answer']}", ex))
    index = task.dataset_fn.source.rows
    index_mb = sum(getattr(index, k).nbytes for k in ("starts", "ends") if hasattr(index, k)) / 2**20
    return {"rows": n, "baseline_mb": round(base, 1), "peak_mb": round(peak_mb(), 1), "end_mb": round(rss_mb(), 1),
            "open_s": round(open_s, 3), "index_mb": round(index_mb, 1), "draws": len(draws), "epochs": draws[-1] // count,
            "held_out": eval_task.rows, "distinct_prompts": len(seen), "mean_reward": round(sum(rewards) / len(rewards), 3)}


def probe_in_process(path: Path, rows: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--probe", str(path), "--rows", str(rows)], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"probe of {path} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def hwm_mb(pid: int) -> float | None:
    """Peak RSS (VmHWM) of process `pid`, MB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def role_of(cmdline: list[str]) -> str | None:
    if "torch.distributed.run" in cmdline:
        return None  # torchrun's agent: its rank below it opens the file
    for role, module in ROLES.items():
        if module in cmdline:
            return role
    return None


def real_run(path: Path, name: str, out: Path, timeout_s: float) -> dict:
    """`prl run` of math-tiny reading `path`, sampling its processes' peak RSS; per process, its peak MB."""
    import psutil

    cmd = [str(ROOT / "bin" / "prl"), "run", str(RECIPE), "--no-tui", "--force", "--set", f"run.output_dir={out}",
           "--set", f"run.name={name}", "--set", f"task.data={path}", "--set", f"sft.data={path}",
           "--set", "rl.max_steps=3", "--set", "sft.steps=2", "--set", "eval.test.every=0"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peaks = psutil.Process(proc.pid), {}
    while proc.poll() is None and time.time() - t0 < timeout_s:
        try:
            found = [(p.pid, role_of(p.cmdline())) for p in root.children(recursive=True)] + [(proc.pid, "launcher")]
        except psutil.Error:
            found = [(proc.pid, "launcher")]
        for pid, role in found:
            mb = hwm_mb(pid) if role else None
            if mb is not None:
                peaks[role] = max(peaks.get(role, 0.0), mb)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    log = proc.communicate()[0]
    fig = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), **{f"{r}_mb": round(v, 1) for r, v in peaks.items()}}
    if proc.returncode:
        fig["log_tail"] = log[-2000:]
    return fig


def report(files: dict[str, Path], probes: dict[str, dict], runs: dict[str, dict]) -> dict:
    s, b = probes["small"], probes["big"]
    fig = {"rows_small": s["rows"], "rows_big": b["rows"], "file_mb_big": round(files["big"].stat().st_size / 2**20, 1),
           "peak_mb_1k": s["peak_mb"], "peak_mb_1m": b["peak_mb"], "extra_mb": round(b["peak_mb"] - s["peak_mb"], 1),
           "rss_1m_over_1k": round(b["peak_mb"] / s["peak_mb"], 3),
           "end_extra_mb": round(b["end_mb"] - s["end_mb"], 1), "index_mb_1m": b["index_mb"],
           "open_s_1k": s["open_s"], "open_s_1m": b["open_s"]}
    extras = [fig["extra_mb"]]
    if runs:
        for role in ("launcher", *ROLES):
            small, big = runs["small"].get(f"{role}_mb"), runs["big"].get(f"{role}_mb")
            if small and big:
                fig[f"run_{role}_extra_mb"] = round(big - small, 1)
                fig[f"run_{role}_1m_over_1k"] = round(big / small, 3)
                extras.append(fig[f"run_{role}_extra_mb"])
        fig["run_rc"] = [runs["small"]["rc"], runs["big"]["rc"]]
    fig["under_200_mb"] = all(e < LIMIT_MB for e in extras)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=1000, help="rows of the small file")
    ap.add_argument("--big", type=int, default=1_000_000, help="rows of the big file")
    ap.add_argument("--keep", default=None, help="write the files (and --run's runs) here, and keep them")
    ap.add_argument("--run", action="store_true", help="also a real 3-step run of recipes/math-tiny.toml per file")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds a run may take")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        print(json.dumps(probe(a.probe, a.rows)))
        return
    tmp = tempfile.TemporaryDirectory(prefix="prl-data-memory-") if a.keep is None else None
    folder = Path(a.keep or tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {"small": a.small, "big": a.big}
    files, probes, runs = {size: folder / f"rows-{n}.jsonl" for size, n in rows.items()}, {}, {}
    for size, path in files.items():
        t0 = time.perf_counter()
        write_rows(path, rows[size])
        print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MB, written in {time.perf_counter() - t0:.1f} s")
    for size, path in files.items():
        probes[size] = p = probe_in_process(path, rows[size])
        print(f"probe {p['rows']:>9} rows: baseline {p['baseline_mb']} MB, peak {p['peak_mb']} MB (+"
              f"{p['peak_mb'] - p['baseline_mb']:.1f}), end {p['end_mb']} MB, open {p['open_s']} s, index "
              f"{p['index_mb']} MB, {p['draws']} draws over {p['epochs'] + 1} epochs, mean reward {p['mean_reward']}")
    for size, path in files.items() if a.run else ():
        runs[size] = r = real_run(path, f"data-memory-{size}", folder / "runs", a.run_timeout)
        print(f"run {path.name}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "log_tail"))
        if r["rc"]:
            print(r.get("log_tail", ""))
    print(json.dumps(report(files, probes, runs)))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
