"""A user's code that fails during the run: the user's error, said in one line, never a fault to restart from.

Rules:
- an exception whose traceback passes through a file outside prl and outside Python's own libraries
  (a user's task, reward, dataset or environment) is the user's: `blame` names the innermost such
  frame (function, file and line), the exception and the example;
- what a user's function returns is checked where it crosses into prl (a reward, a `respond`, a
  `score`); a wrong value is a `UserCodeError` naming the function, whatever frame raised it;
- the orchestrator then stops the run (exit `EXIT_USER_ERROR`: the driver does not restart it) and
  writes the example to `user_error.json` in the run folder, or with `env.on_error = "drop"` drops
  that example and counts it; prl's own failures restart as before.
"""

from __future__ import annotations

import json
import sysconfig
import traceback
from pathlib import Path

EXIT_USER_ERROR = 3  # the orchestrator's exit code for a user's error: the run stops, nothing restarts
PRL_DIR = Path(__file__).resolve().parent
LIBRARY_DIRS = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")})


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


def is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(d) for d in (PRL_DIR, *LIBRARY_DIRS))


def blame(exc: BaseException) -> UserCodeError | None:
    """`exc` as the user's error when a user's file raised it (or called what raised it), else None."""
    if isinstance(exc, UserCodeError):
        return exc
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return UserCodeError(f"{f.name} ({f.filename}:{f.lineno}) raised {type(exc).__name__}: {exc}"[:400], detail=detail)


def write_example(run_dir: Path, error: UserCodeError, example: object) -> Path:
    """The failing example and the error beside it, for the user to reproduce it."""
    path = Path(run_dir) / "user_error.json"
    path.write_text(json.dumps({"error": str(error), "index": error.index, "example": example,
                                "traceback": error.detail}, indent=1, default=repr))
    return path
