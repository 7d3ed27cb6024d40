"""A task of your own: write every letter twice ("twice:abc=" -> "aabbcc").

prl calls `dataset(index, seed, min_len, max_len)` for example number `index` and `reward(completion,
example)` on each completion the model writes. An example is a pure function of its index and seed,
so a resumed run sees the same examples in the same order."""

import random


def dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    rng = random.Random(seed * 1_000_003 + index)
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(min_len, max_len)))
    # "prompt": what the model sees; "answer": what the reward compares with, and what the warm start
    # (the [sft] steps before RL) teaches the model to write
    return {"prompt": f"twice:{word}=", "answer": "".join(c + c for c in word)}


def reward(completion: str, example: dict) -> float:
    """1.0 for the right answer; else the share of its letters in the right place (the longer of
    the two counts, so an answer that runs on is not rewarded for it)."""
    got, want = completion.strip(), example["answer"]
    if got == want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)
