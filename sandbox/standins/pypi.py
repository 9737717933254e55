"""Real wheels from PyPI, fetched once on the control machine with pip and kept in the sandbox cache.

Sandbox hosts reach no registry, so what they install from PyPI in production (uv, sglang and
what `import sglang` needs) is downloaded here for them, for their platform: CPython 3.11 on
x86_64 Debian bookworm (glibc 2.36: manylinux_2_34 and older). Downloads are kept under the sandbox cache
(env SERVESTACK_SANDBOX_CACHE, default /var/cache/servestack/sandbox). pip runs with no config
file and without this machine's find-links, so only PyPI answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandbox.rootfs import cache_dir
from sandbox.standins.stack import HOST_PYTHON

#: Every manylinux tag glibc 2.36 accepts (pip takes them one by one; uv's x86_64-manylinux_2_34 means all).
HOST_PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")


def _pip() -> list[str]:
    pip = shutil.which("pip3") or shutil.which("pip")
    if not pip:
        raise RuntimeError("pip is needed on the control machine to fetch wheels from PyPI")
    return [pip]


def pip_environment() -> dict[str, str]:
    """pip with no config file and without this machine's find-links: only PyPI answers."""
    env = {key: value for key, value in os.environ.items() if key != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip_command(subcommand: str, python: str = HOST_PYTHON) -> list[str]:
    """`pip <subcommand>` for the hosts' platform: CPython `python` on x86_64, wheels only."""
    command = _pip() + [subcommand, "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
                        "--abi", "cp" + python.replace(".", "")]
    for platform in HOST_PLATFORMS:
        command += ["--platform", platform]
    return command


def download_command(requirements: list[str], dest: Path, *, deps: bool) -> list[str]:
    """The pip command downloading `requirements` (and their dependencies if `deps`) for the hosts."""
    command = pip_command("download") + ["--quiet", "--dest", str(dest)]
    if not deps:
        command.append("--no-deps")
    return command + list(requirements)


def fetch_wheels(requirements: list[str], *, deps: bool = False) -> list[Path]:
    """Wheels for `requirements` (with their dependencies if `deps`), downloaded once and cached.

    The cache entry is keyed by the requirement list; a finished download is marked by
    `complete.json`, so an interrupted one is redone.
    """
    key = hashlib.sha256(json.dumps([sorted(requirements), deps, HOST_PYTHON, HOST_PLATFORMS]).encode())
    entry = cache_dir() / "pypi" / key.hexdigest()[:16]
    marker = entry / "complete.json"
    if not marker.exists():
        entry.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        work.chmod(0o755)
        try:
            subprocess.run(download_command(requirements, work, deps=deps), check=True, env=pip_environment())
            files = sorted(path.name for path in work.glob("*.whl"))
            (work / "complete.json").write_text(json.dumps({"requirements": requirements, "files": files}))
            shutil.rmtree(entry, ignore_errors=True)
            work.rename(entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return [entry / name for name in json.loads(marker.read_text())["files"]]


def fetch_wheel(name: str, version: str) -> Path:
    """The one real wheel `name==version` (no dependencies)."""
    (wheel,) = fetch_wheels([f"{name}=={version}"])
    return wheel
