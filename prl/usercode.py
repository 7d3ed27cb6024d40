"""A user's code that fails during the run: the user's error, said in one line, never a fault to restart from.

Rules:
- an exception raised in a user's file (a task, reward, dataset or environment: a file outside prl and
  outside Python's libraries), or in a library it called, is the user's: `blame` names that frame
  (function, file and line), the exception and the example; one raised inside prl (a server that kept
  failing under a user's `rollout`) is prl's, whoever called it;
- what a user's function returns is checked where it crosses into prl (a reward, a `respond`, a
  `score`); a wrong value is a `UserCodeError` naming the function, whatever frame raised it;
- the process logs it as an `error` event marked `user` (`prl.metrics.reporting_errors`), which the driver
  reads to stop the run instead of restarting the process (the orchestrator also exits with
  `EXIT_USER_ERROR`); the orchestrator writes the example to `user_error.json` in the run folder, or with
  `env.on_error = "drop"` drops that example and counts it; prl's own failures restart as before.
"""

from __future__ import annotations

import json
import site
import sys
import sysconfig
import traceback
from pathlib import Path

EXIT_USER_ERROR = 3  # the orchestrator's exit code for a user's error: the run stops, nothing restarts
PRL_DIR = Path(__file__).resolve().parent
LIBRARY_DIRS = tuple({Path(p).resolve() for p in (*(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                                        "platlib")),
                                                  *site.getsitepackages(), site.getusersitepackages(), sys.base_prefix)})
LIBRARY_PARTS = {"site-packages", "dist-packages"}  # a venv's, a system's or a conda's packages, wherever they are


class UserCodeError(Exception):
    """A user's function raised, or returned what prl cannot use; `line` says which and where."""

    def __init__(self, line: str, index: int | None = None, detail: str = ""):
        super().__init__(line)
        self.line, self.index, self.detail = line, index, detail

    def on_example(self, index: int) -> "UserCodeError":
        self.index = index
        return self

    def __str__(self) -> str:
        return self.line if self.index is None else f"{self.line} (example {self.index})"


def is_library(filename: str) -> bool:
    path = Path(filename).resolve()
    return bool(LIBRARY_PARTS & set(path.parts)) or any(path.is_relative_to(d) for d in LIBRARY_DIRS)


def is_user_file(filename: str) -> bool:
    return not filename.startswith("<") and not is_library(filename) and not Path(filename).resolve().is_relative_to(PRL_DIR)


def blame(exc: BaseException) -> UserCodeError | None:
    """`exc` as the user's error when the innermost frame of it outside Python's libraries is a user's file, else
    None (raised inside prl: prl's)."""
    if isinstance(exc, UserCodeError):
        return exc
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")
              and not is_library(f.filename)]
    if not frames or not is_user_file(frames[-1].filename):
        return None
    f = frames[-1]
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    said = " ".join(str(exc).split())
    return UserCodeError(f"{f.name} ({f.filename}:{f.lineno}) raised {type(exc).__name__}: {said}"[:400], detail=detail)


def described(e: BaseException) -> str:
    """An exception in one line: the user's function, file and line where a user's file raised it, else its type and
    message (a `sys.exit` said as such)."""
    user = blame(e)
    if user is not None:
        return str(user)
    if isinstance(e, SystemExit):
        return f"the code called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def write_example(run_dir: Path, error: UserCodeError, example: object) -> Path:
    """The failing example and the error beside it, for the user to reproduce it."""
    path = Path(run_dir) / "user_error.json"
    index = None if error.index is None else int(error.index)
    record = {"error": str(error), "index": index, "example": example, "traceback": error.detail}
    try:
        text = json.dumps(record, indent=1, default=repr)
    except (TypeError, ValueError):  # keys JSON cannot hold, a circular example
        text = json.dumps({**record, "example": repr(example)}, indent=1)
    path.write_text(text)
    return path
