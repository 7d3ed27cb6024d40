"""Writes small arithmetic word problems as dataset files, the data of `recipes/math-tiny.toml`:

- `word-problems/train.jsonl`: {"prompt", "answer"} rows RL draws from (the `math` checker scores them),
- `word-problems/sft.jsonl`: {"prompt", "completion"} rows of other problems, each worked as "a+b=c",
  which the warm start learns to write,
- `word-problems/test.jsonl`: held-out problems (no prompt of it is in the other two files).

Problems are written in the alphabet of prl's tiny tokenizer (lower case, digits, spaces, `,:=+-*`) with
varied names, objects, units and numbers; every answer is a whole number. Run it again to write the same
files: `python examples/data/make_word_problems.py` (`--out`, `--seed`, and the sizes are options)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["ana", "ben", "carla", "dev", "emma", "farid", "gus", "hana", "ivan", "june", "kofi", "lena", "mo", "nia"]
THINGS = ["apples", "pens", "books", "stamps", "marbles", "cards", "shells", "coins", "cookies", "stickers"]
UNITS = [("km", "walked"), ("km", "cycled"), ("minutes", "read"), ("minutes", "practised"), ("liters", "poured")]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


def add(rng: random.Random) -> tuple[str, str]:
    n, t, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 20), rng.randint(1, 20)
    return f"{n} has {a} {t} and gets {b} more, how many {t} does {n} have now=", f"{a}+{b}={a + b}"


def sub(rng: random.Random) -> tuple[str, str]:
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(5, 25)
    b = rng.randint(1, a - 1)
    return f"{n} had {a} {t} and gave away {b}, how many {t} are left=", f"{a}-{b}={a - b}"


def days(rng: random.Random) -> tuple[str, str]:
    n, (unit, verb) = rng.choice(NAMES), rng.choice(UNITS)
    d1, d2 = rng.sample(DAYS, 2)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{n} {verb} {a} {unit} on {d1} and {b} {unit} on {d2}, how many {unit} in all=", f"{a}+{b}={a + b}"


def times(rng: random.Random) -> tuple[str, str]:
    t, a, b = rng.choice(THINGS), rng.randint(2, 5), rng.randint(2, 5)
    return f"there are {a} boxes with {b} {t} in each box, how many {t} in total=", f"{a}*{b}={a * b}"


KINDS = [add, sub, days, times]


def problems(rng: random.Random, count: int, seen: set[str]) -> list[tuple[str, str]]:
    """`count` problems whose prompts are not in `seen` (added to it)."""
    out = []
    while len(out) < count:
        prompt, worked = rng.choice(KINDS)(rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, worked))
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "word-problems"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--sft", type=int, default=8000)
    ap.add_argument("--test", type=int, default=200)
    a = ap.parse_args()
    rng, seen, out = random.Random(a.seed), set(), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    test = problems(rng, a.test, seen)
    write(out / "test.jsonl", [{"prompt": p, "answer": w.rpartition("=")[2]} for p, w in test])
    write(out / "train.jsonl", [{"prompt": p, "answer": w.rpartition("=")[2]} for p, w in problems(rng, a.train, seen)])
    write(out / "sft.jsonl", [{"prompt": p, "completion": w} for p, w in problems(rng, a.sft, seen)])
    print(f"wrote {a.test} test, {a.train} train and {a.sft} sft rows to {out}")


if __name__ == "__main__":
    main()
