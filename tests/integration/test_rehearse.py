"""The quick start's main job: `./servestack.sh rehearse` on sandbox hosts, end to end, as a user runs it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REHEARSE = [sys.executable, "-m", "sandbox", "rehearse"]   # what ./servestack.sh rehearse runs


def test_rehearse_dry_runs_converges_twice_and_verifies(sandbox_rootfs, tmp_path):
    """Two hosts: one of each service profile (the manifest's two), each serving its own."""
    env = {**os.environ, "SERVESTACK_SANDBOX_DIR": str(tmp_path)}
    result = subprocess.run([*REHEARSE, "--hosts", "2"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    last = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stderr[-4000:] + last
    fields = dict(re.findall(r"(\w+)=(\d+)", last))
    assert last.startswith("rehearse: OK ")
    assert fields["hosts"] == "2" and fields["second_run_changes"] == "0" and fields["verify_failed"] == "0"
    assert int(fields["first_run_changes"]) > 0 and int(fields["verify_passed"]) > 0
    assert last.endswith(" profiles=glm-5-mtp,kimi-k2.5-eagle3")
    assert "h1: profile kimi-k2.5-eagle3: serves nvidia/Kimi-K2.5-NVFP4 (speculative algorithm EAGLE3)" in result.stderr
    assert "h2: profile glm-5-mtp: serves festr2/GLM-5-NVFP4-MTP (speculative algorithm NEXTN)" in result.stderr
    assert "dry run: no host changed" in result.stderr
    assert "are small stand-ins" in result.stderr
    # What a user reviews before applying: the toolkit plan, the patch diffs and the unit, per host.
    assert "install 13.0.1 into /usr/local/cuda-13.0" in result.stderr
    assert "+    12: {" in result.stderr
    assert "ExecStart=" in result.stderr
    assert not list(tmp_path.iterdir()), "the rehearsal left its sandbox behind"
