"""Tasks from the `reasoning-gym` package: `task.name = "reasoning_gym:<name>"` (the `envs` extra).

reasoning-gym generates its problems procedurally and scores them with each dataset's own
`score_answer`; nothing is downloaded at run time. `task.options` is the dataset's config (its
size and difficulty keys, e.g. `{ min_digits = 2 }`); `task.min_len`/`task.max_len` are unused.

Data order: a reasoning-gym dataset is a finite list of `size` items (item `k` drawn from
`Random(dataset seed + k)`), so prl index `i` is item `i % size` of chunk `i // size`, a dataset
whose seed is hashed from (run seed, chunk). Index -> item is then a pure function of (index,
seed) and a resumed run continues the same data; hashed chunk seeds keep the chunks' item seeds
apart (consecutive seeds would make chunk c+1 repeat chunk c shifted by one).

The prompt is the item's question; the reward scores the text inside the last `<answer>...</answer>`
of the completion, or the whole stripped completion when it has no such tags.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import math

PREFIX = "reasoning_gym:"
# In reasoning-gym 0.1.25 the items of these datasets depend on Python's per-process hash seed (they
# iterate over sets of strings): the same (index, seed) is another item in another process, so a
# resumed run, or the trainer's warm start, would not see the data the orchestrator saw. Refused.
HASH_SEED_DEPENDENT = frozenset({"isomorphic_strings", "knight_swap", "polynomial_multiplication",
                                 "ransom_note", "word_ladder"})
CHUNKS_CACHED = 4  # datasets kept built: the orchestrator reads indices in order, across one boundary at a time


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk `chunk`: hashed from (seed, chunk), below 2**31 so that `seed + item` stays
    a valid seed for the datasets that seed numpy with it."""
    digest = hashlib.blake2b(f"prl:{seed}:{chunk}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


def registry() -> dict:
    """reasoning-gym's datasets by name (importing the package registers them); a clear error when
    the `envs` extra is not installed."""
    try:
        import reasoning_gym  # noqa: F401
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ValueError(f"task.name = '{PREFIX}...' needs the reasoning-gym package ({e}); install prl's "
                         "'envs' extra: pip install -e '.[envs]' (bin/prl installs it)") from None
    return DATASETS


def check_name(name: str, datasets: dict, key: str = "task.name") -> None:
    """Refuse a name reasoning-gym does not have (with the closest ones) or whose items are not
    reproducible across processes."""
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(datasets)} tasks, e.g. {sorted(datasets)[:5]}"
        raise ValueError(f"{key} = '{PREFIX}{name}': reasoning-gym has no task {name!r}{hint}")
    if name in HASH_SEED_DEPENDENT:
        raise ValueError(f"{key} = '{PREFIX}{name}': its items depend on Python's hash seed (set order), so "
                         "an index is not the same problem in every process and a resumed run would see other "
                         "data; not supported")


def dataset_config(name: str, options: dict, datasets: dict) -> dict:
    """The dataset's config keywords from `task.options` (composite: its `datasets` list of tables
    `{ name, weight, config }` becomes reasoning-gym's `DatasetSpec`s, each name checked)."""
    if "seed" in options:
        raise ValueError("task.options.seed: prl derives each chunk's seed from run.seed; remove it")
    config = dict(options)
    if name == "composite":
        from reasoning_gym.composite import DatasetSpec

        specs = config.get("datasets") or []
        if not all(isinstance(s, dict) for s in specs):
            raise ValueError("task.options.datasets: a list of tables { name, weight, config }")
        for s in specs:
            check_name(str(s.get("name")), datasets, key="task.options.datasets[].name")
        config["datasets"] = [DatasetSpec(**{"config": {}, "weight": 1.0, **s}) for s in specs]
    return config


class ReasoningGymTask:
    """One reasoning-gym dataset as prl's dataset function (`__call__`) and reward (`reward`).
    Built datasets are cached per (seed, chunk); building chunk 0 up front checks the options."""

    def __init__(self, name: str, options: dict):
        datasets = registry()
        check_name(name, datasets)
        self.name, self.config = name, dataset_config(name, options, datasets)
        self.dataset = functools.lru_cache(maxsize=CHUNKS_CACHED)(self.build)
        self.size = self.dataset(0, 0).size

    def build(self, seed: int, chunk: int):
        """The reasoning-gym dataset of chunk `chunk` under run seed `seed`."""
        from reasoning_gym.factory import create_dataset

        try:
            return create_dataset(self.name, **self.config, seed=chunk_seed(seed, chunk))
        except (TypeError, AssertionError, ValueError, KeyError) as e:
            raise ValueError(f"task.options for '{PREFIX}{self.name}': {type(e).__name__}: {e}") from None

    def __call__(self, index: int, seed: int, min_len: int = 0, max_len: int = 0) -> dict:
        """Example `index`: the prompt, the reference answer (as text, for the SFT warm start), and
        the reasoning-gym item with where it came from (the reward scores against it)."""
        chunk, offset = divmod(index, self.size)
        item = self.dataset(seed, chunk)[offset]
        answer = item.get("answer")
        return {"prompt": str(item["question"]), "answer": "" if answer is None else str(answer),
                "item": item, "source": (seed, chunk)}

    def reward(self, completion: str, example: dict) -> float:
        """The dataset's own `score_answer` on the completion's answer, in [0, 1]; a scorer that raises
        (some parse the answer as a number) scores 0 instead of failing the rollout."""
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(completion) if "</answer>" in completion else None
        answer = tagged if tagged is not None else completion.strip()
        try:
            score = float(self.dataset(*example["source"]).score_answer(answer, example["item"]))
        except Exception:  # noqa: BLE001 - a third-party scorer on model text: any failure is a wrong answer
            return 0.0
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0


def reasoning_gym_task(name: str, options: dict) -> tuple:
    """(dataset function, reward function) for `task.name = "reasoning_gym:<name>"`."""
    task = ReasoningGymTask(name, options)
    return task, task.reward
