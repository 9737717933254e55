"""The host itself: CPU architecture, free disk space, and servestack's run lock.

The lock (`<servestack_state_dir>/lock`) is one JSON line::

    {"run_id": "...", "controller": "<control machine>:<pid>", "started": "<UTC>",
     "pid": <owner pid>, "owner_start": "<ticks>", "boot_id": "<kernel boot id>"}

A process id on the control machine means nothing on the host, so the lock names a process *on
the host* that lives exactly as long as the run's connection: the `sshd` session process the
locking command runs under (found by walking up from the shell). When the control machine dies,
its TCP connection closes, that sshd process exits, and the next run finds the lock stale (the
recorded pid is gone, or is another process: its start time differs, or the host rebooted).
With no sshd ancestor (a non-SSH connector) the lock is held until released or the host reboots.
A run's long remote commands (the CUDA installer) also hold `flock` on `lock.busy` while they
run: a lock whose connection is gone but whose installer still runs on the host is not stale.
The shell function `lock_alive` below is the single definition of "stale", used both by the
`HostLock` fact (preflight, doctor) and by the take-lock command.

Every take of the lock by a new run adds one to `<servestack_state_dir>/lock.generation`. A run that
read the host before it took the lock (pyinfra's prepare stage) knows those reads are still the
host's state when the generation it took is the one it read plus one: no other run held the lock
in between, and only a run holding it changes the host.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from pyinfra.api import FactBase

SECTION_MARK = "@@section "


def _q(value: str) -> str:
    return shlex.quote(value)


# Sections: several facts' commands in one remote command, each in its own subshell.

def combine_sections(sections: dict[str, str]) -> str:
    """One shell command running each `name -> command` in a subshell, output split by markers."""
    return "; ".join(f"echo {_q(SECTION_MARK + name)}; ( {command} )" for name, command in sections.items()) + "; true"


def split_sections(lines: list[str]) -> dict[str, list[str]]:
    """Group the output of `combine_sections` by section name."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(SECTION_MARK):
            current = line[len(SECTION_MARK):]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


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
    """Print `disk <path>\\t<df line>` for each path (or `diskerr <path>`)."""
    parts = []
    for path in paths:
        parts.append(
            f"p={_q(path)}; while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=$(dirname \"$p\"); done; "
            f"line=$(df -B1 --output=target,avail,size \"$p\" 2>/dev/null | tail -n 1); "
            f"if [ -n \"$line\" ]; then printf 'disk %s\\t%s\\n' {_q(path)} \"$line\"; "
            f"else printf 'diskerr %s\\n' {_q(path)}; fi"
        )
    return "; ".join(parts) or "true"


def parse_df_line(line: str) -> tuple[str, int, int]:
    """Parse a `df -B1 --output=target,avail,size` data line: (mount point, avail, size)."""
    tokens = line.split()
    if len(tokens) < 3:
        raise ValueError(f"unexpected df line {line!r}")
    return " ".join(tokens[:-2]), int(tokens[-2]), int(tokens[-1])


def parse_disks(lines: list[str]) -> dict[str, Disk | None]:
    disks: dict[str, Disk | None] = {}
    for line in lines:
        if line.startswith("disk "):
            path, _, df_line = line[5:].partition("\t")
            try:
                mount, avail, size = parse_df_line(df_line)
            except ValueError:
                disks[path] = None
                continue
            disks[path] = Disk(path, mount, avail, size)
        elif line.startswith("diskerr "):
            disks[line[8:]] = None
    return disks


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


# The run lock

LOCK_NAME = "lock"
GENERATION_NAME = "lock.generation"

# Shell helpers shared by the fact and the take/release commands. `field KEY FILE` reads one
# value of the lock's JSON line; `proc_start PID` is the process start time in clock ticks.
_LOCK_FUNCTIONS = r"""
field() { sed -n "s/.*\"$1\": *\"\{0,1\}\([^\",}]*\)\"\{0,1\}.*/\1/p" "$2" | head -n 1; }
proc_start() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }
boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null; }
busy() { [ -e "$1.busy" ] && command -v flock >/dev/null 2>&1 && ! flock -n "$1.busy" true; }
lock_alive() {
    [ "$(field boot_id "$1")" = "$(boot_id)" ] || return 1
    pid=$(field pid "$1")
    case "$pid" in ''|null) why=no-owner; return 0 ;; esac
    why=connection
    [ -n "$(proc_start "$pid")" ] && [ "$(proc_start "$pid")" = "$(field owner_start "$1")" ] && return 0
    why=busy
    busy "$1"
}
"""


def lock_path(state_dir: str) -> str:
    return f"{state_dir.rstrip('/')}/{LOCK_NAME}"


def busy_path(state_dir: str) -> str:
    """Held (flock) by a run's long remote commands while they run."""
    return lock_path(state_dir) + ".busy"


def generation_path(state_dir: str) -> str:
    """How many times a run took the lock (one integer; absent: never)."""
    return f"{state_dir.rstrip('/')}/{GENERATION_NAME}"


