"""Completed groups waiting to be trained, the staleness rule, and the length-bias ledger.

A group is trained at step s under trainer version s; a token's age is s minus the policy version
that sampled it. A token older than `max_off_policy_steps` is handled by `rl.stale_policy` when the
batch for step s is assembled, and counted:
- "mask" (default): the token is not trained (its loss mask is 0); the rest of its trajectory and
  its group are, so long trajectories are not thrown away for their old beginnings;
- "correct": the token is trained, the loss's importance ratio (trainer.loss.correction) corrects it;
- "drop": the whole group is dropped and a replacement starts (prl's rule before issue 22): the
  longest trajectories are the likeliest to be dropped, which `LengthLedger` makes visible.
Trajectories still running when new weights arrive always continue under them (in-flight updates),
each token keeping the version that sampled it.

Difficulty filtering (`rl.filter_groups`, `GroupFilter`) decides before a completed group enters the
buffer: a group whose rewards do not spread carries no learning signal and is dropped, a bounded
number per step, its prompt consumed like a stale group's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field

from prl.transport.batch import Sample

POLICIES = ("mask", "correct", "drop")


@dataclass
class Group:
    prompt_index: int
    samples: list[Sample]
    infos: list[dict] = field(default_factory=list)  # what the environment reported per trajectory
    teacher_kl: tuple[float, int] | None = None  # distillation: (sum, count) of log p_student - log p_teacher
    figures: dict = field(default_factory=dict)  # a reward model's sums over the group (`prl.orchestrator.rewards`)

    @property
    def min_version(self) -> int:
        """The oldest policy version among the group's model tokens (a trajectory may span several)."""
        return min((v for s in self.samples for v in s.model_versions()), default=1 << 62)

    @property
    def max_version(self) -> int:
        return max((v for s in self.samples for v in s.model_versions()), default=-1)


def stale_masked(sample: Sample, oldest: int) -> Sample:
    """`sample` with its model tokens older than version `oldest` masked out."""
    mask = sample.mask if sample.mask is not None else [1] * len(sample.completion_ids)
    new = [m if not m or v >= oldest else 0 for m, v in zip(mask, sample.versions)]
    return dataclasses.replace(sample, mask=new) if new != mask else sample


def percentile(ordered: list[int], q: float) -> float:
    """The `q` quantile of values already sorted."""
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


class LengthLedger:
    """Lengths (completion tokens) of every trajectory the run generated and of those it trained:
    the length bias of the staleness policy, shown every step."""

    def __init__(self):
        self.generated: list[int] = []
        self.accepted: list[int] = []
        self.dropped: list[int] = []

    def completed(self, group: Group) -> None:
        self.generated += [len(s.completion_ids) for s in group.samples]

    def trained(self, groups: list[Group]) -> None:
        self.accepted += [len(s.completion_ids) for g in groups for s in g.samples]

    def lost(self, groups: list[Group]) -> None:
        self.dropped += [len(s.completion_ids) for g in groups for s in g.samples]

    def dropped_by_decile(self, generated: list[int]) -> list[float]:
        """Share of the generated trajectories (`generated`: their lengths, sorted) in each length decile
        that were dropped."""
        if not self.dropped:
            return [0.0] * 10
        edges = [percentile(generated, q / 10) for q in range(1, 10)]
        made, lost = Counter(decile(n, edges) for n in self.generated), Counter(decile(n, edges) for n in self.dropped)
        return [round(lost[d] / made[d], 4) if made[d] else 0.0 for d in range(10)]

    def fields(self, batch: list[Sample]) -> dict:
        now = sorted(len(s.completion_ids) for s in batch)
        self.accepted.sort()  # sorted in place: the next sort of the same list is nearly free
        self.generated.sort()
        out = {}
        for name, values in (("len_batch", now), ("len_accepted", self.accepted), ("len_generated", self.generated)):
            out[f"{name}_mean"] = round(sum(values) / max(1, len(values)), 2)
            out[f"{name}_p90"] = percentile(values, 0.9)
            out[f"{name}_max"] = values[-1] if values else 0
        out["dropped_by_len_decile"] = self.dropped_by_decile(self.generated)
        return out


def decile(n: int, edges: list[float]) -> int:
    return sum(n >= e for e in edges)


def uniform(group: Group, min_std: float = 0.0) -> bool:
    """The group's rewards spread no more than `min_std` (population std; equal rewards give exactly 0,
    `statistics` sums exactly): its advantages are 0, or nearly, so it teaches nothing."""
    return statistics.pstdev([s.reward for s in group.samples]) <= min_std


