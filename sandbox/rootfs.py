"""Pristine Debian bookworm root filesystem for sandbox hosts.

Built once with debootstrap, post-processed, cached as a zstd tarball and
extracted to a pristine directory. Both artifacts are keyed by a hash of the
recipe (package list, suite, mirror, recipe version), so changing the recipe
builds a new rootfs instead of reusing a stale one. Hosts only ever use the
pristine directory as the read-only lower layer of an overlay mount.

The build shows one progress line (rewritten in place on a terminal); debootstrap's
whole output is kept in `<cache>/rootfs-<key>.debootstrap.log`, and a failure shows
its last lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
RECIPE_VERSION = 2
PACKAGES = (
    "ca-certificates",
    "curl",
    "dbus",
    "iproute2",
    "openssh-server",
    "patch",
    "procps",
    "python3",
    "python3-venv",
    "sudo",
    "systemd",
    "systemd-sysv",
)
#: Non-root login user present on every host, with passwordless sudo.
SUDO_USER = "ubuntu"
#: Units that would only try to reach the network or fight the console pipe.
MASKED_UNITS = ("apt-daily.timer", "apt-daily-upgrade.timer", "console-getty.service")
TAR_FLAGS = ("--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls")
DEFAULT_CACHE_DIR = "/var/cache/servestack/sandbox"

Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    """Default progress printer: one line on stderr, flushed at once."""
    print(f"[sandbox] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Directory holding tarballs and pristine trees (env SERVESTACK_SANDBOX_CACHE)."""
    return Path(os.environ.get("SERVESTACK_SANDBOX_CACHE") or DEFAULT_CACHE_DIR)


