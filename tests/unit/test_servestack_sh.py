"""`./servestack.sh test` runs only where the suite can: on the sandbox hosts' Python (README's quick start);
`./servestack.sh lint` (ruff and mypy, run by .ci/run) passes on the tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tests_with_host_python(tmp_path: Path, version: str) -> subprocess.CompletedProcess:
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\necho {version}\n")
    python.chmod(0o755)
    return subprocess.run([str(ROOT / "servestack.sh"), "test", "--collect-only", "-q", "tests/unit/test_framing.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SERVESTACK_TEST_HOST_PYTHON": str(python)})


def test_the_suite_stops_first_on_another_python(tmp_path):
    run = run_tests_with_host_python(tmp_path, "3.12")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"servestack: the test suite needs {tmp_path}/python3 to be Python 3.11, the sandbox hosts' (Debian 12); it "
        "is 3.12 here (the stand-in wheels are CPython 3.11 builds, installed into venvs made from it)")


def test_on_the_hosts_python_it_runs(tmp_path):
    run = run_tests_with_host_python(tmp_path, "3.11")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tests collected" in run.stdout or "test collected" in run.stdout


def test_the_sandbox_finds_servestack_sh_s_own_uv_without_it_on_path():
    """`./servestack.sh rehearse` on a fresh machine: uv is in .tools/bin, which servestack.sh puts on PATH only
    for `test`; the rehearsal's first step resolves the stacks with it (it stopped with "uv is needed")."""
    script = "from sandbox.standins.closure import _uv; print(_uv())"
    run = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(ROOT / ".tools" / "bin" / "uv")


def test_lint_runs_ruff_and_mypy_and_both_pass():
    run = subprocess.run([str(ROOT / "servestack.sh"), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "All checks passed!" in run.stdout                      # ruff
    assert "Success: no issues found" in run.stdout                # mypy
