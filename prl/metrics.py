"""The run's event log: every process appends JSON lines to runs/NAME/metrics.jsonl.

Each line is written with one O_APPEND write, so lines from different processes never interleave.
The TUI and `prl status` fold this one file into a snapshot (`prl.tui.state`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: str | Path, source: str):
        self.path = Path(path)
        self.source = source
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, **fields) -> None:
        line = json.dumps({"t": round(time.time(), 3), "src": self.source, "kind": kind, **fields}) + "\n"
        append_lines(self.path, line.encode())


def append_lines(path: str | Path, data: bytes) -> None:
    """Whole lines in one O_APPEND write: writers in other processes never interleave with them."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_events(path: str | Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete lines from byte `offset`; returns the events and the offset to continue from."""
    path = Path(path)
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    events = []
    for raw in data[:end].splitlines():
        try:
            events.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return events, offset + end


@contextlib.contextmanager
def reporting_errors(log: EventLog, name: str):
    """Run a process's main body; an exception that ends it becomes a typed `error` event (name,
    exception type, message) before it propagates: the driver, TUI and `prl status` read the cause
    from here, not from log tails. A normal stop (Ctrl-C, SystemExit 0) is not an error."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code not in (0, None):
            log.emit("error", name=name, type="SystemExit", line=str(e.code)[:300])
        raise
    except BaseException as e:
        from prl.usercode import UserCodeError

        if isinstance(e, UserCodeError):  # already one line naming the user's function
            log.emit("error", name=name, type="UserCodeError", line=str(e)[:600], user=True)
        else:
            log.emit("error", name=name, type=type(e).__name__, line=f"{type(e).__name__}: {e}"[:300])
        raise
