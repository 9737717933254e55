"""What a sandbox records in its state dir (sandbox/hosts.py), read back by another process."""

from sandbox.hosts import Sandbox


def test_a_sandbox_picked_up_from_its_state_knows_the_rootfs_its_hosts_boot_from(tmp_path):
    """A reboot from another process (`Sandbox(name).reboot`) boots the host from the lower layer it was
    started on, not from whatever rootfs that process would choose."""
    rootfs = tmp_path / "rootfs-recorded"
    started = Sandbox("s", state_dir=tmp_path / "state", rootfs=rootfs)
    started.state_dir.mkdir()
    started._save()
    assert Sandbox("s", state_dir=tmp_path / "state").rootfs == rootfs
