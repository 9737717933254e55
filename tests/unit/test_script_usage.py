"""Every host-side script (files/scripts) called without its inputs exits 2 with a usage line, before it
does anything (issue 32 §6): a wrong call from a new operation shows what the script takes, not an
"unbound variable" or a half-done step. The usage line of a shell script is its header's first line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "files" / "scripts"
SHELL_SCRIPTS = sorted(path.name for path in SCRIPTS.glob("*.sh") if path.name != "helpers.sh")
PYTHON_SCRIPTS = sorted(path.name for path in SCRIPTS.glob("*.py"))
BARE_ENVIRONMENT = {"PATH": os.environ["PATH"], "LC_ALL": "C"}


def run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    program = [shutil.which("bash")] if name.endswith(".sh") else [sys.executable, "-I"]
    return subprocess.run([*program, str(SCRIPTS / name), *args], capture_output=True, text=True, cwd=cwd,
                          env=BARE_ENVIRONMENT, stdin=subprocess.DEVNULL, timeout=60)


def header_usage(name: str) -> str:
    """A shell script's first comment line, without `# `: what it takes."""
    return (SCRIPTS / name).read_text().splitlines()[0].removeprefix("# ")


def test_every_script_is_covered():
    assert len(SHELL_SCRIPTS) >= 15 and len(PYTHON_SCRIPTS) >= 6


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_a_shell_script_without_its_inputs_exits_2_with_its_header_as_usage(name, tmp_path):
    done = run(name, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"usage: {header_usage(name)}"), done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", PYTHON_SCRIPTS)
def test_a_python_script_without_its_arguments_exits_2_with_a_usage_line(name, tmp_path):
    done = run(name, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"usage: {name} "), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


# Each command of a script, one argument (or environment input) short.
SHORT_CALLS = [
    ("atomic-write.sh", ("PATH",), "missing arguments"),
    ("atomic-write.sh", ("PATH", "644"), "CONTENT is not set in the environment"),
    ("busy.sh", ("STATE", "RUN", "STEP"), "missing arguments"),
    ("cuda-runfile.sh", ("download",), "missing arguments"),
    ("cuda-runfile.sh", ("download", "PART"), "SS_RUNFILE_URL is not set in the environment"),
    ("cuda-runfile.sh", ("verify", "PATH"), "SS_RUNFILE_SIZE is not set in the environment"),
    ("cuda-runfile.sh", ("reject", "PATH"), "missing arguments"),
    ("cuda-runfile.sh", ("fetch", "PART"), "unknown command 'fetch'"),
    ("cuda-toolkit.sh", ("install", "--silent"), "SS_RUNFILE is not set in the environment"),
    ("cuda-toolkit.sh", ("restore-link",), "SS_LINK_PATH is not set in the environment"),
    ("cuda-toolkit.sh", ("point-link", "LINK"), "missing arguments"),
    ("cuda-toolkit.sh", ("move-aside", "PATH"), "missing arguments"),
    ("cuda-toolkits.sh", ("state", "INSTALL", "LINK"), "missing arguments"),
    ("cuda-toolkits.sh", ("fingerprint",), "missing arguments"),
    ("disk-free.sh", (), "missing arguments"),
    ("lock.sh", ("read",), "missing arguments"),
    ("lock.sh", ("take", "STATE", "RUN", "CONTROLLER"), "missing arguments"),
    ("lock.sh", ("release", "STATE"), "missing arguments"),
    ("lock.sh", ("steal", "STATE"), "unknown action 'steal'"),
    ("ml-env-state.sh", ("python3", "VENV", "RELEASES"), "missing arguments"),
    ("patch-check.sh", ("SETS", "REQUEST"), "PYTHON is not set in the environment"),
    ("secrets-file.sh", ("place", "PATH"), "missing arguments"),
    ("secrets-file.sh", ("stage",), "missing arguments"),
    ("upload-staging.sh", ("prepare", "REMOTE"), "missing arguments"),
    ("upload-staging.sh", ("place", "REMOTE", "USER"), "missing arguments"),
    ("sglang-health-gate.sh", (), "SS_UNIT is not set in the environment"),
    ("verify-host.sh", (), "CUDA is not set in the environment"),
    ("verify-http.sh", (), "URL is not set in the environment"),
    ("verify-sample.sh", (), "NVCC is not set in the environment"),
]


@pytest.mark.parametrize(("name", "args", "why"), SHORT_CALLS, ids=lambda value: " ".join(value)
                         if isinstance(value, tuple) else str(value))
def test_each_command_one_input_short_exits_2_saying_what_is_missing(name, args, why, tmp_path):
    done = run(name, *args, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr == f"usage: {header_usage(name)} ({why})\n"
    assert list(tmp_path.iterdir()) == []


def test_every_shell_script_is_called_short_at_least_once():
    assert {name for name, _args, _why in SHORT_CALLS} == set(SHELL_SCRIPTS)
