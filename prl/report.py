"""`prl report RUN_DIR [RUN_DIR ...] --out report.html`: one self-contained HTML file per comparison.

Everything is inline (SVG plots drawn here, CSS, no script, no network): the file opens anywhere
and can be mailed. Contents: the curves of `prl.tui.curves.CURVES` (runs overlaid on shared axes),
each eval set's pass@1, largest pass@k and reward by step and by wall time (a section only where a run
has evals), the trainer's step-time breakdown, the multi-turn environment's figures per step (`ENV_PLOTS`),
per-server inference throughput, restarts and errors, and each run's resolved recipe. Every plotted series also carries its exact values (`data-values`), so what
the page shows can be checked against metrics.jsonl (tests render it in headless Chromium).
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from prl.report_data import (COLORS, ReportError, RunData, bounds, curve_series,  # noqa: F401 - ReportError re-exported
                              eval_series)
from prl.tui.curves import CURVES, finite
from prl.tui.evals import eval_line

W, H, PAD = 560, 220, 44


def svg_plot(title: str, series: list[tuple[str, str, list[tuple[float, float]]]], unit: str = "",
             curve: str = "", bands: list[tuple[str, list[tuple[float, float, float]]]] = ()) -> str:
    """A line plot: `series` = (label, color, [(x, y), ...]); axes shared by all series. `bands`:
    (color, [(x, low, high), ...]) drawn as shaded areas under the lines (a spread)."""
    if not any(pts for _, _, pts in series) and not any(b for _, b in bands):
        return f'<div class="plot empty"><h3>{html.escape(title)}</h3><p>no data</p></div>'
    x0, x1, y0, y1 = bounds(series, bands)

    def px(x: float, y: float) -> str:
        return f"{PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD):.1f},{H - PAD - (y - y0) / (y1 - y0) * (H - 2 * PAD):.1f}"

    lines = []
    for color, band in bands:
        outline = [px(x, hi) for x, _, hi in band] + [px(x, lo) for x, lo, _ in reversed(band)]
        lines.append(f'<polygon class="spread" fill="{color}" fill-opacity="0.15" stroke="none" '
                     f'points="{" ".join(outline)}"/>')
    for label, color, pts in series:
        values = json.dumps([round(y, 6) for _, y in pts])
        steps = json.dumps([x for x, _ in pts])
        lines.append(f'<polyline class="series" data-curve="{html.escape(curve)}" data-run="{html.escape(label)}" '
                     f"data-steps='{steps}' data-values='{values}' fill=\"none\" stroke=\"{color}\" "
                     f'stroke-width="1.6" points="{" ".join(px(x, y) for x, y in pts)}"/>')
    legend = "".join(f'<text x="{PAD + 140 * i}" y="14" fill="{c}" font-size="12">{html.escape(label)}</text>'
                     for i, (label, c, _) in enumerate(series))
    axes = (f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#888"/>'
            f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#888"/>'
            f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end" font-size="10">{y1:.4g}</text>'
            f'<text x="{PAD - 4}" y="{H - PAD}" text-anchor="end" font-size="10">{y0:.4g}</text>'
            f'<text x="{PAD}" y="{H - PAD + 14}" font-size="10">{x0:g}</text>'
            f'<text x="{W - PAD}" y="{H - PAD + 14}" text-anchor="end" font-size="10">{x1:g}</text>')
    head = html.escape(title + (f" ({unit})" if unit else ""))
    return (f'<div class="plot"><h3>{head}</h3><svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'xmlns="http://www.w3.org/2000/svg">{axes}{legend}{"".join(lines)}</svg></div>')


def curve_plots(runs: list[RunData]) -> str:
    out = []
    for c in CURVES:
        label, series, bands = curve_series(runs, c)
        out.append(svg_plot(label, series, c.unit, c.key, bands))
    return "".join(out)


def eval_section(runs: list[RunData]) -> str:
    """Per run and eval set: its last eval in a line, then its figures by step and by seconds since
    the run's start. Nothing (not even the heading) when no run has evals."""
    rows, plots = "", []
    for r in runs:
        for name, s in r.evals.summary().items():
            rows += f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(name)}</td><td>{html.escape(eval_line(s))}</td></tr>"
            history = r.evals.history(name)
            plots.append(svg_plot(f"eval {name}, {r.name}", eval_series(history), curve=f"eval/{name}"))
            plots.append(svg_plot(f"eval {name}, {r.name} (x: seconds)", eval_series(history, r.start),
                                  curve=f"eval/{name}/time"))
    if not plots:
        return ""
    return (f"<h2>Evaluation</h2><table><tr><th>run</th><th>set</th><th>last eval</th></tr>{rows}</table>"
            f'<div class="plots">{"".join(plots)}</div>')


