"""Another process holding `flock` on a file, as a second run or a long step on a host would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


@contextlib.contextmanager
def flock_held(path: Path):
    """`flock PATH sleep 30` in a process group of its own, until the lock is taken; killed (flock
    and the sleep) on leaving."""
    holder = subprocess.Popen(["flock", str(path), "sleep", "30"], start_new_session=True)
    try:
        for _ in range(100):
            if path.exists() and subprocess.run(["flock", "-n", str(path), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"flock on {path} was not taken")
        yield
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
