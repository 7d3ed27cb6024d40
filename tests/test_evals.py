"""Eval results (`eval` events) everywhere a run is read: the fold (`RunState`, summary.json), the
dashboard, `prl status` (text and --json), `prl report` (HTML and PNGs) and the W&B sink. Malformed
eval events are left out, never a crash."""

import json
import os
import subprocess
from pathlib import Path

from rich.console import Console

from conftest import ROOT, prl_cmd
from test_status import write_run

T0 = 0.0  # the synthetic run's first event


def eval_event(set_name: str, step: int, pass1: float, **more) -> dict:
    return {"t": T0 + 10 * step + 5, "src": "orchestrator", "kind": "eval", "set": set_name, "step": step,
            "version": step, "examples": 32, "samples": 4, "reward": 0.2 + pass1, "pass@1": pass1,
            "pass@4": min(1.0, 2 * pass1), "best@4": 0.8, "maj@4": 0.3, "completion_len": 7.2, "later_share": 0.0,
            "wall_s": 3.2, "started": T0 + 10 * step, **more}


MALFORMED = [
    {"t": T0, "src": "orchestrator", "kind": "eval", "step": 3, "pass@1": 0.9},  # no set
    {"t": T0, "src": "orchestrator", "kind": "eval", "set": "heldout", "step": "3", "pass@1": 0.9},  # step not an int
    {"t": T0, "src": "orchestrator", "kind": "eval", "set": "heldout", "step": 3},  # no figure
    {"t": T0, "src": "orchestrator", "kind": "eval", "set": ["x"], "step": 3, "pass@1": 0.9},  # set not a name
]


def evals() -> list[dict]:
    """heldout at 0, 4, 8 (out of step order in the log, as a slow eval lands late); hard at 0 and 8,
    its last one partly on later weights and with a figure that is not a number."""
    return [eval_event("heldout", 0, 0.125), eval_event("hard", 0, 0.0), eval_event("heldout", 8, 0.405),
            *MALFORMED, eval_event("heldout", 4, 0.25),
            eval_event("hard", 8, 0.0625, later_share=0.25, turns=2.5, **{"pass@8": 0.5, "reward": "n/a"})]


def write_eval_run(run_dir: Path, events: list[dict] = ()) -> None:
    write_run(run_dir, "evalrun", 8, 0.01)
    path = run_dir / "metrics.jsonl"
    path.write_text(path.read_text() + "".join(json.dumps(e) + "\n" for e in events or evals()))


def test_the_fold_keeps_every_eval_per_set_and_summarises_the_last(tmp_path):
    from prl.tui.state import load_state, summarize

    write_eval_run(tmp_path / "a")
    state = load_state(tmp_path / "a")
    assert [r["step"] for r in state.evals.history("heldout")] == [0, 4, 8]
    s = state.eval_summary()
    assert list(s) == ["heldout", "hard"]
    held = s["heldout"]
    assert (held["step"], held["version"], held["first_step"], held["evals"]) == (8, 8, 0, 3)
    assert held["figures"]["pass@1"] == 0.405 and held["first"]["pass@1"] == 0.125
    assert held["delta"]["pass@1"] == 0.28 and held["delta"]["reward"] == 0.28
    assert "started" not in held["figures"] and "examples" not in held["figures"] and held["samples"] == 4
    hard = s["hard"]
    assert "reward" not in hard["figures"] and hard["figures"]["turns"] == 2.5, "a figure that is no number is left out"
    assert "pass@8" not in hard["delta"] and hard["delta"]["pass@1"] == 0.0625
    assert summarize(state)["eval"] == s
    write_run(tmp_path / "b", "b", 3, 0.0)
    assert load_state(tmp_path / "b").eval_summary() == {} and summarize(load_state(tmp_path / "b"))["eval"] == {}


def test_the_eval_line_and_table():
    from prl.tui.evals import EvalLog, eval_line, eval_record, eval_table

    log = EvalLog()
    for e in evals():
        log.add(e)
    summary = log.summary()
    assert eval_line(summary["heldout"]) == ("step 8 (v8)  pass@1 0.405 (+0.280 since step 0)  pass@4 0.810 (+0.560)"
                                             "  reward 0.605 (+0.280)")
    assert eval_line(summary["hard"]).endswith("pass@8 0.500  on later weights 25%"), "no change for a new figure"
    baseline = EvalLog()
    baseline.add(eval_event("heldout", 0, 0.125))
    assert eval_line(baseline.summary()["heldout"]) == "step 0 (v0)  pass@1 0.125  pass@4 0.250  reward 0.325"
    console = Console(width=200, record=True)
    console.print(eval_table(log.history("heldout") + [eval_record(eval_event("[/odd]", 0, 0.5, **{"[/x]": 1.0}))]))
    text = console.export_text()
    assert "pass@1" in text and "maj@4" in text and "0.405" in text and text.count("heldout") == 3
    assert "[/odd]" in text and "[/x]" in text


