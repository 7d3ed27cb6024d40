"""Estimators over n samples per example, each unbiased for k <= n samples drawn without replacement.

- pass@k = 1 - C(n - c, k) / C(n, k), c the correct samples (reward >= the set's threshold): the
  chance that at least one of k samples is correct (Chen et al., 2021);
- best@k = sum_i r_(i) C(i - 1, k - 1) / C(n, k), r_(1) <= ... <= r_(n): the expected best reward of
  k samples (pass@k for a reward that is not 0/1);
- maj@k: whether the answer most of k samples give (ties: the answer given first) is correct,
  averaged over every k-subset (where there are more than `MAJ_SUBSETS`, over that many uniformly random
  ones, drawn from one stream seeded by `seed`: the same estimate each time, within a few
  0.5 / sqrt(MAJ_SUBSETS) of the exact mean).
The mean reward is the mean over all samples (mean@k is the same for every k, so it is not repeated).
"""

from __future__ import annotations

import itertools
import random
from math import comb

MAJ_SUBSETS = 1000


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def best_at_k(rewards: list[float], k: int) -> float:
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"best@k needs 1 <= k <= n, got n={n} k={k}")
    ordered = sorted(rewards)
    return sum(r * comb(i, k - 1) for i, r in enumerate(ordered)) / comb(n, k)


def maj_at_k(answers: list[str], correct: list[bool], k: int, seed: int = 0) -> float:
    n = len(answers)
    if not 1 <= k <= n or len(correct) != n:
        raise ValueError(f"maj@k needs 1 <= k <= n answers with one verdict each, got n={n} k={k}")
    rng = random.Random(seed)  # one stream: each sampled subset its own draw
    subsets = (itertools.combinations(range(n), k) if comb(n, k) <= MAJ_SUBSETS else
               (rng.sample(range(n), k) for _ in range(MAJ_SUBSETS)))
    wins = total = 0
    for subset in subsets:
        wins += correct[majority(answers, subset)]
        total += 1
    return wins / total


def majority(answers: list[str], subset) -> int:
    """The member of `subset` whose answer most members give (the first such member on ties)."""
    counts: dict[str, int] = {}
    for i in subset:
        counts[answers[i]] = counts.get(answers[i], 0) + 1
    return max(subset, key=lambda i: (counts[answers[i]], -i))
