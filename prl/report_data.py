"""What `prl report` draws, read from run directories: a run's events, curves and evals (`RunData`),
one curve's series over several runs (`curve_series`), one eval set's series (`eval_series`) and the
axes they share (`bounds`). The HTML page (`prl.report`) and the PNGs (`prl.report_png`) both draw
from here."""

from __future__ import annotations

from pathlib import Path

from prl.metrics import read_events
from prl.tui.curves import CurveSet, finite
from prl.tui.evals import EvalLog, headline

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


class ReportError(Exception):
    pass


class RunData:
    """A run directory read once: its events, curves, evals and recipe; `start`: its first event's time."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        metrics = self.dir / "metrics.jsonl"
        if not metrics.is_file():
            raise ReportError(f"{run_dir} has no metrics.jsonl (not a prl run, or not started yet)")
        self.events, _ = read_events(metrics)
        self.curves, self.evals = CurveSet(), EvalLog()
        for e in self.events:
            self.curves.add(e)
            self.evals.add(e)
        self.start = min((e["t"] for e in self.events if finite(e.get("t"))), default=0)
        runs = [e for e in self.events if e.get("kind") == "run"]
        self.name = next((e["name"] for e in runs if e.get("name")), self.dir.name)
        self.state = runs[-1].get("state", "?") if runs else "?"
        recipe = self.dir / "recipe.json"
        self.recipe = recipe.read_text() if recipe.is_file() else "(no recipe.json)"

    def of(self, kind: str, **match) -> list[dict]:
        return [e for e in self.events if e.get("kind") == kind and all(e.get(k) == v for k, v in match.items())]


def bounds(series, bands) -> tuple[float, float, float, float]:
    """x0, x1, y0, y1 over every point and band edge (a flat curve gets a range around it); the HTML
    plots and the PNGs share it."""
    points = [p for _, _, pts in series for p in pts] + [(x, v) for _, b in bands for x, lo, hi in b for v in (lo, hi)]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    return x0, (x1 if x1 > x0 else x0 + 1), y0, y1


def curve_series(runs: list[RunData], c) -> tuple[str, list, list]:
    """One curve of every run: its title, (label, color, points) series and group-spread bands;
    the HTML plots and the PNGs draw the same thing from here."""
    series = [(r.name, COLORS[i % len(COLORS)], sorted(r.curves.values[c.key].items())) for i, r in enumerate(runs)]
    bands = []
    for i, r in enumerate(runs):
        spread, values = r.curves.spreads.get(c.key, {}), r.curves.values[c.key]
        if spread:
            bands.append((COLORS[i % len(COLORS)], [(x, values[x] - sd, values[x] + sd)
                                                    for x, sd in sorted(spread.items()) if x in values]))
    label = c.label + (" (shaded: group spread, ±1 std)" if bands else "")
    return label, [s for s in series if s[2]], bands


def eval_series(history: list[dict], start: float | None = None) -> list:
    """One eval set's pass@1, largest pass@k and reward as (label, color, points): by step, or with
    `start` by seconds since it (an eval without a time is left out there)."""
    figures = {k: None for r in history for k in r["figures"]}
    series = []
    for j, key in enumerate(headline(figures)):
        pts = [(r["step"] if start is None else round(r["t"] - start, 1), r["figures"][key]) for r in history
               if key in r["figures"] and (start is None or r["t"] is not None)]
        series.append((key, COLORS[j % len(COLORS)], pts))
    return [s for s in series if s[2]]
