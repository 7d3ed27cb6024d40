"""A task whose examples are rows of a dataset file (`task.data`): the row's prompt and answer under
the recipe's keys, every other column passed to the reward as it is."""

from __future__ import annotations

import os

from prl.tasks.data import DataError, DataSource, open_rows

CHECKED_ROWS = 8  # rows whose keys the launch checks


READERS: dict[str, object] = {}  # one reader per file in a process (the warm start, RL and eval sets share its index)


def shared_rows(path: str):
    key = os.path.realpath(path)
    if key not in READERS:
        READERS[key] = open_rows(path)  # its errors name the path as the recipe gives it
    return READERS[key]


def open_source(path: str, rows: list[int] | None, shuffle: bool) -> DataSource:
    start, end = rows or (0, None)
    reader = shared_rows(path)
    try:
        return DataSource(reader, start, end, shuffle)
    except DataError as e:
        raise DataError(f"{path}: {e}") from None


class FileDataset:
    """A dataset function ((index, seed, min_len, max_len) -> example) over a file's rows."""

    def __init__(self, source: DataSource, prompt_key: str, answer_key: str, where: str):
        self.source, self.prompt_key, self.answer_key, self.where = source, prompt_key, answer_key, where

    def __call__(self, index: int, seed: int, min_len: int = 0, max_len: int = 0) -> dict:
        row = self.source.row_of(index, seed)
        return self.example(self.source.rows.row(row), row)

    def example(self, row: dict, at: int) -> dict:
        if self.prompt_key not in row:
            raise DataError(f"{self.where}: row {at} has no {self.prompt_key!r} column (it has {', '.join(map(str, row))}"
                            f"); set the key that holds the prompt (prompt_key)")
        out = dict(row)
        out["prompt"] = row[self.prompt_key]
        if self.answer_key in row and row[self.answer_key] is not None:
            out["answer"] = str(row[self.answer_key])
        return out

    def check(self, needs_answer: bool) -> None:
        """The first rows hold the keys (and an answer where the reward is a checker); DataError naming the row."""
        for at in range(self.source.start, self.source.start + min(CHECKED_ROWS, len(self.source))):
            ex = self.example(self.source.rows.row(at), at)
            if needs_answer and "answer" not in ex:
                raise DataError(f"{self.where}: row {at} has no {self.answer_key!r} column, which the checker compares "
                                f"with (it has {', '.join(map(str, ex))}); set answer_key")


def file_dataset(cfg) -> FileDataset:
    """The dataset function of a TaskCfg with `data`."""
    source = open_source(cfg.data, cfg.rows, cfg.shuffle)
    return FileDataset(source, cfg.prompt_key, cfg.answer_key, cfg.data)


def row_count(cfg) -> int | None:
    """The rows a TaskCfg's dataset file gives (its `rows` range), or None for a task that generates examples."""
    return None if cfg.data is None else len(open_source(cfg.data, cfg.rows, cfg.shuffle))
