"""Render a `RunState` with rich: processes, progress, staleness, evals, servers, reward, throughput, errors."""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from prl.tui.curves import curves_table
from prl.tui.evals import eval_line
from prl.tui.state import RunState

BLOCKS = "▁▂▃▄▅▆▇█"
STATE_STYLE = {"running": "green", "finished": "cyan", "done": "cyan", "failed": "bold red", "stopped": "yellow", "gone": "red"}


def sparkline(values: list[float], width: int = 40) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(BLOCKS[int((v - lo) / span * (len(BLOCKS) - 1))] for v in values)


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def processes_table(s: RunState) -> Table:
    t = Table(title="processes", expand=True, title_justify="left")
    for col in ("name", "role", "host", "pid", "state", "restarts"):
        t.add_column(col)
    for name, p in s.processes.items():
        state = p.get("state", "?")
        unit = "trainer" if p.get("role") == "trainer" else name
        t.add_row(name, p.get("role", ""), p.get("host", ""), str(p.get("pid", "")),
                  Text(state, style=STATE_STYLE.get(state, "")), str(s.restarts.get(unit, {}).get("count", 0)))
    return t


def restarts_lines(s: RunState) -> list[Text]:
    """One line per restarted unit: how often, and the last cause."""
    return [Text(f"restarted {name} {e['count']}/{e['max_restarts']}x, last: {e['cause']}", style="yellow")
            for name, e in s.restarts.items()]


def progress(s: RunState) -> Table:
    t = Table.grid(expand=True, padding=(0, 1))
    t.add_column(width=14)
    t.add_column(ratio=1)
    t.add_column(width=22)
    if s.sft:
        done, total = s.sft["step"] + 1, s.sft["total"]
        t.add_row("warm start", ProgressBar(total=total, completed=done), f"{done}/{total}  loss {fmt(s.sft.get('loss'))}")
    tr = s.trainer
    done, total = (tr["step"] + 1, tr["total"]) if tr else (0, s.run.get("max_steps", 1))
    t.add_row("RL step", ProgressBar(total=total, completed=done), f"{done}/{total}  version {tr.get('version', '-')}")
    return t