def recipe_key(packages: tuple[str, ...] = PACKAGES) -> str:
    """Short hash naming the cached artifacts of one recipe."""
    recipe = {
        "version": RECIPE_VERSION,
        "suite": SUITE,
        "mirror": MIRROR,
        "packages": sorted(packages),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def tarball_path(key: str) -> Path:
    """Cached zstd tarball of the post-processed rootfs."""
    return cache_dir() / f"rootfs-{key}.tar.zst"


def pristine_path(key: str) -> Path:
    """Extracted rootfs used as the overlay lower layer; never written to."""
    return cache_dir() / f"rootfs-{key}"


def ensure_rootfs(packages: tuple[str, ...] = PACKAGES, log: Log = log_stderr) -> Path:
    """Return the pristine rootfs directory, building and extracting it on first use.

    Safe to call from several processes at once: a file lock in the cache
    directory makes one of them build while the others wait.
    """
    key = recipe_key(packages)
    pristine = pristine_path(key)
    if pristine.is_dir():
        return pristine
    with _build_lock(key, log):
        if pristine.is_dir():
            return pristine
        tarball = tarball_path(key)
        if not tarball.is_file():
            build_tarball(tarball, packages, log)
        extract_tarball(tarball, pristine, log)
    return pristine


@contextlib.contextmanager
def _build_lock(key: str, log: Log) -> Iterator[None]:
    """Hold an exclusive lock on the cache entry `key`, saying so if we must wait."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".lock-{key}", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another process is building the sandbox rootfs; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_tarball(tarball: Path, packages: tuple[str, ...], log: Log) -> None:
    """debootstrap a fresh rootfs, post-process it and pack it into `tarball`."""
    work = tarball.with_name(tarball.name + ".build")
    _remove_stale(work)
    _debootstrap(work, packages, log)
    log("post-processing the root filesystem")
    postprocess(work)
    started = time.monotonic()
    partial = tarball.with_name(tarball.name + ".part")
    _pack(work, partial)
    partial.rename(tarball)
    log(f"packed {tarball} ({tarball.stat().st_size >> 20} MiB) in {time.monotonic() - started:.1f} s")
    shutil.rmtree(work)


def extract_tarball(tarball: Path, pristine: Path, log: Log) -> None:
    """Unpack `tarball` into `pristine` atomically (temporary dir, then rename)."""
    partial = pristine.with_name(pristine.name + ".part")
    _remove_stale(partial)
    partial.mkdir()
    started = time.monotonic()
    _run_pipeline(["zstd", "-dcq", str(tarball)], ["tar", *TAR_FLAGS, "-xpf", "-", "-C", str(partial)])
    partial.rename(pristine)
    log(f"extracted {pristine} in {time.monotonic() - started:.1f} s")


def postprocess(root: Path) -> None:
    """Make a debootstrapped tree fit to be copied into many isolated hosts."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text("nameserver 127.0.0.1\n")
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    dbus_id.unlink(missing_ok=True)
    dbus_id.symlink_to("/etc/machine-id")
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    _add_sudo_user(root)


def _add_sudo_user(root: Path) -> None:
    """Create the non-root login user with passwordless sudo."""
    subprocess.run(["useradd", "--root", str(root), "--create-home", "--shell", "/bin/bash", SUDO_USER], check=True)
    sudoers = root / "etc/sudoers.d" / SUDO_USER
    sudoers.write_text(f"{SUDO_USER} ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)


# debootstrap's lines for one package in each of its phases (others are not counted)
_PHASES = (
    ("retrieving", re.compile(r"^I: Retrieving ([a-z0-9][a-z0-9+.-]+) \S*\d\S*$")),
    ("extracting", re.compile(r"^I: Extracting ([a-z0-9][a-z0-9+.-]+)\.\.\.$")),
    ("unpacking", re.compile(r"^I: Unpacking ([a-z0-9][a-z0-9+.-]+)(:[a-z0-9]+)?\.\.\.$")),
    ("configuring", re.compile(r"^I: Configuring ([a-z0-9][a-z0-9+.-]+)(:[a-z0-9]+)?\.\.\.$")),
)
PROGRESS_TITLE = f"building the sandbox root filesystem (debootstrap {SUITE})"
LOG_TAIL_LINES = 25


class DebootstrapProgress:
    """debootstrap's output as one progress line: the phase and how many packages it has reached
    ("retrieving 37 packages", then "configuring 12/120 packages")."""

    def __init__(self) -> None:
        self.phase = "resolving packages"
        self.seen: dict[str, set[str]] = {phase: set() for phase, _ in _PHASES}

    def feed(self, line: str) -> bool:
        """Take one line of debootstrap's output; True when the progress text changed."""
        for phase, pattern in _PHASES:
            match = pattern.match(line.strip())
            if match:
                before = (self.phase, len(self.seen[phase]))
                self.phase = phase
                self.seen[phase].add(match.group(1))
                return (self.phase, len(self.seen[phase])) != before
        return False

    @property
    def packages(self) -> int:
        return len(self.seen["retrieving"])

    def text(self, elapsed: float | None = None) -> str:
        if self.phase == "retrieving":
            where = f"retrieving {self.packages} packages"
        elif self.phase in self.seen:
            where = f"{self.phase} {len(self.seen[self.phase])}/{self.packages or '?'} packages"
        else:
            where = self.phase
        return f"{PROGRESS_TITLE}: {where}" + ("" if elapsed is None else f" ({elapsed:.0f} s)")


class _ProgressLine:
    """One line of progress: rewritten in place on a terminal (with the default printer); printed
    once elsewhere (CI logs, or another printer), with the final line when done."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.live = log is log_stderr and sys.stderr.isatty()
        self.shown = ""

    def update(self, text: str) -> None:
        if self.live and text != self.shown:
            width = shutil.get_terminal_size().columns - 1  # a wrapped line cannot be rewritten
            sys.stderr.write(f"\r\x1b[K[sandbox] {text}"[:width + 4])
            sys.stderr.flush()
        elif not self.shown:
            self.log(text + "...")
        self.shown = text

    def done(self, text: str) -> None:
        if self.live:
            sys.stderr.write(f"\r\x1b[K[sandbox] {text}\n")
            sys.stderr.flush()
        else:
            self.log(text)


def debootstrap_log_path(target: Path) -> Path:
    """Where debootstrap's whole output is kept: beside the build directory, named after it."""
    return target.with_name(target.name.removesuffix(".build").removesuffix(".tar.zst") + ".debootstrap.log")


def _debootstrap(target: Path, packages: tuple[str, ...], log: Log) -> None:
    """Run debootstrap, showing one progress line; its whole output goes to a log file (kept),
    whose tail a failure shows."""
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        SUITE,
        str(target),
        MIRROR,
    ]
    log_path = debootstrap_log_path(target)
    progress, line = DebootstrapProgress(), _ProgressLine(log)
    started = time.monotonic()
    line.update(progress.text() + " (about 90 s)")
    with open(log_path, "w") as log_file, \
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for output in proc.stdout:
            log_file.write(output)
            if progress.feed(output):
                line.update(progress.text(time.monotonic() - started))
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        line.done(f"{PROGRESS_TITLE}: failed after {elapsed:.0f} s (rc {proc.returncode}); its log: {log_path}")
        tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise RuntimeError(f"debootstrap failed (rc {proc.returncode}); the last {len(tail)} lines of its "
                           f"log {log_path}:\n" + "\n".join(tail))
    line.done(f"{PROGRESS_TITLE}: {progress.packages} packages in {elapsed:.0f} s; its log: {log_path}")


def _pack(root: Path, dest: Path) -> None:
    """tar + zstd `root` into `dest`, keeping owners, modes, xattrs and ACLs."""
    _run_pipeline(
        ["tar", *TAR_FLAGS, "-cpf", "-", "-C", str(root), "."],
        ["zstd", "-q", "-T2", "-3", "-f", "-o", str(dest)],
    )


def _run_pipeline(first: list[str], second: list[str]) -> None:
    """Run `first | second`, raising if either side fails."""
    with subprocess.Popen(first, stdout=subprocess.PIPE) as producer:
        assert producer.stdout is not None
        with subprocess.Popen(second, stdin=producer.stdout) as consumer:
            producer.stdout.close()  # so the producer gets SIGPIPE if the consumer dies
    if producer.returncode or consumer.returncode:
        raise RuntimeError(f"{' '.join(first)} | {' '.join(second)} failed")


def _remove_stale(path: Path) -> None:
    """Remove a leftover from an interrupted build, refusing if anything is mounted in it."""
    if not path.exists():
        return
    mounted = mounts_under(path)
    if mounted:
        raise RuntimeError(f"refusing to remove {path}: still mounted there: {', '.join(mounted)}")
    shutil.rmtree(path)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this process's mount namespace."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points