def test_the_training_prompts_a_held_out_set_replaced_are_shown_not_plotted():
    from prl.tui.evals import EvalLog, eval_line, eval_record, eval_table

    log = EvalLog()
    log.add(eval_event("heldout", 0, 0.125, replaced=28, verbatim_share=0.0))
    log.add(eval_event("own", 0, 0.125, replaced=None, verbatim_share=0.25))
    held, own = log.summary()["heldout"], log.summary()["own"]
    assert held["replaced"] == 28 and "replaced" not in held["figures"] and held["figures"]["verbatim_share"] == 0.0
    assert eval_line(held).endswith("reward 0.325  28 training prompts replaced") and own["replaced"] is None
    assert "replaced" not in eval_line(own)
    console = Console(width=250, record=True)
    console.print(eval_table([eval_record(eval_event("heldout", 0, 0.125, replaced=28)),
                              eval_record(eval_event("own", 0, 0.125, replaced=None))]))
    rows = {line.split()[1]: line.split() for line in console.export_text().splitlines() if "│ heldout" in line
            or "│ own" in line}
    assert rows["heldout"][9] == "28" and rows["own"][9] == "-", rows  # set, step, examples, samples, replaced


def test_the_dashboard_shows_evals_only_when_there_are_some(tmp_path):
    from prl.tui.state import load_state
    from prl.tui.view import render

    def shown(run_dir: Path) -> str:
        console = Console(width=200, record=True)
        console.print(render(load_state(run_dir), width=200))
        return console.export_text()

    write_eval_run(tmp_path / "a")
    out = shown(tmp_path / "a")
    assert "evaluation" in out and "pass@1 0.405 (+0.280 since step 0)" in out and "on later weights 25%" in out
    write_eval_run(tmp_path / "b", MALFORMED)
    assert "evaluation" not in shown(tmp_path / "b")
    write_eval_run(tmp_path / "c", [eval_event("[/odd]", 0, 0.5, **{"[/x]": 1.0})])
    assert "[/odd]" in shown(tmp_path / "c"), "names are shown as written, not read as markup"


