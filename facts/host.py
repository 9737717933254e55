"""The host itself: CPU architecture, free disk space, and servestack's run lock.

The lock's behaviour (what it holds, when it is stale, take and release) is files/scripts/lock.sh;
here are the fact that reads it and the commands that take and release it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pyinfra.api import FactBase

from facts.framing import Section, split
from servestack.scripts import script_command


# Architecture

def arch_command() -> str:
    return "uname -m"


def parse_arch(lines: list[str]) -> str | None:
    text = " ".join(lines).strip()
    return text or None


class Arch(FactBase):
    """The CPU architecture (`uname -m`: x86_64, aarch64)."""

    def command(self) -> str:
        return arch_command()

    def process(self, output):
        return parse_arch(output)


# Disk space

@dataclass(frozen=True)
class Disk:
    """Free space for a path: measured on its nearest existing ancestor's filesystem."""

    path: str
    mount: str
    avail: int
    size: int


def disk_command(paths: tuple[str, ...]) -> str:
    """files/scripts/disk-free.sh for `paths` (what it prints: its header)."""
    return script_command("disk-free.sh", *paths)


def parse_df_line(line: str) -> tuple[str, int, int]:
    """Parse a `df -B1 --output=target,avail,size` data line: (mount point, avail, size)."""
    tokens = line.split()
    if len(tokens) < 3:
        raise ValueError(f"unexpected df line {line!r}")
    return " ".join(tokens[:-2]), int(tokens[-2]), int(tokens[-1])


def parse_disks(lines: list[str]) -> dict[str, Disk | None]:
    """`disk_command`'s output: {path: Disk, or None when df could not say}."""
    disks: dict[str, Disk | None] = {}
    paths = [line[9:] for line in lines if line.startswith("diskpath ")]
    if "dfall" in lines:
        rows = lines[lines.index("dfall") + 2:]   # after df's header: one line per path, in order
        for index, path in enumerate(paths):
            disks[path] = _disk(path, rows[index]) if index < len(rows) else None
        return disks
    for line in lines:
        if line.startswith("disk "):
            path, _, df_line = line[5:].partition("\t")
            disks[path] = _disk(path, df_line)
        elif line.startswith("diskerr "):
            disks[line[8:]] = None
    return disks


def _disk(path: str, df_line: str) -> Disk | None:
    try:
        mount, avail, size = parse_df_line(df_line)
    except ValueError:
        return None
    return Disk(path, mount, avail, size)


class DiskSpace(FactBase):
    """Free bytes for each of `paths` (a missing path: its nearest existing parent).

    + paths: absolute paths
    """

    def command(self, paths):
        return disk_command(tuple(paths))

    @staticmethod
    def default():
        return {}

    def process(self, output):
        return parse_disks(output)


# The run lock (files/scripts/lock.sh)

def lock_read_command(state_dir: str) -> str:
    return script_command("lock.sh", "read", state_dir)


@dataclass(frozen=True)
class LockState:
    """The lock as found: absent, held by a live run, or stale (its run's connection is gone)."""

    present: bool = False
    alive: bool = False
    info: dict | None = None
    why: str | None = None      # alive because: "connection", "busy" or "no-owner"
    activity: dict | None = None  # what a long command of a run does, or did when interrupted (busy.sh)
    rebooted: bool = False        # stale because the host booted since it was taken

    @property
    def run_id(self) -> str | None:
        return (self.info or {}).get("run_id")

    def describe(self) -> str:
        info = self.info or {}
        return (f"run {info.get('run_id', '?')} from {info.get('controller', '?')}, "
                f"started {info.get('started', '?')}")

    def doing(self) -> str | None:
        """`'venv build r-...' (since T, pid P)` from the activity record, if any."""
        if not self.activity:
            return None
        return (f"'{self.activity.get('step', '?')}' (since {self.activity.get('since', '?')}, "
                f"pid {self.activity.get('pid', '?')})")

    def why_alive(self) -> str:
        if self.why == "busy" and self.doing():
            return f"its connection is gone, but {self.doing()} it started is still running on the host"
        return {"connection": "its connection is still open",
                "busy": "its connection is gone, but a command it started (download or installer) is "
                        "still running on the host",
                "no-owner": "it names no SSH session, so it holds until released or the host reboots",
                }.get(self.why or "", "it is still alive")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {"invalid": text}
    return value if isinstance(value, dict) else {"invalid": text}


def found_lock(lock: Section, activity: Section | None = None) -> LockState:
    """A lock lock.sh printed (`lock`, `held` or `stale`: its JSON line), with its activity."""
    return LockState(True, info=_json_object(lock.text), activity=_json_object(activity.text) if activity else None)


def parse_lock(lines: list[str]) -> LockState:
    """What lock.sh `read` printed (its sections, facts/framing.py) as a LockState."""
    sections = split(lines)
    if "lock" not in sections:
        return LockState()
    found = found_lock(sections["lock"], sections.get("activity"))
    flag, _, why = sections.get("lock_alive", Section(None, ())).text.strip().partition(" ")
    alive = flag == "1"
    return replace(found, alive=alive, why=(why or None) if alive else None, rebooted=not alive and why == "rebooted")


class HostLock(FactBase):
    """
    servestack's run lock on the host (see ``LockState``).

    + state_dir: servestack's state directory
    """

    def command(self, state_dir):
        return lock_read_command(state_dir)

    @staticmethod
    def default():
        return LockState()

    def process(self, output):
        return parse_lock(output)


def take_lock_command(state_dir: str, run_id: str, controller: str, started: str) -> str:
    """Take the lock for `run_id`, creating the state directory if missing (lock.sh `take`)."""
    return script_command("lock.sh", "take", state_dir, run_id, controller, started)


def release_lock_command(state_dir: str, run_id: str) -> str:
    """Remove the lock if `run_id` holds it; prints `released` or `not-ours` (lock.sh `release`)."""
    return script_command("lock.sh", "release", state_dir, run_id)
