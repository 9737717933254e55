"""A green CI run converged sandbox hosts: where they cannot run, .ci/run's integration tests are errors.

Elsewhere (a laptop without root) they skip with the reason. Both are shown here by running one
integration test with none of the sandbox's tools on PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ONE_INTEGRATION_TEST = "tests/integration/test_probe.py::test_a_converged_host_is_read_in_a_handful_of_commands"


def run_without_sandbox_tools(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "SERVESTACK_REQUIRE_SANDBOX"}
    environment.update(PATH=str(tmp_path), **env)   # no debootstrap, systemd-nspawn, ssh...
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           ONE_INTEGRATION_TEST], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)


def test_ci_fails_when_the_integration_tests_cannot_run(tmp_path):
    run = run_without_sandbox_tools(tmp_path, SERVESTACK_REQUIRE_SANDBOX="1")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "1 error" in run.stdout.splitlines()[-1]
    assert "sandbox hosts need " in run.stdout
    assert "SERVESTACK_REQUIRE_SANDBOX=1 requires the integration tests to run" in run.stdout


def test_elsewhere_they_skip_with_the_reason(tmp_path):
    run = run_without_sandbox_tools(tmp_path)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 skipped" in run.stdout.splitlines()[-1]
    assert "SKIPPED [1]" in run.stdout and "sandbox hosts need " in run.stdout


def test_ci_sets_it():
    assert "SERVESTACK_REQUIRE_SANDBOX=1 ./servestack.sh test " in (ROOT / ".ci" / "run").read_text()
