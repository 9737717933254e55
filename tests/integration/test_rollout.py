"""`rollout_batch` on sandbox hosts (README, "Host data": hosts restarted at a time): the service step's
health-gated restart runs with pyinfra's `_parallel` set from it, a batch after a batch; the hosts of one
run must agree on it. The hosts, releases and stand-in server are those of test_service.py's ServiceLab.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.test_service import BASE_DATA, PYINFRA, REPO, UNIT, Run, ServiceLab

pytestmark = pytest.mark.integration


@pytest.fixture
def service_lab(sandbox, tmp_path):
    def make(n: int) -> ServiceLab:
        return ServiceLab(sandbox(n), tmp_path)
    return make


def start_times(svc: ServiceLab) -> list[tuple[str, float]]:
    """(host, when systemd started its server's process), earliest first: ExecMainStartTimestampMonotonic,
    in seconds, on the monotonic clock of the one kernel all sandbox hosts run on."""
    starts = {host.name: int(svc.sh(host, "systemctl show --property=ExecMainStartTimestampMonotonic --value "
                                          "sglang.service")) / 1e6 for host in svc.sb.hosts}
    return sorted(starts.items(), key=lambda item: item[1])


def converge_per_host(svc: ServiceLab, per_host: dict[str, dict], *args: str) -> Run:
    """The service step with `per_host[name]` on top of the base data of host `name` (pyinfra -y --json)."""
    inventory = svc.sb.write_inventory(lambda host: {**BASE_DATA, **per_host.get(host.name, {})})
    argv = [str(PYINFRA), "-y", *args, "--json", "--config", str(REPO / "config.py"), str(inventory), str(svc.deploy)]
    proc = subprocess.run(svc.sb.controller_cmd(argv), capture_output=True, text=True, cwd=svc.workdir, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = {}
    return Run(proc.returncode, proc.stderr, result)


def test_rollout_batch_restarts_the_hosts_a_batch_at_a_time(service_lab):
    """rollout_batch = 2 on 4 hosts, read from the hosts' own start times: the two servers of a batch start
    together (closer than one server's start-up), the next batch only once the previous one passed its health
    gate, which takes a server's start-up (/health answers `startup_s` after its start)."""
    startup_s = 4
    svc = service_lab(4)
    data = {"service_env": {"FAKE_SGLANG_STARTUP_S": str(startup_s)}, "rollout_batch": 2}
    svc.serve("r-000000000001", data)
    run = svc.converge({**data, "service_attention_backend": "triton"}, "-y")
    assert run.rc == 0, run.log
    assert sorted(run.changed_hosts("Health-gated restart of sglang.service")) == ["h1", "h2", "h3", "h4"]
    assert [svc.starts(host) for host in svc.sb.hosts] == [2, 2, 2, 2]
    starts = start_times(svc)
    first, second = starts[:2], starts[2:]
    assert first[1][1] - first[0][1] < startup_s and second[1][1] - second[0][1] < startup_s, starts
    assert second[0][1] - first[1][1] >= startup_s, starts
    print("restarts (s after the first):", ", ".join(f"{name} +{at - starts[0][1]:.2f}" for name, at in starts))


def test_hosts_with_different_rollout_batches_are_refused_before_connecting(service_lab):
    """pyinfra runs an operation's batches with one `_parallel` for all its hosts: two values used to stop
    the run after connecting, with "Cannot have different values for `_parallel`" and no host or key named."""
    svc = service_lab(2)
    svc.install("r-000000000001")
    refused = converge_per_host(svc, {"h1": {"rollout_batch": 2}})
    assert refused.rc != 0
    assert ("'rollout_batch': the hosts of one run restart as one roll-out and need the same value, got 1 on h2; "
            "2 on h1") in refused.log, refused.log
    assert "Connecting to hosts" not in refused.log
    for host in svc.sb.hosts:
        assert svc.sh(host, f"test -e {UNIT} || echo absent").strip() == "absent"
    limited = converge_per_host(svc, {"h1": {"rollout_batch": 2}}, "--limit", "h1")
    assert limited.rc == 0, limited.log
    assert svc.generate(svc.sb.hosts[0])
