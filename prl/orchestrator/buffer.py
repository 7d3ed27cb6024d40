"""Completed groups waiting to be trained, and the staleness rule.

Rule: nothing stale ships. A group is trained at step s under trainer version s; its off-policy
distance is s minus the oldest policy version among its tokens. A group farther than
`max_off_policy_steps` is dropped (and counted) when a batch for step s is assembled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prl.transport.batch import Sample


@dataclass
class Group:
    prompt_index: int
    samples: list[Sample]
    infos: list[dict] = field(default_factory=list)  # what the environment reported per trajectory

    @property
    def min_version(self) -> int:
        """The oldest policy version among the group's model tokens (a trajectory may span several)."""
        return min((v for s in self.samples for v in s.model_versions()), default=1 << 62)

    @property
    def max_version(self) -> int:
        return max((v for s in self.samples for v in s.model_versions()), default=-1)


class GroupBuffer:
    def __init__(self, max_off_policy_steps: int):
        self.max_off_policy_steps = max_off_policy_steps
        self.groups: list[Group] = []
        self.dropped_samples = 0

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: Group) -> None:
        self.groups.append(group)

    def drop_stale(self, step: int) -> list[Group]:
        """Drop and return the groups too old to train at `step`."""
        fresh = [g for g in self.groups if step - g.min_version <= self.max_off_policy_steps]
        dropped = [g for g in self.groups if step - g.min_version > self.max_off_policy_steps]
        self.groups = fresh
        self.dropped_samples += sum(len(g.samples) for g in dropped)
        return dropped

    def take(self, n: int) -> list[Group]:
        """The `n` oldest groups (first completed, first trained)."""
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken
