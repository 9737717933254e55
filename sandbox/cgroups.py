"""Per-host cgroups on the machine's cgroup v1 hybrid layout.

systemd-nspawn with --keep-unit creates its `payload/` and `supervisor/`
cgroups below the cgroup it was started from, so each host is started from a
cgroup of its own, made in both the named systemd hierarchy and the unified
(v2) hierarchy. Membership of these cgroups is also how teardown finds every
process of a host, without trusting recorded PIDs that may have been reused.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

HIERARCHIES = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))


def paths(name: str) -> list[Path]:
    """The cgroup directory of `name` in every hierarchy."""
    return [root / name for root in HIERARCHIES]


def create(name: str) -> None:
    """Make the cgroup `name` in every hierarchy; fail, leaving none, if it already exists."""
    made: list[Path] = []
    try:
        for path in paths(name):
            path.mkdir()
            made.append(path)
    except FileExistsError:
        for path in made:
            path.rmdir()
        raise


def attach(name: str, pid: int) -> None:
    """Move process `pid` into cgroup `name` in every hierarchy."""
    for path in paths(name):
        (path / "cgroup.procs").write_text(f"{pid}\n")


def pids(name: str) -> set[int]:
    """Every process in cgroup `name` or any cgroup below it."""
    found: set[int] = set()
    for path in paths(name):
        for procs in _tree(path, "cgroup.procs"):
            found.update(int(line) for line in _read(procs).split())
    return found


def cpu_usec(name: str) -> int | None:
    """CPU time used so far by every process of cgroup `name` and below (µs; the unified hierarchy's
    `cpu.stat`, present without the cpu controller), or None where it cannot be read."""
    for line in _read(HIERARCHIES[1] / name / "cpu.stat").splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec" and value.strip().isdigit():
            return int(value)
    return None


def kill(name: str, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process in cgroup `name` and below."""
    for pid in pids(name):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_empty(name: str, timeout: float) -> bool:
    """Wait until no process is left in cgroup `name`; return whether it emptied."""
    deadline = time.monotonic() + timeout
    while pids(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def remove(name: str) -> None:
    """Remove cgroup `name` and every cgroup below it (they must hold no process)."""
    for path in paths(name):
        if path.is_dir():
            for directory in sorted(_dirs(path), key=lambda p: len(p.parts), reverse=True):
                directory.rmdir()


def exists(name: str) -> bool:
    """Whether cgroup `name` exists in any hierarchy."""
    return any(path.exists() for path in paths(name))


def _dirs(path: Path) -> list[Path]:
    """`path` and all cgroup directories below it."""
    return [Path(top) for top, _subdirs, _files in os.walk(path)]


def _tree(path: Path, filename: str) -> list[Path]:
    """`filename` in `path` and in every cgroup below it."""
    return [directory / filename for directory in _dirs(path)] if path.is_dir() else []


def _read(path: Path) -> str:
    """Contents of a cgroup file, or "" if its cgroup vanished meanwhile."""
    try:
        return path.read_text()
    except OSError as error:  # ENOENT or ENODEV: removed while we read
        if error.errno in (errno.ENOENT, errno.ENODEV):
            return ""
        raise