class GroupFilter:
    """`rl.filter_groups = "uniform"` (DAPO's dynamic sampling): drops completed groups that are
    `uniform`, at most `bound` while one step's batch is assembled (from the previous batch shipped to
    this one). Past the bound uniform groups are trained, so a run whose every group is uniform (a task
    too easy or too hard) still trains each step with a full batch instead of sampling forever; the
    dropped prompts count as consumed in the data cursor of the next batch shipped. Nothing is dropped
    once the last step shipped (no batch would use the replacement)."""

    def __init__(self, mode: str, min_std: float, bound: int, max_steps: int):
        self.on, self.min_std, self.bound, self.max_steps = mode == "uniform", min_std, bound, max_steps
        self.step = 0  # the step whose batch is being assembled
        self.dropped: list[int] = []  # prompt indices dropped while assembling it
        self.total = 0  # dropped by this orchestrator

    def drops(self, group: Group) -> bool:
        """Whether to drop `group` (counted when it is)."""
        if not self.on or self.step >= self.max_steps or len(self.dropped) >= self.bound:
            return False
        if not uniform(group, self.min_std):
            return False
        self.dropped.append(group.prompt_index)
        self.total += 1
        return True

    def shipped(self, step: int) -> dict:
        """The batch of `step` ships: what was dropped while assembling it (`orch_step` fields); the
        next step starts counting from 0."""
        fields = {"groups_filtered": len(self.dropped), "groups_filtered_total": self.total,
                  "filtered_prompts": self.dropped}
        self.step, self.dropped = step + 1, []
        return fields


class GroupBuffer:
    def __init__(self, max_off_policy_steps: int, policy: str = "mask", group_filter: GroupFilter | None = None):
        if policy not in POLICIES:
            raise ValueError(f"stale policy {policy!r}: expected one of {POLICIES}")
        self.max_off_policy_steps, self.policy = max_off_policy_steps, policy
        self.filter = group_filter or GroupFilter("none", 0.0, 0, 0)
        self.groups: list[Group] = []
        self.dropped_samples = 0
        self.lengths = LengthLedger()

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: Group) -> bool:
        """Buffer a completed group; False when the filter drops it (the caller consumes its prompt)."""
        self.lengths.completed(group)
        if self.filter.drops(group):
            return False
        self.groups.append(group)
        return True

    def drop_stale(self, step: int) -> list[Group]:
        """Under the "drop" policy: drop and return the groups too old to train at `step`."""
        if self.policy != "drop":
            return []
        fresh = [g for g in self.groups if step - g.min_version <= self.max_off_policy_steps]
        dropped = [g for g in self.groups if step - g.min_version > self.max_off_policy_steps]
        self.groups = fresh
        self.dropped_samples += sum(len(g.samples) for g in dropped)
        self.lengths.lost(dropped)
        return dropped

    def take(self, n: int, step: int) -> tuple[list[Group], dict]:
        """The `n` oldest groups (first completed, first trained) for `step`, and the batch's token
        ages: `off_policy_hist` {age: model tokens} before the policy, `stale_tokens` older than the
        window (masked out under "mask", trained and corrected under "correct"; none under "drop",
        which dropped their groups before)."""
        taken, self.groups = self.groups[:n], self.groups[n:]
        self.lengths.trained(taken)
        ages = Counter(step - v for g in taken for s in g.samples for v in s.model_versions())
        oldest = step - self.max_off_policy_steps
        if self.policy == "mask":
            for g in taken:
                g.samples = [stale_masked(s, oldest) for s in g.samples]
        stale = sum(k for age, k in ages.items() if age > self.max_off_policy_steps)
        return taken, {"off_policy_hist": {str(a): ages[a] for a in sorted(ages)}, "stale_tokens": stale}


class DataCursor:
    """Which prompt indices the run has consumed (trained, or dropped as stale or filtered): every index below
    `position`, and `ahead` past it. Groups finish out of order (more so with `rl.overprovision`), so
    a batch may train index 9 while 7 is still running: a restart continues at `position` and skips
    `ahead`, so no prompt is lost and none trained twice."""

    def __init__(self, position: int = 0, ahead=()):
        self.position, self.ahead = position, set(ahead)
        self.advance()

    def consume(self, indices) -> None:
        self.ahead.update(i for i in indices if i >= self.position)
        self.advance()

    def advance(self) -> None:
        while self.position in self.ahead:
            self.ahead.remove(self.position)
            self.position += 1

    def next_free(self, index: int) -> int:
        """The first index from `index` on not consumed yet."""
        while index in self.ahead:
            index += 1
        return index

    def state(self) -> tuple[int, list[int]]:
        return self.position, sorted(self.ahead)
