"""The deploy as users run it, on dressed sandbox hosts: dry run changes nothing; converge is idempotent."""

import pytest

from operations.patches import PATCHSET_PENDING
from pyinfra_run import apply, dry_run, run_pyinfra

pytestmark = pytest.mark.integration


PREFLIGHT_ONLY = "tests/integration/deploys/preflight.py"


@pytest.fixture(scope="module")
def unconverged(lab):
    """Two lab hosts that no test sharing them converges: preflight alone (which makes only the state
    directory), runs refused before connecting, and the fingerprint's check (which undoes what it does)."""
    return lab(2)


def test_preflight_alone_changes_nothing_and_its_lock_take_makes_the_state_directory(unconverged):
    """The state directory holds the lock: the take makes it (bookkeeping, like the lock itself), so a
    dry run makes nothing and a real run reports no change, then or later."""
    the_lab = unconverged
    before = the_lab.fingerprints()
    dry = dry_run(the_lab, PREFLIGHT_ONLY)
    assert the_lab.fingerprints() == before, "a dry run changed a host"
    assert "host lock and preflight checks" in dry.output
    assert the_lab.exec(the_lab.hosts[0], "test -d /var/lib/servestack").returncode != 0
    for _ in range(2):
        run = apply(the_lab, PREFLIGHT_ONLY)
        assert run.totals["success"] == 0 and run.totals["error"] == 0
    for host in the_lab.hosts:
        mode = the_lab.exec(host, "stat -c '%a %U' /var/lib/servestack; test ! -e /var/lib/servestack/lock",
                            check=True).stdout.split()
        assert mode == ["755", "root"]


def test_bad_host_data_is_refused_before_connecting(unconverged):
    the_lab = unconverged
    run = run_pyinfra(the_lab, "--data", "gpu_count=3", "--dry")
    assert run.returncode != 0
    assert "host h1: 'service_tp': expected a tensor-parallel size that divides gpu_count=3, got 8" in run.output
    assert "Connecting to hosts" not in run.output
    assert "--> pyinfra error: refusing to run" in run.output and "preconnect.py" not in run.output


def test_the_whole_deploy_converges_as_a_sudo_user_and_then_changes_nothing(lab):
    the_lab = lab(1, user="ubuntu")
    assert "'ssh_user': 'ubuntu'" in the_lab.inventory_path.read_text()
    dry = dry_run(the_lab)   # the new release's patch record does not exist yet: its digest is named, not "none"
    assert f'SERVESTACK_PATCHSET={PATCHSET_PENDING}' in dry.output and "SERVESTACK_PATCHSET=none" not in dry.output
    first = apply(the_lab)
    assert first.totals["success"] > 0
    second = apply(the_lab)
    assert second.totals["success"] == 0 and second.totals["error"] == 0

    # a patch record deleted by hand: the patches step rewrites it as it was, nothing else changes
    host = the_lab.hosts[0]
    the_lab.exec(host, "rm /opt/servestack/releases/r-*/patches.json", check=True)
    dry = dry_run(the_lab)
    assert "Will rewrite the record" in dry.output and "will restart" not in dry.output, dry.output[-4000:]
    assert "Will modify" not in dry.output   # the unit's diff
    again = apply(the_lab)
    assert again.totals["success"] == 1, again.output[-4000:]
    owner = the_lab.exec(the_lab.hosts[0], "stat -c %U /usr/local/cuda-13.0/bin/nvcc; readlink /opt/ml-env",
                         check=True).stdout.split()
    assert owner[0] == "root" and owner[1].startswith("/opt/servestack/releases/r-")


def test_the_fingerprint_sees_files_and_services_not_systemds_own_mounts(unconverged):
    """What "a dry run changed a host" compares: files a deploy may touch and service units. A mount
    systemd lists whenever it gets to it (a service's /run/credentials, late after boot) is not in it."""
    the_lab = unconverged
    host = the_lab.hosts[0]
    before = the_lab.fingerprint(host)
    the_lab.exec(host, "mkdir -p /run/fingerprint-test && mount -t tmpfs none /run/fingerprint-test", check=True)
    try:
        listed = the_lab.exec(host, "for i in $(seq 50); do systemctl list-units --all --no-legend --plain "
                                    "--type=mount | grep -q /run/fingerprint-test && exit 0; sleep 0.2; done; exit 1")
        assert listed.returncode == 0, "systemd never listed the mount"
        assert the_lab.fingerprint(host) == before
    finally:
        the_lab.exec(host, "umount /run/fingerprint-test", check=True)
    the_lab.exec(host, "systemd-run --quiet --unit=fingerprint-test --remain-after-exit true", check=True)
    try:
        assert the_lab.fingerprint(host) != before
    finally:
        the_lab.exec(host, "systemctl stop fingerprint-test", check=True)
    assert the_lab.fingerprint(host) == before


def test_every_bad_value_of_an_inventory_is_one_line_before_connecting(unconverged):
    the_lab = unconverged
    run = run_pyinfra(the_lab, "-y", "--data", "service_tp=3", "--data", "service_port=-1",
                      "--data", "rollout_batch=0", "--data", "servce_port=1")
    assert run.returncode != 0 and "Connecting to hosts" not in run.output
    lines = [line for line in run.output.splitlines() if line.startswith("host h1: ")]
    assert sorted(line.split("'")[1] for line in lines) == ["rollout_batch", "servce_port", "service_port",
                                                            "service_tp"], lines
    assert any(line.startswith("host h1: 'servce_port'") and "did you mean 'service_port'?" in line for line in lines)
