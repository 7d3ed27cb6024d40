"""`prl status RUN_DIR`: the dashboard snapshot rebuilt from the run directory."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from prl.tui.curves import curves_table
from prl.tui.evals import eval_line
from prl.tui.state import RunState
from prl.tui.view import render


def snapshot(run_dir: Path, state: RunState | None = None) -> RunState:
    state = (state or RunState()).update_from(run_dir / "metrics.jsonl")
    state.mark_dead_processes()
    return state


def show(run_dirs: list[Path], watch: bool, console: Console, curves: bool = False) -> int:
    """One run: its dashboard (with `curves`, plus the whole-run curves). Several: their curves
    overlaid on shared scales, after one line per run (and one per eval set it has)."""
    run_dirs = [Path(d) for d in run_dirs]
    for d in run_dirs:
        if not (d / "metrics.jsonl").is_file():
            console.print(f"prl status: {d} has no metrics.jsonl (not a prl run, or not started yet; `prl runs` "
                          f"lists the runs)", markup=False)
            return 2
    if len(run_dirs) > 1:
        return overlay(run_dirs, console)
    run_dir = run_dirs[0]
    state = snapshot(run_dir)
    if not watch:
        console.print(render(state, curves, console.width))
        return 0
    try:
        with Live(render(state, curves, console.width), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(0.5)
                live.update(render(snapshot(run_dir, state), curves, console.width))
    except KeyboardInterrupt:
        return 0


def overlay(run_dirs: list[Path], console: Console) -> int:
    states = [snapshot(d) for d in run_dirs]
    names = unique_names(run_dirs, states)
    for name, s in zip(names, states):
        steps = len(s.curves.values["reward"])
        console.print(f"{name}: {s.run.get('state', '?')}, {steps} RL steps", markup=False, highlight=False)
        for set_name, e in s.eval_summary().items():
            console.print(f"  eval {set_name}: {eval_line(e)}", markup=False, highlight=False)
    console.print(curves_table(list(zip(names, (s.curves for s in states))), console.width))
    return 0


def unique_names(run_dirs: list[Path], states: list[RunState]) -> list[str]:
    """Run names, or their directories where two runs share a name."""
    names = [s.run.get("name") or d.name for d, s in zip(run_dirs, states)]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
