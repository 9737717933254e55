"""A venv holding one stack's sglang as the sandbox serves it (tests that run SGLang's own code)."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from servestack.manifest import load_manifest


@lru_cache(maxsize=4)
def sglang_python(version: str) -> Path:
    """The python of a venv holding sglang `version`'s stack as the sandbox serves it: the real sglang and
    what it imports before GPU work, the stand-ins of the rest (no GPU)."""
    from sandbox.standins.build import stack_wheels
    from sandbox.standins.wheels import build_wheel, standin_wheel
    stack = next(stack for stack in load_manifest().stacks.values() if stack.package("sglang").version == version)
    work = Path(tempfile.mkdtemp(prefix=f"sglang-{version}-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)   # the test session made it: it removes it
    uv = shutil.which("uv") or pytest.fail("uv is not on PATH: run the tests through ./servestack.sh test")
    wheels = stack_wheels(stack, work)
    for package in stack.packages:   # those of the torch and flashinfer indexes and the direct wheels
        if package.index != "pypi":
            version = package.wheel["x86_64"].rsplit("/", 1)[-1].split("-")[1] if package.wheel else package.version
            wheels.append(build_wheel(standin_wheel(package.name, version), work / "elsewhere"))
    subprocess.run([uv, "venv", "--quiet", "--python", "python3", str(work / "venv")], check=True)
    subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--offline",
                    "--python", str(work / "venv/bin/python"), *map(str, wheels)], check=True)
    return work / "venv" / "bin" / "python"
