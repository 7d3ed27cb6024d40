"""A task no model can solve without its tool: each key's code is a hash, known only to the `get`
tool. `recipes/tool-tiny.toml` trains prl's tiny model to call `get` and answer with its result.
Use it as `task.dataset = "prl.tasks.lookup:dataset"`, `task.reward = "prl.tasks.lookup:reward"` and
`env.tools = ["prl.tasks.lookup:get"]`."""

from __future__ import annotations

import hashlib
import random

LETTERS = "abcdefgh"


def get(key: str) -> str:
    """The code of `key` (four hexadecimal digits)."""
    return hashlib.sha256(f"prl-lookup:{key}".encode()).hexdigest()[:4]


# the share of warm-start demonstrations that answer without calling `get` (a guess: the code cannot be
# derived from the key), the way a model not yet taught to rely on its tool behaves; RL learns it pays
DEMOS_WITHOUT_TOOL = 0.5


def dataset(index: int, seed: int, min_len: int, max_len: int) -> dict:
    rng = random.Random(seed * 1_000_003 + index)
    key = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
    calls = [] if rng.random() < DEMOS_WITHOUT_TOOL else [["get", {"key": key}]]
    return {"prompt": f"key:{key}=", "answer": get(key), "calls": calls}


def reward(completion: str, example: dict) -> float:
    """1 for the code, else its digits in place over the longer of answer and code: characters past the
    code's four count against it (else an answer that never ends would score as well as a short one)."""
    got, want = completion.strip(), example["answer"]
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want)) if got != want else 1.0