SAMPLES_SHOWN = 2  # per eval point: this many of its worst completions and as many of its best


def samples_section(runs: list[RunData]) -> str:
    """Per run, eval set and eval point: its worst and best completions (`samples/eval_SET.jsonl`), folded.
    Nothing where no run kept any."""
    from prl.launch.samples import read_samples

    parts = []
    for r in runs:
        for path in sorted((r.dir / "samples").glob("eval_*.jsonl")):
            name = path.stem.removeprefix("eval_")
            by_step: dict[int, list[dict]] = {}
            for s in read_samples(r.dir, name):
                by_step.setdefault(s["step"], []).append(s)
            for step, kept in sorted(by_step.items()):
                parts.append(f"<details><summary>{html.escape(r.name)}: {html.escape(name)} at step {step} "
                             f"({len(kept)} completions)</summary>{samples_table(kept)}</details>")
    if not parts:
        return ""
    return "<h2>Samples</h2><p>Each eval point's worst and best completions; <code>prl samples RUN --eval SET</code> shows them all.</p>" \
        + "".join(parts)


def samples_table(kept: list[dict]) -> str:
    ranked = sorted(kept, key=lambda s: s["reward"])
    shown = ranked[:SAMPLES_SHOWN] + ranked[max(SAMPLES_SHOWN, len(ranked) - SAMPLES_SHOWN):]
    rows = "".join(f"<tr><td>{s['prompt_index']}</td><td>{s['reward']:.3f}</td><td><pre>{html.escape(s['prompt'])}"
                   f"</pre></td><td><pre>{html.escape(s['completion'])}</pre></td></tr>" for s in shown)
    return f"<table><tr><th>example</th><th>reward</th><th>prompt</th><th>completion</th></tr>{rows}</table>"


def step_time_plots(runs: list[RunData]) -> str:
    """Per run: the trainer's wait / forward-backward / publish seconds per step, and weight relay."""
    parts = []
    for r in runs:
        steps = r.of("trainer_step", stage="rl")
        series = [(name, COLORS[j], [(e["step"], e[key]) for e in steps if finite(e.get(key))])
                  for j, (name, key) in enumerate((("wait", "wait_s"), ("forward-backward", "fwd_bwd_s"),
                                                   ("publish", "publish_s")))]
        relay = [(e["version"], e["relay_s"]) for e in r.of("weights") if finite(e.get("relay_s"))]
        series.append(("weight relay (by version)", COLORS[3], relay))
        parts.append(svg_plot(f"step time, {r.name}", [s for s in series if s[2]], "s", "step_time"))
    return "".join(parts)


# multi-turn environments (`prl.envs.stats`): plotted per step, runs overlaid, where any run has them
ENV_PLOTS = (("turns per trajectory (mean)", "env_turns_mean", ""), ("tool calls per turn", "env_tool_calls_per_turn", ""),
             ("tool errors per turn", "env_tool_errors_per_turn", ""), ("truncated share", "env_truncated_share", ""),
             ("environment tokens", "env_tokens", "tokens"), ("re-tokenisation forks", "env_retokenize_forks", "trajectories"),
             ("sandbox executions", "sandbox_executions", "programs"), ("sandbox time", "sandbox_s", "s"),
             ("first attempt passes", "first_attempt_success", ""), ("second-turn success", "second_turn_success", ""))


