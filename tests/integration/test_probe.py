"""The host-state probe on a converged host (issue 8): a no-op converge reads each host in one
remote command per stage, a dry run changes nothing, and the counts hold for the real deploy.py.

Remote commands are counted by bench/counting_pyinfra.py (a wrapper of pyinfra's SSH connector).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pyinfra_run import ROOT, apply

pytestmark = pytest.mark.integration

COUNTER = ROOT / "bench" / "counting_pyinfra.py"
MAX_NOOP_COMMANDS = 4     # prepare probe, execute probe, take and release the lock
MAX_DRY_COMMANDS = 2      # the probe before and after the planned release is known


def counted_run(lab, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as counts:
        argv = lab.controller_argv([sys.executable, str(COUNTER), counts.name, str(lab.inventory_path),
                                    "deploy.py", *args])
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
        return result, json.loads(Path(counts.name).read_text() or "{}")


def test_a_converged_host_is_read_in_a_handful_of_commands(lab):
    the_lab = lab(1)
    apply(the_lab)
    noop, counts = counted_run(the_lab, "-y", "--json", "-v")  # -v: pyinfra shows the no-op reasons
    assert noop.returncode == 0, noop.stderr[-4000:]
    assert json.loads(noop.stdout)["results"]["totals"]["success"] == 0
    assert counts["h1"]["commands"] <= MAX_NOOP_COMMANDS and counts["h1"]["transfers"] == 0, counts
    # the heavy checks (torch, the CUDA sample, the patch check) were recorded by the converge and reused
    assert "not re-run: recorded at" in noop.stderr, noop.stderr[-4000:]
    record = json.loads(the_lab.exec(the_lab.hosts[0], "cat /var/lib/servestack/verified.json", check=True).stdout)
    assert {"cuda_sample", "torch_cuda_build", "patches_applied"} <= set(record["checks"])

    before = the_lab.fingerprints()
    dry, counts = counted_run(the_lab, "--dry")
    assert dry.returncode == 0, dry.stderr[-4000:]
    assert the_lab.fingerprints() == before, "a dry run changed a host"
    assert counts["h1"]["commands"] <= MAX_DRY_COMMANDS, counts
