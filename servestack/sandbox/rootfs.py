"""Pristine Debian bookworm root filesystem for sandbox hosts.

Built once with debootstrap, post-processed, cached as a zstd tarball and
extracted to a pristine directory. Both artifacts are keyed by a hash of the
recipe (package list, suite, mirror, recipe version), so changing the recipe
builds a new rootfs instead of reusing a stale one. Hosts only ever use the
pristine directory as the read-only lower layer of an overlay mount.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
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
    started = time.monotonic()
    log(f"debootstrap {SUITE} into {work} (takes about 90 s)")
    _debootstrap(work, packages, log)
    log(f"debootstrap done in {time.monotonic() - started:.0f} s; post-processing")
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


def _debootstrap(target: Path, packages: tuple[str, ...], log: Log) -> None:
    """Run debootstrap, forwarding its progress lines to `log`."""
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        SUITE,
        str(target),
        MIRROR,
    ]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        tail = []
        for line in proc.stdout:
            tail = [*tail[-20:], line.rstrip()]
            log(f"  {line.rstrip()}")
    if proc.returncode != 0:
        raise RuntimeError(f"debootstrap failed (rc {proc.returncode}):\n" + "\n".join(tail))


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
