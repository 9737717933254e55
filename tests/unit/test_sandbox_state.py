"""What a sandbox records in its state dir (sandbox/hosts.py), read back by another process; how a lab stops
the artifact server it started (sandbox/lab.py)."""

import os
import subprocess
import time

import pytest

from sandbox.hosts import Sandbox
from sandbox.lab import SERVER_PID_FILE, Lab


def test_a_sandbox_picked_up_from_its_state_knows_the_rootfs_its_hosts_boot_from(tmp_path):
    """A reboot from another process (`Sandbox(name).reboot`) boots the host from the lower layer it was
    started on, not from whatever rootfs that process would choose."""
    rootfs = tmp_path / "rootfs-recorded"
    started = Sandbox("s", state_dir=tmp_path / "state", rootfs=rootfs)
    started.state_dir.mkdir()
    started._save()
    assert Sandbox("s", state_dir=tmp_path / "state").rootfs == rootfs


def test_a_lab_stops_its_artifact_server_without_waiting_out_the_kill_timeout(tmp_path):
    """The lab starts its artifact server as a child and keeps only its pid: stopping it reaps the child, so the
    zombie does not keep the process group, and the teardown, waiting 5 s for a SIGKILL it does not need."""
    lab = Lab("s", state_dir=tmp_path / "state")
    lab.state_dir.mkdir()
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (lab.state_dir / SERVER_PID_FILE).write_text(f"{server.pid}\n")
    started = time.monotonic()
    lab._stop_server()
    assert time.monotonic() - started < 2
    assert not (lab.state_dir / SERVER_PID_FILE).exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)
