"""PNGs of the report's curves, for pasting into chats, papers and issues (Pillow, no plotting library).

Each curve of `prl.tui.curves.CURVES` with data becomes `<dir>/<curve key>.png`: title, axes with the
value and step ranges, one line per run in the report's colours, the group spread shaded, a legend.
Each eval set of each run becomes `<dir>/eval_<set>.png` (`eval_<set>_<run>.png` for several runs):
its pass@1, largest pass@k and reward by step.
The geometry is `plot_box` + `to_pixel`, which the tests use to find each point where it was drawn.
"""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from prl.report_data import bounds, curve_series, eval_series
from prl.tui.curves import CURVES

SIZE = (1000, 420)
MARGIN = (80, 50, 30, 50)  # left, top, right, bottom


def plot_box(size=SIZE) -> tuple[int, int, int, int]:
    w, h = size
    left, top, right, bottom = MARGIN
    return left, top, w - right, h - bottom


def to_pixel(x: float, y: float, lims, size=SIZE) -> tuple[float, float]:
    x0, x1, y0, y1 = lims
    left, top, right, bottom = plot_box(size)
    return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def draw_plot(title: str, series, bands, path: Path) -> None:
    img = Image.new("RGB", SIZE, "white")
    lims = bounds(series, bands)
    shade = Image.new("RGBA", SIZE, (0, 0, 0, 0))
    for color, band in bands:
        outline = [to_pixel(x, hi, lims) for x, _, hi in band] + [to_pixel(x, lo, lims) for x, lo, _ in reversed(band)]
        if len(outline) >= 3:
            ImageDraw.Draw(shade).polygon(outline, fill=(*rgb(color), 40))
    img.paste(shade, mask=shade)
    d = ImageDraw.Draw(img)
    font, small = ImageFont.load_default(size=18), ImageFont.load_default(size=13)
    left, top, right, bottom = plot_box()
    d.line([(left, top), (left, bottom), (right, bottom)], fill="#888888", width=1)
    x0, x1, y0, y1 = lims
    d.text((left - 6, top), f"{y1:.4g}", fill="black", font=small, anchor="ra")
    d.text((left - 6, bottom), f"{y0:.4g}", fill="black", font=small, anchor="rd")
    d.text((left, bottom + 6), f"step {x0:g}", fill="black", font=small, anchor="la")
    d.text((right, bottom + 6), f"{x1:g}", fill="black", font=small, anchor="ra")
    d.text((left, 12), title, fill="black", font=font)
    for i, (label, color, pts) in enumerate(series):
        xy = [to_pixel(x, y, lims) for x, y in pts]
        if len(xy) > 1:
            d.line(xy, fill=rgb(color), width=3, joint="curve")
        for px, py in xy:
            d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=rgb(color))
        d.text((right - 10, 12 + 18 * i), label, fill=rgb(color), font=small, anchor="ra")
    img.save(path)


def write_curve_pngs(runs, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for c in CURVES:
        label, series, bands = curve_series(runs, c)
        if series:
            path = out_dir / f"{c.key}.png"
            draw_plot(label + (f" ({c.unit})" if c.unit else ""), series, bands, path)
            written.append(path)
    return written + write_eval_pngs(runs, out_dir)


def write_eval_pngs(runs, out_dir: Path) -> list[Path]:
    written = []
    for r in runs:
        for name in r.evals.sets:
            stem = f"eval_{name}" + (f"_{r.name}" if len(runs) > 1 else "")
            path = out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', stem)}.png"
            draw_plot(f"eval {name}, {r.name}", eval_series(r.evals.history(name)), [], path)
            written.append(path)
    return written
