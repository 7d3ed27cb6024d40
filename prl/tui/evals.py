"""Evaluation results, read from `eval` events: per eval set, every eval in step order, and each
set's summary (its last eval and the change since its first, the step-0 baseline before training).

The dashboard, `prl status`, summary.json, `prl report` and the W&B sink all read eval events
through `eval_record`, so they agree on what an eval holds. An event without a set name or an
integer step is left out; so is a figure that is not a finite number (the rest of its event stays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from prl.tui.curves import finite

BOOKKEEPING = ("t", "step", "version", "examples", "samples", "replaced", "started", "wall_s", "skipped")  # not figures
PASS_AT = re.compile(r"pass@(\d+)$")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def eval_record(e: dict) -> dict | None:
    """An `eval` event as {set, step, version, t, examples, samples, replaced, figures}, or None if malformed
    (`replaced`: the held-out examples replaced as training prompts; None for a set the user placed)."""
    name, step = e.get("set"), e.get("step")
    if not isinstance(name, str) or not name or not is_int(step):
        return None
    figures = {k: float(v) for k, v in e.items() if k not in BOOKKEEPING and finite(v)}
    if not figures:
        return None
    known = {k: e.get(k) for k in ("version", "examples", "samples", "replaced") if is_int(e.get(k))}
    return {"set": name, "step": step, "version": known.get("version"), "t": e["t"] if finite(e.get("t")) else None,
            "examples": known.get("examples"), "samples": known.get("samples"), "replaced": known.get("replaced"),
            "figures": figures}


@dataclass
class EvalLog:
    """Per set (in the order first seen): step -> record; an eval replayed at a step replaces it."""

    sets: dict[str, dict[int, dict]] = field(default_factory=dict)

    def add(self, e: dict) -> None:
        """An event of the run's log; only `eval` events count."""
        r = eval_record(e) if e.get("kind") == "eval" else None
        if r is not None:
            self.sets.setdefault(r["set"], {})[r["step"]] = r

    def history(self, name: str) -> list[dict]:
        points = self.sets.get(name, {})
        return [points[s] for s in sorted(points)]

    def summary(self) -> dict[str, dict]:
        return {name: set_summary(self.history(name)) for name in self.sets}


def set_summary(history: list[dict]) -> dict:
    """The last eval of a set, its first's figures and `delta`: last - first, per figure both have."""
    first, last = history[0], history[-1]
    delta = {k: round(v - first["figures"][k], 6) for k, v in last["figures"].items() if k in first["figures"]}
    return {"step": last["step"], "version": last["version"], "t": last["t"], "examples": last["examples"],
            "samples": last["samples"], "replaced": last.get("replaced"), "evals": len(history), "figures": last["figures"],
            "first_step": first["step"], "first": first["figures"], "delta": delta}


def headline(figures) -> list[str]:
    """The figures an eval is read by: pass@1, the largest pass@k, reward (those it has; else its
    first three figures)."""
    ks = sorted(int(m.group(1)) for m in map(PASS_AT.match, figures) if m)
    keys = ([f"pass@{ks[0]}"] if ks else []) + ([f"pass@{ks[-1]}"] if len(ks) > 1 else [])
    keys += ["reward"] if "reward" in figures else []
    return keys or list(figures)[:3]


def eval_line(s: dict) -> str:
    """One set's summary in a line: "step 40 (v40)  pass@1 0.410 (+0.280 since step 0)  reward ..."."""
    moved = s["step"] != s["first_step"]
    parts = [f"step {s['step']}" + (f" (v{s['version']})" if s["version"] is not None else "")]
    for i, k in enumerate(headline(s["figures"])):
        change = s["delta"].get(k) if moved else None
        since = f" since step {s['first_step']}" if i == 0 else ""
        parts.append(f"{k} {s['figures'][k]:.3f}" + (f" ({change:+.3f}{since})" if change is not None else ""))
    if s["figures"].get("later_share", 0) > 0:
        parts.append(f"on later weights {s['figures']['later_share']:.0%}")
    if s.get("replaced"):
        parts.append(f"{s['replaced']} training prompts replaced")
    return "  ".join(parts)


def eval_table(records: list[dict], title: str = "evaluation", width: int | None = None) -> Table:
    """Eval records (`eval_record`) as a table: one row per set and step, a column per figure; turned (a row per
    figure, a column per set and step) where that would not fit `width` columns."""
    names = list(dict.fromkeys(k for r in records for k in r["figures"]))
    heads = ["set", "step", "examples", "samples", "replaced", *names]
    rows = [[r["set"], str(r["step"]), str(r["examples"] or "-"), str(r["samples"] or "-"),
             "-" if r.get("replaced") is None else str(r["replaced"]),
             *[format(r["figures"][k], ".3f") if k in r["figures"] else "-" for k in names]] for r in records]
    wide = sum(max(len(c) for c in col) + 3 for col in zip(heads, *rows)) + 1
    if width is not None and wide > width:
        return turned(heads, rows, title)
    t = Table(title=title, title_justify="left")
    for col in heads:
        t.add_column(Text(col), justify="left" if col == "set" else "right", no_wrap=True)  # names are data
    for row in rows:
        t.add_row(Text(row[0]), *row[1:])
    return t


def turned(heads: list[str], rows: list[list[str]], title: str) -> Table:
    """A row per figure, a column per set and step."""
    t = Table(title=title, title_justify="left")
    t.add_column("", no_wrap=True)
    for row in rows:
        t.add_column(Text(f"{row[0]} @{row[1]}"), justify="right", no_wrap=True)
    for i, head in enumerate(heads[2:], start=2):
        t.add_row(Text(head), *[row[i] for row in rows])
    return t
