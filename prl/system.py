"""This machine's OS, asked without torch: whether it has a GPU (the driver and backend specs decide
what to refuse before any process starts), the parent-death signal every child process sets, and the
heap freeze every long-lived process makes once started."""

from __future__ import annotations

import ctypes
import gc
import shutil
import signal
import subprocess

PR_SET_PDEATHSIG = 1


def gpu_present() -> bool:
    """An NVIDIA GPU that `nvidia-smi -L` lists."""
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux `PR_SET_PDEATHSIG`); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the driver's teardown still applies
        pass


def freeze_heap() -> None:
    """Take every object alive now (modules, the model, the data) out of the garbage collector's passes
    (`gc.freeze`). The embedded server holds about 400k objects once it has served a few batches, and a full
    pass over them holds the GIL for about 150 ms (`bench/gc_pause.py`): each time one came, the engine's
    decode loop stood still that long behind another thread of its process. Called once a process has
    started; what it allocates later is collected as before."""
    gc.collect()
    gc.freeze()
