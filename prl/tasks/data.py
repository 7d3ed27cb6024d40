"""Dataset files as a source of examples (`task.data`, `sft.data`, an eval set's `data`).

A file is opened as `Rows` (its row count and `row(i) -> dict`), read lazily where the format allows:
- `.jsonl`: one JSON object a line; an index of line offsets (8 bytes a row, 16 past 4 GB) is built by one pass, and
  a row is read from the file when asked for;
- a folder written by Hugging Face `datasets.save_to_disk`: its Arrow files memory-mapped (`datasets`,
  the `data` extra);
- `.parquet`: an Arrow table (`pyarrow`, the `data` extra), held in memory as columns;
- `.json` (a list of objects) and `.csv` (a header row): read whole into memory.

`DataSource` maps a run's example index to a row: `rows` (a range of the file, default all of it),
shuffled per epoch by the seed (epoch = index // rows), so an index names one example forever and a
resumed run continues the same order. Nothing is downloaded: a path that is not on disk is refused."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SCAN_CHUNK = 1 << 22
BLANK_CHECK = 16  # lines this short are read while indexing, and dropped when they hold only white space  # bytes read at a time while indexing a jsonl file


class DataError(ValueError):
    """A data file or key that cannot be used, in one line (the caller adds the recipe key)."""


class SkipExample(Exception):
    """An example a run will not use (a dataset row that cannot be read, or whose prompt is longer than the task
    allows): training consumes its index and starts the next one, counted (`skipped_examples`); an eval set leaves
    it out of its figures, counted (`skipped`); the warm start draws the next. The message says why."""


class BadRow(DataError, SkipExample):
    """A row of a dataset file that cannot be an example: refused when the launch checks the first rows, skipped
    (and counted) when a run meets it later."""


def open_rows(path: str | Path):
    """The rows of the file or `datasets` folder at `path`; DataError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        hub = "/" in str(path) and not str(path).startswith((".", "/", "~")) and not p.suffix
        hint = (" (prl reads files on this machine and downloads nothing: save a hub dataset with "
                "datasets.load_dataset(...).save_to_disk(folder) and give the folder)") if hub else ""
        raise DataError(f"{path}: no such file or folder{hint}")
    if p.is_dir():
        return arrow_folder(p)
    if p.suffix not in SUFFIXES:
        raise DataError(f"{path}: not a data file prl reads (.jsonl, .json, .parquet, .csv, or a datasets folder)")
    try:
        return {".jsonl": JsonlRows, ".json": json_rows, ".csv": csv_rows, ".parquet": parquet_rows}[p.suffix](p)
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path}: cannot be read as {p.suffix[1:]}: {one_line(e)}") from None


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


class ListRows:
    """Rows held in memory (json, csv)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict:
        return self.rows[i]


class JsonlRows:
    """A jsonl file read a row at a time through an index of where each non-blank line starts."""

    def __init__(self, path: Path):
        self.path, self.file = path, None
        self.starts, self.ends = line_index(path)

    def __len__(self) -> int:
        return len(self.starts)

    def row(self, i: int) -> dict:
        if self.file is None:
            self.file = open(self.path, "rb")  # noqa: SIM115 - held for the process's life, one per source
        line = read_at(self.file, int(self.starts[i]), int(self.ends[i]))
        try:
            out = json.loads(line)
        except ValueError as e:
            raise BadRow(f"{self.path}: row {i} is not JSON: {one_line(e)}") from None
        if not isinstance(out, dict):
            raise BadRow(f"{self.path}: row {i} is not a JSON object (a {type(out).__name__})")
        return out


def line_index(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of every non-blank line of `path`, read in chunks (never the whole file)."""
    newlines, size = [], 0
    with open(path, "rb") as f:
        while chunk := f.read(SCAN_CHUNK):
            newlines.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + size)
            size += len(chunk)
    dtype = np.uint32 if size < 2**32 else np.int64
    ends = np.empty(sum(map(len, newlines)) + 1, dtype)
    np.concatenate(newlines, out=ends[:-1], casting="unsafe") if newlines else None
    ends[-1] = size
    del newlines
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    keep = ends > starts  # ends >= starts always
    short = np.flatnonzero(keep & (ends - starts <= BLANK_CHECK))  # "\r", "  " and the like hold no row
    if len(short):
        with open(path, "rb") as f:
            keep[short] = [bool(read_at(f, int(starts[i]), int(ends[i])).strip()) for i in short]
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    return starts, ends


def read_at(f, start: int, end: int) -> bytes:
    return os.pread(f.fileno(), end - start, start)


def json_rows(path: Path) -> ListRows:
    data = json.loads(path.read_text())
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: a .json data file holds a list of objects (one per row); use .jsonl for one a line")
    return ListRows(data)


def csv_rows(path: Path) -> ListRows:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return ListRows(rows)


def parquet_rows(path: Path):
    pq = needs("pyarrow.parquet", "parquet files")
    try:
        table = pq.read_table(path, memory_map=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors are many classes; the file is at fault
        raise DataError(f"{path}: cannot be read as parquet: {one_line(e)}") from None
    return TableRows(table)


class TableRows:
    """An Arrow table read a row at a time."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, i: int) -> dict:
        return self.table.slice(i, 1).to_pylist()[0]


def arrow_folder(path: Path):
    """A folder written by `datasets`' `save_to_disk` (its Arrow files memory-mapped, as `datasets` opens them)."""
    if (path / "dataset_dict.json").exists():
        splits = ", ".join(sorted(d.name for d in path.iterdir() if d.is_dir()))
        raise DataError(f"{path}: a folder of several splits ({splits}); give one split's folder, e.g. {path}/train")
    if not (path / "state.json").exists():
        raise DataError(f"{path}: a folder, but not one datasets.save_to_disk wrote (no state.json); give a data "
                        f"file (.jsonl, .json, .parquet, .csv) or such a folder")
    datasets = needs("datasets", "a datasets folder")
    try:
        return DatasetRows(datasets.load_from_disk(str(path)))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        raise DataError(f"{path}: datasets cannot load the folder: {one_line(e)}") from None


class DatasetRows:
    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> dict:
        return self.ds[i]


def needs(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {module.partition('.')[0]} package: pip install 'prl[data]' "
                        f"(bin/prl installs it)") from None


class DataSource:
    """Example index -> row: the rows `[start, end)` of the file, in an order shuffled per epoch by the
    seed (`shuffle`), or in file order."""

    def __init__(self, rows, start: int = 0, end: int | None = None, shuffle: bool = True):
        self.rows, self.start = rows, start
        self.count = (len(rows) if end is None else min(end, len(rows))) - start
        self.shuffle, self.orders = shuffle, {}
        if self.count <= 0:
            raise DataError(f"holds no rows{'' if start == 0 and end is None else f' in rows [{start}, {end})'}")

    def __len__(self) -> int:
        return self.count

    def row_of(self, index: int, seed: int) -> int:
        """The file's row that example `index` reads."""
        epoch, k = divmod(index, self.count)
        return self.start + (int(self.order(seed, epoch)[k]) if self.shuffle else k)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self.orders:
            if len(self.orders) >= 2:  # groups finish out of order across an epoch's end: keep two epochs
                self.orders.pop(next(iter(self.orders)))
            dtype = np.int32 if self.count < 2**31 else np.int64
            self.orders[key] = np.random.default_rng([seed, epoch]).permutation(np.arange(self.count, dtype=dtype))
        return self.orders[key]

    def example(self, index: int, seed: int) -> dict:
        return self.rows.row(self.row_of(index, seed))
