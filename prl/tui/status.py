"""`prl status RUN_DIR`: the dashboard snapshot rebuilt from the run directory."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from prl.tui.state import RunState
from prl.tui.view import render


def snapshot(run_dir: Path, state: RunState | None = None) -> RunState:
    state = (state or RunState()).update_from(run_dir / "metrics.jsonl")
    state.mark_dead_processes()
    return state


def show(run_dir: Path, watch: bool, console: Console) -> int:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        console.print(f"prl status: {run_dir} has no metrics.jsonl (not a prl run, or not started yet)")
        return 1
    state = snapshot(run_dir)
    if not watch:
        console.print(render(state))
        return 0
    try:
        with Live(render(state), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(0.5)
                live.update(render(snapshot(run_dir, state)))
    except KeyboardInterrupt:
        return 0
