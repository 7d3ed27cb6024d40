"""Built-in toy tasks: reverse, sort, add. Each example is a function of (seed, index) only,
so the data order is reproducible and a resumed run continues it."""

from __future__ import annotations

import math
import random

LETTERS = "abcdefgh"


def _rng(seed: int, index: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def _word(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


def reverse_dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    w = _word(_rng(seed, index), min_len, max_len)
    return {"prompt": f"rev:{w}=", "answer": w[::-1]}


def reverse_long_tail_dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    """Reversal with log-normal word lengths: median `min_len`, sigma 1 (p99 about 10x the median),
    cut at `max_len`: most answers are short, a few long (the long tail of agentic rollouts, in small)."""
    rng = _rng(seed, index)
    n = max(1, min(max_len, round(min_len * math.exp(rng.gauss(0.0, 1.0)))))
    w = "".join(rng.choice(LETTERS) for _ in range(n))
    return {"prompt": f"rev:{w}=", "answer": w[::-1]}


def sort_dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    w = _word(_rng(seed, index), min_len, max_len)
    return {"prompt": f"sort:{w}=", "answer": "".join(sorted(w))}


def add_dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    """Small-number addition; min_len/max_len bound the digits of each operand (capped at 4)."""
    rng = _rng(seed, index)
    digits = lambda: rng.randint(min(min_len, 4), min(max_len, 4))  # noqa: E731
    a, b = rng.randrange(10 ** digits()), rng.randrange(10 ** digits())
    return {"prompt": f"add:{a}+{b}=", "answer": str(a + b)}


def edit_similarity(completion: str, example: dict) -> float:
    """1 - Levenshtein(completion, answer) / max(len): 1.0 for an exact answer, in [0, 1]."""
    a, b = completion.strip(), example["answer"]
    if not a and not b:
        return 1.0
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return 1.0 - prev[-1] / max(len(a), len(b))


def exact_match(completion: str, example: dict) -> float:
    return float(completion.strip() == example["answer"])


BUILTIN = {
    "reverse": (reverse_dataset, edit_similarity),
    "reverse_long_tail": (reverse_long_tail_dataset, edit_similarity),
    "sort": (sort_dataset, edit_similarity),
    "add": (add_dataset, edit_similarity),
}
