"""What a step's trajectories did, for the event log, the dashboard and the report: turns per
trajectory, tool calls and errors per turn, sandbox executions and how they ended, environment vs
model tokens, the share cut by a limit, and (code) how often a second attempt fixed a failed first."""

from __future__ import annotations

import statistics


def summarize(infos: list[dict]) -> dict:
    """One step's figures from its trajectories' `info` (empty for single-turn trajectories)."""
    infos = [i for i in infos if i]
    if not infos:
        return {}
    turns = [i.get("turns", 1) for i in infos]
    total_turns = sum(turns) or 1
    first_failed = [i for i in infos if i.get("attempts") and not i["attempts"][0]]
    fixed = [i for i in first_failed if len(i["attempts"]) > 1 and i["attempts"][1]]
    out = {
        "env_turns_mean": statistics.fmean(turns), "env_turns_p50": statistics.median(turns),
        "env_turns_max": max(turns),
        "env_tool_calls_per_turn": sum(i.get("tool_calls", 0) for i in infos) / total_turns,
        "env_tool_errors_per_turn": sum(i.get("tool_errors", 0) for i in infos) / total_turns,
        "env_truncated_share": sum(bool(i.get("truncated")) for i in infos) / len(infos),
        "env_tokens": sum(i.get("env_tokens", 0) for i in infos),
        "env_model_tokens": sum(i.get("model_tokens", 0) for i in infos),
    }
    if any("retokenize_forks" in i for i in infos):  # chat formats: see MultiTurnEnv.count_fork
        out["env_retokenize_forks"] = sum(i["retokenize_forks"] for i in infos if "retokenize_forks" in i)
    if any("executions" in i or "cached" in i for i in infos):  # a step of cache answers only is a code step too
        out.update(sandbox_executions=sum(i.get("executions", 0) for i in infos),
                   sandbox_cached=sum(i.get("cached", 0) for i in infos),
                   sandbox_timeouts=sum(i.get("timeouts", 0) for i in infos),
                   sandbox_kills=sum(i.get("kills", 0) for i in infos),
                   sandbox_s=round(sum(i.get("sandbox_s", 0.0) for i in infos), 3),
                   first_attempt_success=sum(bool(i.get("attempts")) and i["attempts"][0] for i in infos) / len(infos),
                   second_turn_success=len(fixed) / len(first_failed) if first_failed else None)
    return out
