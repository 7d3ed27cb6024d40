"""How many rollouts the orchestrator keeps in flight: as many as the servers' KV can hold.

Each server's limit follows its KV usage (`Metrics.kv_usage`, the share of its KV capacity held),
additive increase, multiplicative decrease: a server above `rl.kv_usage_target` halves its limit
(requests beyond its KV would queue or be preempted there), one below it gains a group's worth
each time it is read (about once a second) while the orchestrator is using the limit it has. The
budget is the sum over the servers that are up, never above `rl.max_inflight_rollouts` and never
below one group. A server that reports no usage (an unbounded engine) keeps the cap's share.
"""

from __future__ import annotations


class InflightBudget:
    def __init__(self, cap: int, group_size: int, servers: int, target: float, prefill: list[int] = ()):
        self.cap, self.group, self.target = cap, group_size, target
        share = max(group_size, cap // max(1, servers - len(prefill)))  # the cap, shared, until a server fills
        self.limits = [0 if i in prefill else share for i in range(servers)]  # P/D: prefill servers generate nothing

    def observe(self, server: int, usage: float | None, inflight: int) -> None:
        """One reading of `server`'s KV usage while `inflight` rollouts are out (over all servers)."""
        if usage is None or not self.target or not self.limits[server]:
            return
        if usage > self.target:
            self.limits[server] = max(self.group, self.limits[server] // 2)
        elif inflight + self.group > self.total():  # the limit is what holds the orchestrator back
            self.limits[server] = min(self.cap, self.limits[server] + self.group)

    def total(self, up: list[bool] | None = None) -> int:
        """Rollouts allowed in flight now: the sum of the limits of the servers up, within [group, cap]."""
        limits = [n for i, n in enumerate(self.limits) if up is None or up[i]]
        return max(self.group, min(self.cap, sum(limits)))
