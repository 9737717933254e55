"""A stack's REAL wheels, served as PyPI serves them: what the first release built from real wheels installs.

`real_index(stack)` is a PEP 503 index holding every file of `stack`'s resolution for the sandbox hosts
(closure.resolve: CPython 3.11 on x86_64, glibc 2.36) as the real wheel from PyPI, and uv's real wheel (a
host installs uv from the same index). Nothing in it is a stand-in. The wheels are fetched once with pip
(pypi.fetch_wheels) into the sandbox cache and the index is laid out there once (hard links), both kept
between runs and keyed by what decides them: the pins, uv's version, the stack's upload-time bound, the
hosts' Python and platforms. A lab serves a hard-linked copy of it (Lab.serve_real_wheels). It is the test
harness's: nothing of it ships.

Only a stack whose every file is on PyPI can be served so: sglang 0.5.14's is, 0.5.9's is not (its torch
2.9.1+cu130 family, sgl-kernel +cu130 and flashinfer's jit cache come from other indexes).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from datetime import datetime, timedelta
from pathlib import Path

from sandbox.rootfs import cache_dir
from sandbox.standins import closure
from sandbox.standins.index import write_simple_index
from sandbox.standins.pypi import HOST_PLATFORMS, fetch_wheels
from sandbox.standins.stack import HOST_PYTHON, manifest
from servestack.manifest import Stack

COMPLETE = "complete.json"   # in an index directory: it was laid out whole (names each file and its size)


def real_requirements(stack: Stack) -> list[str]:
    """`name==version` of every file of `stack`'s resolution; refused for a file PyPI does not host."""
    lock = closure.resolve(stack)
    elsewhere = sorted(name for name, version in lock.items() if version.endswith(".whl"))
    elsewhere += sorted(package.name for package in stack.packages if package.index != "pypi")
    if elsewhere:
        raise RuntimeError(f"stack {stack.name} cannot be served from real wheels: PyPI does not host "
                           f"{', '.join(sorted(set(elsewhere)))}")
    return sorted(f"{name}=={version}" for name, version in lock.items())


def real_wheels(stack: Stack) -> list[Path]:
    """The real wheels of `stack`'s resolution and of the manifest's uv, fetched once into the sandbox cache."""
    return fetch_wheels(real_requirements(stack)) + fetch_wheels([f"uv=={manifest().uv['version']}"])


def upload_time(stack: Stack) -> str:
    """The upload time the index gives every file: an hour before the stack's bound (as build.py does), so
    the hosts' bounded resolution takes them."""
    bound = datetime.strptime(stack.exclude_newer, "%Y-%m-%dT%H:%M:%SZ")
    return (bound - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


def index_key(stack: Stack) -> str:
    decided_by = {"requirements": real_requirements(stack), "uv": manifest().uv["version"],
                  "exclude_newer": stack.exclude_newer, "python": HOST_PYTHON, "platforms": HOST_PLATFORMS}
    return hashlib.sha256(json.dumps(decided_by, sort_keys=True).encode()).hexdigest()[:16]


def real_index(stack: Stack) -> Path:
    """The index serving `stack`'s real wheels (see the module docstring), laid out once in the sandbox cache."""
    dest = cache_dir() / "real-index" / f"{stack.name}-{index_key(stack)}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / COMPLETE).exists():
            wheels = real_wheels(stack)
            shutil.rmtree(dest, ignore_errors=True)
            write_simple_index(dest, wheels, {wheel.name: upload_time(stack) for wheel in wheels})
            sizes = {wheel.name: wheel.stat().st_size for wheel in wheels}
            (dest / COMPLETE).write_text(json.dumps({"stack": stack.name, "files": sizes}, indent=1, sort_keys=True))
    return dest


def served_files(index: Path) -> dict[str, int]:
    """{file name: size} of every wheel a `real_index` serves."""
    return json.loads((index / COMPLETE).read_text())["files"]