def metrics_table(s: RunState) -> Table:
    tr, o, ro = s.trainer, s.orch, s.rollouts
    t = Table(title="learning", expand=True, title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    curve = s.reward_curve()
    t.add_row("reward", f"{fmt(curve[-1] if curve else None)}  {sparkline(curve)}")
    t.add_row("loss / mismatch KL", f"{fmt(tr.get('loss'), '.4f')} / {fmt(tr.get('mismatch_kl'), '.2e')}"
              f"  extreme tokens {fmt(tr.get('extreme_token_frac'), '.2%')}"
              f"  routing agreement {fmt(tr.get('routing_agreement'), '.2%')}")
    t.add_row("rollouts in flight", f"{ro.get('inflight', '-')}  buffered {ro.get('buffered', '-')}"
              f"  uniform groups: filtered {o.get('groups_filtered_total', 0)}, trained {o.get('groups_uniform', 0)}")
    t.add_row("policy lag (steps)", f"mean {fmt(o.get('off_policy_mean'), '.2f')}  max {o.get('off_policy_max', '-')}"
              f"  stale: {o.get('stale_policy', '-')} {o.get('stale_tokens', 0)} tokens, dropped {o.get('stale_dropped_total', 0)}")
    t.add_row("lengths p90", f"trained {fmt(o.get('len_accepted_p90'), '.0f')}  generated {fmt(o.get('len_generated_p90'), '.0f')}")
    for label, line in [*env_rows(o), *model_rows(o)]:
        t.add_row(label, line)
    t.add_row("trainer tokens/s", fmt(tr.get("tokens_per_s"), ".0f"))
    t.add_row("step time", f"wait {fmt(tr.get('wait_s'), '.2f')}s  fwd-bwd {fmt(tr.get('fwd_bwd_s'), '.2f')}s"
              f"  publish {fmt(tr.get('publish_s'), '.2f')}s")
    if tr.get("comm_s"):  # expert or context parallelism: exchanges in the step
        t.add_row("exchanges", f"{fmt(tr['comm_s'], '.2f')}s in flight, {fmt(tr.get('exposed_comm_s'), '.2f')}s exposed"
                  f" ({fmt(1 - tr.get('exposed_comm_s', 0) / tr['comm_s'], '.0%')} hidden behind compute)")
    return t


def model_rows(o: dict) -> list[tuple[str, str]]:
    """Signals from models in the last step: a reward model's and a judge's scores and costs, the KL to a teacher."""
    rows = []
    if "reward_dropped" in o:
        rows.append(("rewards from models", f"task reward {fmt(o.get('task_reward'), '.3f')}  groups dropped "
                                            f"{o['reward_dropped']}"))
    if "reward_model_score" in o:
        rows.append(("reward model", f"score {fmt(o['reward_model_score'], '.3f')}  {o.get('reward_model_tokens', '-')}"
                                     f" tokens in {fmt(o.get('reward_model_s'), '.2f')}s"))
    if "judge_unparsed" in o:
        rows.append(("judge", f"score {fmt(o.get('judge_score'), '.3f')}  {o.get('judge_tokens', '-')} tokens in "
                              f"{fmt(o.get('judge_s'), '.2f')}s  unparsed {o['judge_unparsed']}"))
    if "teacher_kl" in o:
        rows.append(("teacher", f"KL to the teacher {fmt(o['teacher_kl'], '.3f')}"))
    return rows


def env_rows(o: dict) -> list[tuple[str, str]]:
    """The multi-turn environment's last step (`prl.envs.stats`), where the run has one."""
    if "env_turns_mean" not in o:
        return []
    rows = [("environment", f"turns {fmt(o['env_turns_mean'], '.2f')} (p50 {fmt(o.get('env_turns_p50'), '.0f')}, max "
                            f"{o.get('env_turns_max', '-')})  tool calls {fmt(o.get('env_tool_calls_per_turn'), '.2f')}"
                            f"/turn, errors {fmt(o.get('env_tool_errors_per_turn'), '.2f')}/turn  truncated "
                            f"{fmt(o.get('env_truncated_share'), '.0%')}  tokens env {o.get('env_tokens', '-')} / model "
                            f"{o.get('env_model_tokens', '-')}  re-tokenisation forks {o.get('env_retokenize_forks', '-')}")]
    if "sandbox_executions" in o:
        rows.append(("sandbox", f"executions {o['sandbox_executions']} (cached {o.get('sandbox_cached', 0)})  timeouts "
                                f"{o.get('sandbox_timeouts', 0)}  kills {o.get('sandbox_kills', 0)}  time "
                                f"{fmt(o.get('sandbox_s'), '.1f')}s  first attempt {fmt(o.get('first_attempt_success'), '.0%')}"
                                f"  second turn {fmt(o.get('second_turn_success'), '.0%')}"))
    return rows


def evals_table(s: RunState) -> list[Table]:
    """Per eval set, its last eval and the change since its first; nothing when the run has no evals."""
    summary = s.eval_summary()
    if not summary:
        return []
    t = Table(title="evaluation", expand=True, title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for name, e in summary.items():
        t.add_row(Text(name), Text(eval_line(e)))  # Text: a set's name is data, never markup
    return [t]


def servers_table(s: RunState) -> Table:
    t = Table(title="inference", expand=True, title_justify="left")
    for col in ("server", "version", "tokens/s", "running", "waiting", "busy", "state"):
        t.add_column(col)
    for name, m in s.servers.items():
        t.add_row(name, str(m["version"]), fmt(m["tokens_per_s"], ".0f"), str(m["running"]), str(m["waiting"]),
                  f"{m['busy_frac']:.0%}", s.server_states.get(name, "up"))
    return t


def sample_lines(s: RunState) -> list[Text]:
    """The latest kept sample, one line: its step, reward, prompt and completion (`prl samples` shows them whole)."""
    x = s.latest_sample
    if not x:
        return []
    line = f"latest sample  step {x['step']}  reward {x['reward']:.3f}  {x['prompt']!r} -> {x['completion']!r}"
    return [Text(line, no_wrap=True, overflow="ellipsis")]


def render(s: RunState, curves: bool = False, width: int = 100, hint: str = "") -> Panel:
    """The dashboard; with `curves` the whole-run curves panel too (key `c` in the live view)."""
    parts = [processes_table(s), *restarts_lines(s), progress(s), metrics_table(s), *evals_table(s),
             servers_table(s), *sample_lines(s)]
    if curves:
        parts.append(curves_table([(s.run.get("name", "run"), s.curves)], width - 4))  # inside the panel
    for name, line in s.errors.items():
        parts.append(Text(f"{name}: {line}", style="red"))
    end = s.run.get("ended", time.time())
    elapsed = end - s.run["started"] if s.run.get("started") else 0
    title = f"prl · {s.run.get('name', '?')} · {s.run.get('state', '?')} · {elapsed:.0f}s"
    return Panel(Group(*parts), title=title, title_align="left", subtitle=hint or None, subtitle_align="right")
