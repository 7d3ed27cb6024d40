"""What accelerators this machine has, asked without torch (the driver and backend specs decide
what to refuse before any process starts)."""

from __future__ import annotations

import shutil
import subprocess


def gpu_present() -> bool:
    """An NVIDIA GPU that `nvidia-smi -L` lists."""
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