def env_plots(runs: list[RunData]) -> str:
    parts = []
    for title, key, unit in ENV_PLOTS:
        series = [(r.name, COLORS[i % len(COLORS)], [(e["step"], e[key]) for e in r.of("orch_step") if finite(e.get(key))])
                  for i, r in enumerate(runs)]
        if any(pts for _, _, pts in series):
            parts.append(svg_plot(title, [s for s in series if s[2]], unit, key))
    return "".join(parts) or "<p>No multi-turn environment in these runs.</p>"


def server_plots(runs: list[RunData]) -> str:
    parts = []
    for r in runs:
        servers: dict[str, list[tuple[float, float]]] = {}
        for e in r.of("server"):
            if finite(e.get("tokens_per_s")):
                servers.setdefault(e["name"], []).append((round(e["t"] - r.start, 1), e["tokens_per_s"]))
        series = [(n, COLORS[i % len(COLORS)], pts) for i, (n, pts) in enumerate(sorted(servers.items()))]
        parts.append(svg_plot(f"inference load per server, {r.name} (x: seconds)", series, "tok/s", "servers"))
    return "".join(parts)


def incidents(runs: list[RunData]) -> str:
    rows = []
    for r in runs:
        for e in r.events:
            if e.get("kind") == "restart":
                rows.append((r.name, "restart", e["name"], f"#{e['count']}: {e.get('cause', '')}"))
            elif e.get("kind") == "error":
                rows.append((r.name, "error", e["name"], e.get("line", "")))
    if not rows:
        return "<p>No restarts or errors.</p>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr><th>run</th><th>event</th><th>process</th><th>detail</th></tr>{body}</table>"


def summary_table(runs: list[RunData]) -> str:
    body = ""
    for i, r in enumerate(runs):
        rewards = r.curves.series("reward")
        last = f"{sum(rewards[-5:]) / len(rewards[-5:]):.3f}" if rewards else "-"
        first = f"{sum(rewards[:5]) / len(rewards[:5]):.3f}" if rewards else "-"
        body += (f'<tr><td style="color:{COLORS[i % len(COLORS)]}">{html.escape(r.name)}</td><td>{html.escape(r.state)}'
                 f"</td><td>{len(rewards)}</td><td>{first}</td><td>{last}</td><td>{html.escape(str(r.dir))}</td></tr>")
    return ("<table><tr><th>run</th><th>state</th><th>RL steps</th><th>reward, first 5</th><th>reward, last 5</th>"
            f"<th>directory</th></tr>{body}</table>")


STYLE = ("body{font-family:sans-serif;margin:24px;color:#222} .plots{display:flex;flex-wrap:wrap;gap:12px}"
         " .plot h3{font-size:14px;margin:4px 0} table{border-collapse:collapse;font-size:13px}"
         " td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} pre{background:#f6f6f6;padding:8px;"
         "font-size:12px;max-height:400px;overflow:auto}")


def build_report(runs: list[RunData]) -> str:
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        for r in runs:
            r.name = str(r.dir)
    recipes = "".join(f"<h3>{html.escape(r.name)}</h3><pre>{html.escape(r.recipe)}</pre>" for r in runs)
    title = "prl report: " + ", ".join(r.name for r in runs)
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>generated {time.strftime('%Y-%m-%d %H:%M:%S')}</p>{summary_table(runs)}"
            f"<h2>Curves</h2><div class=\"plots\">{curve_plots(runs)}</div>{eval_section(runs)}{samples_section(runs)}"
            f"<h2>Step time</h2><div class=\"plots\">{step_time_plots(runs)}</div>"
            f"<h2>Environment</h2><div class=\"plots\">{env_plots(runs)}</div>"
            f"<h2>Inference servers</h2><div class=\"plots\">{server_plots(runs)}</div>"
            f"<h2>Restarts and errors</h2>{incidents(runs)}<h2>Recipes</h2>{recipes}</body></html>")


def write_report(run_dirs: list[Path], out: Path, png: bool = True) -> Path:
    """The HTML page at `out`; with `png`, one PNG per curve beside it in `<out stem>_png/`."""
    runs = [RunData(d) for d in run_dirs]
    page = build_report(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    if png:
        from prl.report_png import write_curve_pngs

        write_curve_pngs(runs, out.parent / f"{out.stem}_png")
    return out
