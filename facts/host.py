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
    """Print `diskpath <path>` for each path, then `df` of their nearest existing parents in one
    call (`dfall`, its header, a line per path), or, when that call fails, `disk <path>\t<df line>`
    (or `diskerr <path>`) path by path."""
    if not paths:
        return "true"
    quoted = " ".join(_q(path) for path in paths)
    one_by_one = "; ".join(
        f"line=$(df -B1 --output=target,avail,size \"$1\" 2>/dev/null | tail -n 1); "
        f"if [ -n \"$line\" ]; then printf 'disk %s\\t%s\\n' {_q(path)} \"$line\"; "
        f"else printf 'diskerr %s\\n' {_q(path)}; fi; shift"
        for path in paths
    )
    return (
        f"set --; for p in {quoted}; do printf 'diskpath %s\\n' \"$p\"; "
        "while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=${p%/*}; p=${p:-/}; done; set -- \"$@\" \"$p\"; done; "
        "if out=$(df -B1 --output=target,avail,size \"$@\" 2>/dev/null); then printf 'dfall\\n%s\\n' \"$out\"; "
        f"else {one_by_one}; fi"
    )


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


# The run lock

LOCK_NAME = "lock"
GENERATION_NAME = "lock.generation"

# Shell helpers shared by the fact and the take/release commands. `field KEY FILE` reads one
# value of the lock's JSON line (the first line naming KEY, as `sed | head -n 1` would);
# `proc_start PID` is the process start time in clock ticks (field 22 of /proc/PID/stat);
# `first_line FILE` is a file's first line. Shell builtins only: the take and the release run on
# every converge of every host, and each program started costs a host ~1.5 ms of CPU.
_LOCK_FUNCTIONS = r"""
first_line() { l=; { IFS= read -r l < "$1"; } 2>/dev/null; printf '%s\n' "$l"; }
field() {
    { while IFS= read -r l || [ -n "$l" ]; do
        case "$l" in *"\"$1\":"*) ;; *) continue ;; esac
        v=${l##*"\"$1\":"}; while [ "${v# }" != "$v" ]; do v=${v# }; done
        v=${v#\"}; printf '%s\n' "${v%%[\",\}]*}"; return 0
    done < "$2"; } 2>/dev/null
}
proc_start() { l=$(first_line "/proc/$1/stat"); [ -n "$l" ] || return 0; set -- ${l##*) }; [ $# -ge 20 ] && eval 'printf "%s\n" "${20}"'; }
boot_id() { first_line /proc/sys/kernel/random/boot_id; }
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
            f"printf 'generation %s\\n' \"$(first_line {_q(generation_path(state_dir))})\"; "
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
[ -d {state} ] || mkdir -p {state} || exit 1
command -v flock >/dev/null 2>&1 || {{ echo "servestack: 'flock' (util-linux) is needed on the host" >&2; exit 1; }}
exec 9>>{state}/lock.guard
flock -w 60 9 || {{ echo "servestack: timed out waiting for {state_dir}/lock.guard" >&2; exit 1; }}
if [ -f {lock} ]; then
    if [ "$(field run_id {lock})" = {_q(run_id)} ]; then echo ours; echo "generation $(first_line {generation})"; exit 0; fi
    if lock_alive {lock}; then printf '%s %s\\n' held "$(tr -d '\\n' < {lock})"; exit 3; fi
    printf '%s %s\\n' stale "$(tr -d '\\n' < {lock})"
    mv {lock} {lock}.stale-$(date -u +%Y%m%dT%H%M%SZ)
fi
p=$$; owner=null
while [ "$p" -gt 1 ] 2>/dev/null; do
    case "$(first_line /proc/$p/comm)" in sshd|sshd-session) owner=$p; break ;; esac
    l=$(first_line /proc/$p/stat); set -- ${{l##*) }}; p=${{2:-0}}
done
start=""; [ "$owner" = null ] || start=$(proc_start $owner)
printf '{{"run_id": "%s", "controller": "%s", "started": "%s", "pid": %s, "owner_start": "%s", "boot_id": "%s"}}\\n' \\
    {_q(run_id)} {_q(controller)} {_q(started)} "$owner" "$start" "$(boot_id)" > {lock}.new.$$ && mv {lock}.new.$$ {lock} || exit 1
g=$(first_line {generation}); case "$g" in ''|*[!0-9]*) g=0 ;; esac; g=$((g + 1))
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