def test_status_text_and_json(tmp_path):
    write_eval_run(tmp_path / "a")
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.run(prl_cmd("status", tmp_path / "a", "--json"), capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["eval"]["heldout"]["delta"]["pass@1"] == 0.28 and out["summary"]["eval"] == out["eval"]
    from prl.tui.status import show

    console = Console(width=200, record=True)
    write_run(tmp_path / "b", "other", 3, 0.0)
    assert show([tmp_path / "a", tmp_path / "b"], False, console) == 0
    assert "  eval heldout: step 8 (v8)  pass@1 0.405 (+0.280 since step 0)" in console.export_text()


def test_the_report_draws_each_set_by_step_and_by_time(tmp_path):
    from prl.report import build_report, write_report
    from prl.report_data import RunData

    write_eval_run(tmp_path / "a")
    page = build_report([RunData(tmp_path / "a")])
    assert "<h2>Evaluation</h2>" in page and "pass@1 0.405 (+0.280 since step 0)" in page
    by_step = series(page, "eval/heldout")
    assert by_step["pass@1"] == ([0, 4, 8], [0.125, 0.25, 0.405]) and set(by_step) == {"pass@1", "pass@4", "reward"}
    assert series(page, "eval/heldout/time")["pass@1"][0] == [5.0, 45.0, 85.0], "seconds since the run's first event"
    assert set(series(page, "eval/hard")) == {"pass@1", "pass@8", "reward"}
    write_run(tmp_path / "b", "plain", 3, 0.0)
    plain = build_report([RunData(tmp_path / "b")])
    assert "Evaluation" not in plain and "eval/" not in plain
    write_report([tmp_path / "a"], tmp_path / "r.html")
    pngs = sorted(p.name for p in (tmp_path / "r_png").iterdir() if p.name.startswith("eval_"))
    assert pngs == ["eval_hard.png", "eval_heldout.png"]


def test_the_report_shows_each_eval_points_worst_and_best_completions(tmp_path):
    """A folded table per set and point: the 2 lowest and 2 highest rewards of its completions, escaped."""
    import re

    from prl.report import build_report
    from prl.report_data import RunData

    write_eval_run(tmp_path / "a")
    done = [{"step": step, "prompt_index": i, "prompt": f"p{i}<b>", "completion": f"c{i}", "reward": r}
            for step in (0, 4) for i, r in enumerate([0.5, 0.0, 1.0, 0.25, 0.75, 0.9])]
    (tmp_path / "a" / "samples").mkdir()
    (tmp_path / "a" / "samples" / "eval_heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in done))
    page = build_report([RunData(tmp_path / "a")])
    folds = re.findall(r"<summary>evalrun: heldout at step (\d+) \(6 completions\)</summary>(.*?)</details>", page)
    assert [step for step, _ in folds] == ["0", "4"]
    shown = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td><pre>(.*?)</pre>", folds[1][1])
    assert shown == [("1", "0.000", "p1&lt;b&gt;"), ("3", "0.250", "p3&lt;b&gt;"), ("5", "0.900", "p5&lt;b&gt;"),
                     ("2", "1.000", "p2&lt;b&gt;")]
    write_run(tmp_path / "b", "plain", 3, 0.0)
    assert "<h2>Samples</h2>" not in build_report([RunData(tmp_path / "b")])


def series(page: str, curve: str) -> dict[str, tuple[list, list]]:
    """The plotted series of one chart: label -> (x values, y values), as the page carries them."""
    import re

    found = re.findall(rf"data-curve=\"{re.escape(curve)}\" data-run=\"([^\"]+)\" data-steps='([^']*)' "
                       rf"data-values='([^']*)'", page)
    return {label: (json.loads(xs), json.loads(ys)) for label, xs, ys in found}


def test_wandb_logs_each_eval_once_at_its_step(tmp_path):
    """Evals land as their own rows against `eval/step`, also one that arrives after later trainer
    rows; the RL rows stay one per step against `rl_step`."""
    from wandb_file import finished_files, history

    from prl.launch.wandb_log import WandbSink
    from prl.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml", ['run.wandb={project="prl-test", mode="offline"}'])
    write_eval_run(tmp_path / "log")
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    sink = WandbSink(recipe, run_dir, resume=False)  # before the log exists: it logs the log from its start
    replayed = json.dumps(eval_event("heldout", 4, 0.9)) + "\n"
    (run_dir / "metrics.jsonl").write_text((tmp_path / "log" / "metrics.jsonl").read_text() + replayed)
    kept = [{"step": 1, "prompt_index": 9, "prompt": "reverse: abc", "completion": "cba", "reward": 1.0, "advantage": 0.5},
            {"step": 1, "prompt_index": 3, "prompt": "reverse: xy", "completion": "xx", "reward": 0.0, "advantage": -0.5}]
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "steps.jsonl").write_text("".join(json.dumps(k) + "\n" for k in kept) + '{"step": 2, "pro')
    sink.poll()
    sink.close("finished", 0)
    assert not sink.failed, "W&B logging stopped (its reason is on stderr)"
    (f,) = finished_files(run_dir)
    rows = history(f)
    [table] = [r for r in rows if "samples/_type" in r]  # once: a line still being written waits
    assert table["samples/_type"] == "table-file" and table["samples/nrows"] == 2, table
    logged = json.loads(next(f.parent.glob(f"files/{table['samples/path']}")).read_text())
    assert logged["columns"] == list(kept[0]) and logged["data"] == [list(k.values()) for k in kept], logged
    assert [r["rl_step"] for r in rows if "rl_step" in r] == list(range(8))
    held = [(r["eval/step"], r["eval/heldout/pass@1"]) for r in rows if "eval/heldout/pass@1" in r]
    assert held == [(0, 0.125), (8, 0.405), (4, 0.25)], "each eval once, in the order it arrived"
    [hard] = [r for r in rows if r.get("eval/step") == 8 and "eval/hard/pass@8" in r]
    assert hard["eval/hard/later_share"] == 0.25 and "eval/hard/reward" not in hard
    assert not any("rl_step" in r and "eval/step" in r for r in rows)


def test_an_eval_table_too_wide_for_the_terminal_turns_a_row_per_figure():
    """prl eval at 80 columns: every figure readable in full (the wide table collapsed them to '0…')."""
    from prl.tui.evals import eval_record, eval_table

    records = [eval_record(eval_event("heldout", 3, 0.125, replaced=1, verbatim_share=0.0, later_share=0.0,
                                      completion_len=12.0))]
    console = Console(width=80, record=True)
    console.print(eval_table(records, width=80))
    lines = console.export_text().splitlines()
    assert "heldout @3" in lines[2] and all(len(line) <= 80 for line in lines), lines
    rows = {line.split()[1]: line.split()[3] for line in lines if line.startswith("│ ")}
    assert rows["pass@1"] == "0.125" and rows["completion_len"] == "12.000" and rows["replaced"] == "1", rows
    wide = Console(width=300, record=True)
    wide.print(eval_table(records, width=300))
    assert "│ heldout │" in wide.export_text(), "a table that fits keeps a row per set"
