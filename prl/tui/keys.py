"""Single keys from the terminal during the live dashboard (`c` toggles the curves panel).

The terminal is put in cbreak mode (keys arrive without Enter, Ctrl-C still interrupts) and restored
on exit; a daemon thread reads stdin. Without a terminal on stdin it does nothing.
"""

from __future__ import annotations

import os
import queue
import sys
import threading


class KeyReader:
    def __init__(self):
        self.keys: queue.Queue[str] = queue.Queue()
        self.saved = None

    def __enter__(self) -> "KeyReader":
        if not sys.stdin.isatty():
            return self
        import termios
        import tty

        fd = sys.stdin.fileno()
        self.saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        threading.Thread(target=self._read, args=(fd,), name="keys", daemon=True).start()
        return self

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 1)
            except OSError:
                return
            if not data:
                return
            self.keys.put(data.decode(errors="replace"))

    def pressed(self) -> set[str]:
        out = set()
        while not self.keys.empty():
            out.add(self.keys.get_nowait())
        return out

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self.saved)
