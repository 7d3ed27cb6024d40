"""A task whose examples are rows of a dataset file (`task.data`): the row's prompt and answer under
the recipe's keys, every other column passed to the reward as it is."""

from __future__ import annotations

import os

from prl.tasks.data import BadRow, DataError, DataSource, open_rows

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
    """A dataset function ((index, seed, min_len, max_len) -> example) over a file's rows. A row that cannot be an
    example raises BadRow naming the file and the row (`needs_answer`: the reward is a checker, which compares with
    the answer)."""

    def __init__(self, source: DataSource, prompt_key: str, answer_key: str, where: str, needs_answer: bool):
        self.source, self.prompt_key, self.answer_key, self.where = source, prompt_key, answer_key, where
        self.needs_answer = needs_answer

    def __call__(self, index: int, seed: int, min_len: int = 0, max_len: int = 0) -> dict:
        row = self.source.row_of(index, seed)
        return self.example(self.source.rows.row(row), row)

    def example(self, row: dict, at: int) -> dict:
        where = f"{self.where}: row {at}"
        if self.prompt_key not in row:
            raise BadRow(f"{where} has no {self.prompt_key!r} column (it has {', '.join(map(str, row))}); set the key "
                         f"that holds the prompt (prompt_key)")
        prompt = row[self.prompt_key]
        if not (isinstance(prompt, str) or is_messages(prompt)):
            raise BadRow(f"{where}: the prompt ({type(prompt).__name__}) is neither a string nor a list of messages "
                         f"with 'role' and 'content'")
        out = {k: v for k, v in row.items() if k != "answer"}
        out["prompt"] = prompt
        answer = row.get(self.answer_key)
        if isinstance(answer, (list, dict)):
            raise BadRow(f"{where}: the answer ({self.answer_key!r}, {type(answer).__name__}) is neither a string nor "
                         f"a number")
        if answer is not None:
            out["answer"] = str(answer)
        elif self.needs_answer:
            raise BadRow(f"{where} has no {self.answer_key!r}, which the checker compares with (it has "
                         f"{', '.join(map(str, row))}); set answer_key")
        return out

    def first_rows(self) -> list[dict]:
        """The examples of the range's first rows in file order (the launch's check); BadRow naming a row."""
        return [self.example(self.source.rows.row(at), at)
                for at in range(self.source.start, self.source.start + min(CHECKED_ROWS, len(self.source)))]


def is_messages(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def file_dataset(cfg) -> FileDataset:
    """The dataset function of a TaskCfg with `data`."""
    from prl.tasks.checkers import CHECKERS

    source = open_source(cfg.data, cfg.rows, cfg.shuffle)
    return FileDataset(source, cfg.prompt_key, cfg.answer_key, cfg.data, needs_answer=cfg.reward in CHECKERS)


def row_count(cfg) -> int | None:
    """The rows a TaskCfg's dataset file gives (its `rows` range), or None for a task that generates examples."""
    return None if cfg.data is None else len(open_source(cfg.data, cfg.rows, cfg.shuffle))
