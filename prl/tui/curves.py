"""Whole-run curves, defined once: which event field each curve reads, its label and unit.

`CURVES` is the one list the dashboard, `prl status --curves` and their overlays read: a new curve
appears everywhere by adding it here. `CurveSet` folds events (as `RunState` reads them) into one
value per RL step; `curves_table` draws them downsampled to the terminal width, one row per run,
runs sharing each curve's scale so an overlay compares like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

BLOCKS = "▁▂▃▄▅▆▇█"
RUN_STYLES = ("cyan", "magenta", "yellow", "green")


@dataclass(frozen=True)
class Curve:
    key: str
    label: str
    unit: str
    kind: str  # the event kind it is read from
    field: str
    fmt: str = ".3f"
    stage: str | None = None  # trainer_step: "rl" only
    spread: str | None = None  # a field holding the spread shown beside the last value


CURVES: tuple[Curve, ...] = (
    Curve("reward", "reward", "", "orch_step", "reward", spread="reward_std"),
    Curve("loss", "loss", "", "trainer_step", "loss", ".4f", stage="rl"),
    Curve("mismatch_kl", "mismatch KL", "nats", "trainer_step", "mismatch_kl", ".2e", stage="rl"),
    Curve("policy_lag", "policy lag", "steps", "orch_step", "off_policy_mean", ".2f"),
    Curve("stale", "stale dropped", "samples", "orch_step", "stale_dropped_total", ".0f"),
    Curve("trainer_tps", "trainer tokens/s", "tok/s", "trainer_step", "tokens_per_s", ".0f", stage="rl"),
    Curve("inference_tps", "inference tokens/s", "tok/s", "server", "tokens_per_s", ".0f"),
)


@dataclass
class CurveSet:
    """Per curve: RL step -> value (a replayed step overwrites itself). Server throughput, logged by
    time, is summed over servers at the latest report in each step."""

    values: dict[str, dict[int, float]] = field(default_factory=lambda: {c.key: {} for c in CURVES})
    spreads: dict[str, dict[int, float]] = field(default_factory=dict)
    step: int = 0  # the step being trained (server reports land here)
    servers: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, e: dict) -> None:
        kind = e.get("kind")
        if kind == "trainer_step" and e.get("stage") == "rl":
            self.step = e["step"] + 1
        if kind == "server":
            tps = e.get("tokens_per_s")
            self.servers.setdefault(self.step, {})[e.get("name", "?")] = tps if finite(tps) else 0.0
            self.values["inference_tps"][self.step] = sum(self.servers[self.step].values())
            return
        for c in CURVES:
            if c.kind == kind and (c.stage is None or e.get("stage") == c.stage) and finite(e.get(c.field)):
                self.values[c.key][e["step"]] = float(e[c.field])
                if c.spread and finite(e.get(c.spread)):
                    self.spreads.setdefault(c.key, {})[e["step"]] = float(e[c.spread])

    def series(self, key: str) -> list[float]:
        points = self.values[key]
        return [points[s] for s in sorted(points)]


def finite(v) -> bool:
    """A number the curves can draw (a diverged loss logs NaN or inf: left out, not a crash)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def downsample(values: list[float], width: int) -> list[float]:
    """Bucket means, so a long run fits `width` columns and every step counts."""
    if len(values) <= width:
        return values
    edges = [round(i * len(values) / width) for i in range(width + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:]) if b > a]


def spark(values: list[float], lo: float, hi: float) -> str:
    if hi == lo:
        return BLOCKS[len(BLOCKS) // 2] * len(values)
    span = hi - lo
    return "".join(BLOCKS[min(len(BLOCKS) - 1, max(0, int((v - lo) / span * (len(BLOCKS) - 1) + 0.5)))] for v in values)


def curves_table(runs: list[tuple[str, CurveSet]], width: int = 80) -> Table:
    """One row per curve and run: the whole run's curve, then last value (with its spread), min, max."""
    name_w = max(len(n) for n, _ in runs)
    longest = max((len(cs.values[c.key]) for _, cs in runs for c in CURVES), default=1)
    plot_w = min(max(10, width - name_w - 72), max(longest, 10))
    t = Table(title="curves (whole run)" + ("" if len(runs) == 1 else f": {len(runs)} runs overlaid"),
              title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("curve", no_wrap=True, width=26)
    t.add_column("run", no_wrap=True, min_width=name_w)
    t.add_column("", no_wrap=True, width=plot_w)
    for col in ("last", "min", "max"):
        t.add_column(col, justify="right", no_wrap=True, min_width=8)
    for c in CURVES:
        series = [(name, cs, cs.series(c.key)) for name, cs in runs]
        every = [v for _, _, s in series for v in s]
        if not every:
            continue
        lo, hi = min(every), max(every)
        for i, (name, cs, s) in enumerate(series):
            label = f"{c.label}" + (f" ({c.unit})" if c.unit else "") if i == 0 else ""
            if not s:
                t.add_row(label, name, "-", "-", "-", "-")
                continue
            last = format(s[-1], c.fmt)
            spread = cs.spreads.get(c.key)
            if spread:
                last += f" ±{format(spread[max(spread)], c.fmt)}"
            style = RUN_STYLES[i % len(RUN_STYLES)]
            cols = max(1, round(plot_w * len(s) / max(len(x) for _, _, x in series)))  # shared step axis
            t.add_row(label, Text(name, style=style), Text(spark(downsample(s, cols), lo, hi), style=style),
                      last, format(min(s), c.fmt), format(max(s), c.fmt))
    return t