def lock_read_command(state_dir: str) -> str:
    lock = _q(lock_path(state_dir))
    return (_LOCK_FUNCTIONS +
            f"printf 'generation %s\\n' \"$(cat {_q(generation_path(state_dir))} 2>/dev/null)\"; "
            f"if [ -f {lock} ]; then printf '%s %s\\n' lock \"$(tr -d '\\n' < {lock})\"; "
            f"if lock_alive {lock}; then echo \"lock_alive 1 $why\"; else echo lock_alive 0; fi; fi")


@dataclass(frozen=True)
class LockState:
    """The lock as found: absent, held by a live run, or stale (its run's connection is gone)."""

    present: bool = False
    alive: bool = False
    info: dict | None = None
    why: str | None = None      # alive because: "connection", "busy" or "no-owner"
    generation: int = 0         # takes of the lock so far (lock.generation)

    @property
    def run_id(self) -> str | None:
        return (self.info or {}).get("run_id")

    def describe(self) -> str:
        info = self.info or {}
        return (f"run {info.get('run_id', '?')} from {info.get('controller', '?')}, "
                f"started {info.get('started', '?')}")

    def why_alive(self) -> str:
        return {"connection": "its connection is still open",
                "busy": "its connection is gone, but a command it started (download or installer) is "
                        "still running on the host",
                "no-owner": "it names no SSH session, so it holds until released or the host reboots",
                }.get(self.why or "", "it is still alive")


def parse_generation(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


def parse_lock(lines: list[str]) -> LockState:
    present, alive, info, why, generation = False, False, None, None, 0
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "generation":
            generation = parse_generation(rest)
        elif key == "lock":
            present = True
            try:
                info = json.loads(rest)
            except ValueError:
                info = {"invalid": rest}
        elif key == "lock_alive":
            flag, _, why = rest.strip().partition(" ")
            alive = flag == "1"
    return LockState(present, alive and present, info, (why or None) if alive else None, generation)


class HostLock(FactBase):
    """servestack's run lock on the host (see `LockState`).

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
    """Take the lock atomically for `run_id` (under `flock` on `lock.guard`).

    Prints `taken`, `ours` (already held by this run) or `stale <old lock>` then `taken`, each
    followed by `generation N` (a take by a new run adds one); exits 3 printing `held <lock>` when
    a live run holds it.
    """
    state = _q(state_dir.rstrip("/"))
    lock = _q(lock_path(state_dir))
    generation = _q(generation_path(state_dir))
    return _LOCK_FUNCTIONS + f"""
mkdir -p {state} || exit 1
command -v flock >/dev/null 2>&1 || {{ echo "servestack: 'flock' (util-linux) is needed on the host" >&2; exit 1; }}
exec 9>>{state}/lock.guard
flock -w 60 9 || {{ echo "servestack: timed out waiting for {state_dir}/lock.guard" >&2; exit 1; }}
if [ -f {lock} ]; then
    if [ "$(field run_id {lock})" = {_q(run_id)} ]; then echo ours; echo "generation $(cat {generation} 2>/dev/null)"; exit 0; fi
    if lock_alive {lock}; then printf '%s %s\\n' held "$(tr -d '\\n' < {lock})"; exit 3; fi
    printf '%s %s\\n' stale "$(tr -d '\\n' < {lock})"
    mv {lock} {lock}.stale-$(date -u +%Y%m%dT%H%M%SZ)
fi
p=$$; owner=null
while [ "$p" -gt 1 ] 2>/dev/null; do
    case "$(cat /proc/$p/comm 2>/dev/null)" in sshd|sshd-session) owner=$p; break ;; esac
    p=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f2)
done
start=""; [ "$owner" = null ] || start=$(proc_start $owner)
printf '{{"run_id": "%s", "controller": "%s", "started": "%s", "pid": %s, "owner_start": "%s", "boot_id": "%s"}}\\n' \\
    {_q(run_id)} {_q(controller)} {_q(started)} "$owner" "$start" "$(boot_id)" > {lock}.new.$$ && mv {lock}.new.$$ {lock} || exit 1
g=$(cat {generation} 2>/dev/null); case "$g" in ''|*[!0-9]*) g=0 ;; esac; g=$((g + 1))
echo "$g" > {generation}.new.$$ && mv {generation}.new.$$ {generation} || exit 1
exec 9>&-
echo taken
echo "generation $g"
"""


def release_lock_command(state_dir: str, run_id: str) -> str:
    """Remove the lock if `run_id` holds it; prints `released` or `not-ours`."""
    state = _q(state_dir.rstrip("/"))
    lock = _q(lock_path(state_dir))
    return _LOCK_FUNCTIONS + f"""
[ -d {state} ] || {{ echo not-ours; exit 0; }}
exec 9>>{state}/lock.guard
command -v flock >/dev/null 2>&1 && flock -w 60 9
if [ -f {lock} ] && [ "$(field run_id {lock})" = {_q(run_id)} ]; then rm -f {lock} && echo released; else echo not-ours; fi
"""
