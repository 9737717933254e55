"""Preflight on sandbox hosts: `servestack doctor` (table, --json, exit status, changes nothing) and
the host lock across a control machine that dies mid-run (kill -9 of pyinfra)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from sandbox.standins.nvidia_smi import Gpu
from toolkit_lab import REPO

pytestmark = pytest.mark.integration

DEPLOY = "tests/integration/deploys/toolkit.py"
BUSY = "/var/lib/servestack/lock.busy"


@pytest.fixture(scope="module")
def pf(toolkit_lab):
    with toolkit_lab("pf", "preflight", hosts=3) as lab:
        yield lab


def doctor(pf, *args: str) -> subprocess.CompletedProcess:
    inventory = pf.write_inventory()
    argv = pf.lab.controller_argv([sys.executable, "-m", "servestack.cli", "doctor", str(inventory), *args])
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_doctor_reports_every_check_and_changes_nothing(pf):
    h1, h2 = pf.host("h1"), pf.host("h2")
    pf.scenario(h1, "doctor-good")
    pf.scenario(h2, "doctor-bad")
    pf.set_gpu(h2, Gpu(name="NVIDIA H200", compute_cap="9.0", driver_version="575.57.08"))
    before = {host.name: pf.lab.fingerprint(host) for host in (h1, h2)}
    result = doctor(pf, "--json", "--limit", "h1", "--limit", "h2")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    good, bad = report["hosts"]["h1"], report["hosts"]["h2"]
    assert good["ok"] is True
    assert list(good["checks"]) == ["settings", "connect", "driver", "gpus", "compute_capability", "serving",
                                    "arch", "install_path", "runfile", "disk", "lock", "link", "kept_toolkits",
                                    "service"]
    assert {name for name, check in bad["checks"].items() if check["status"] == "fail"} == {
        "driver", "compute_capability", "serving"}
    assert "GPU 0 (NVIDIA H200" in bad["checks"]["compute_capability"]["detail"]
    assert {host.name: pf.lab.fingerprint(host) for host in (h1, h2)} == before
    only_good = doctor(pf, "--json", "--limit", "h1")
    assert only_good.returncode == 0 and list(json.loads(only_good.stdout)["hosts"]) == ["h1"]
    table = doctor(pf, "--limit", "h2")
    assert table.returncode == 1
    assert "compute_capability" in table.stdout and "1 of 1 hosts would be refused" in table.stdout


def test_a_host_without_systemd_is_refused_by_preflight_before_any_change(pf):
    """Issue 32 §1: on a host whose init is not systemd, a deploy backed up the environment, recorded the
    toolkit and started the venv build before the service step refused the host. Preflight refuses it now,
    in the same list as its other problems, and doctor says the same. The host's systemd hides the
    marker every systemd tool reads (/run/systemd/system, sd_booted(3)) for the test."""
    host = pf.host("h1")
    pf.scenario(host, "doctor-good")
    pf.sh(host, "mv /run/systemd/system /run/systemd/system.hidden")
    try:
        before = pf.lab.fingerprint(host)
        report = json.loads(doctor(pf, "--json", "--limit", "h1").stdout)["hosts"]["h1"]["checks"]["service"]
        run = pf.pyinfra(DEPLOY, limit=["h1"])
        dry = pf.pyinfra(DEPLOY, limit=["h1"], dry=True)
        after = pf.lab.fingerprint(host)
    finally:
        pf.sh(host, "mv /run/systemd/system.hidden /run/systemd/system")
    refusal = "systemd is not the init system here (no /run/systemd/system): sglang.service cannot run on this host"
    assert report["status"] == "fail" and refusal in report["detail"]
    assert run.returncode != 0 and f"refused: {refusal}" in run.output, run.output[-4000:]
    assert f"refused: {refusal}" in dry.output and "install 13.0.1 into" not in dry.output, dry.output[-4000:]
    assert after == before


def test_a_service_user_that_cannot_be_created_is_refused_by_preflight_before_any_change(pf):
    """Issue 32 §1: pyinfra's server.user stops with "useradd is not installed" in the service step, after the
    toolkit and the venv changed. Preflight refuses the host first; doctor says the same."""
    host = pf.host("h1")
    pf.scenario(host, "doctor-good")
    assert pf.lab.exec(host, "getent passwd sglang").returncode != 0   # the deploy would create it
    useradd = pf.sh(host, "command -v useradd").strip()
    pf.sh(host, f"mv {useradd} {useradd}.hidden")
    try:
        before = pf.lab.fingerprint(host)
        report = json.loads(doctor(pf, "--json", "--limit", "h1").stdout)["hosts"]["h1"]["checks"]["service"]
        run = pf.pyinfra(DEPLOY, limit=["h1"])
        after = pf.lab.fingerprint(host)
    finally:
        pf.sh(host, f"mv {useradd}.hidden {useradd}")
    refusal = "'service_user': sglang does not exist and cannot be created: useradd (the passwd package) is not on"
    assert report["status"] == "fail" and refusal in report["detail"]
    assert run.returncode != 0 and f"refused: {refusal}" in run.output, run.output[-4000:]
    assert after == before


def test_a_model_its_sglang_cannot_load_on_the_hosts_gpus_is_refused_by_preflight_before_any_change(pf):
    """Issue 32 §1, a model the host cannot serve: sglang 0.5.9 loads Kimi-K2.5-NVFP4 (modelopt_fp4) only from
    compute capability 10.0, and its loader refuses the model at load, after the toolkit, the venv and the
    restart. Preflight refuses such a host first, with the numbers; doctor says the same; the same GPUs pass
    with the GLM-5 profile, whose sglang 0.5.14 loads modelopt_fp4 from 8.0."""
    host = pf.host("h1")
    pf.set_gpu(host, Gpu(name="NVIDIA H200", compute_cap="9.0", memory_mib=143771))
    try:
        pf.scenario(host, "doctor-good", gpu_compute_capability="9.0")
        before = pf.lab.fingerprint(host)
        kimi = json.loads(doctor(pf, "--json", "--limit", "h1").stdout)["hosts"]["h1"]["checks"]
        run = pf.pyinfra(DEPLOY, limit=["h1"])
        dry = pf.pyinfra(DEPLOY, limit=["h1"], dry=True)
        after = pf.lab.fingerprint(host)
        pf.scenario(host, "doctor-good", gpu_compute_capability="9.0", service_profile="glm-5-mtp")
        glm = json.loads(doctor(pf, "--json", "--limit", "h1").stdout)["hosts"]["h1"]["checks"]
    finally:
        pf.set_gpu(host, Gpu())
    refusal = ("8 of 8 GPUs cannot serve nvidia/Kimi-K2.5-NVFP4 (profile 'kimi-k2.5-eagle3'): sglang 0.5.9 "
               "(sglang-0.5.9) loads modelopt_fp4 only on compute capability 10.0 or newer, and GPU 0 (NVIDIA H200")
    assert [name for name, check in kimi.items() if check["status"] == "fail"] == ["serving"]
    assert refusal in kimi["serving"]["detail"]
    assert run.returncode != 0 and f"refused: {refusal}" in run.output, run.output[-4000:]
    assert f"refused: {refusal}" in dry.output and "install 13.0.1 into" not in dry.output, dry.output[-4000:]
    assert after == before
    assert glm["serving"]["status"] == "ok"
    assert "sglang 0.5.14 loads modelopt_fp4 on all 8 GPUs" in glm["serving"]["detail"]


def busy(pf, host) -> bool:
    """Whether a servestack command (download, installer) holds the host's busy lock right now."""
    return pf.lab.exec(host, f"test -e {BUSY} && ! flock -n {BUSY} true").returncode == 0


def test_lock_of_a_dead_control_machine_is_found_stale(pf):
    host = pf.host("h3")
    path = pf.scenario(host, "slow")
    pf.server_call("add_fault", path, "cut", after=0)          # every download attempt fails: a slow run
    inventory = pf.write_inventory()
    argv = pf.lab.controller_argv([str(REPO / ".venv/bin/pyinfra"), "-y", "--limit", "h3", str(inventory),
                                   str(REPO / DEPLOY)])
    run = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not busy(pf, host):
            assert run.poll() is None and time.monotonic() < deadline, "the run never started its download"
            time.sleep(0.2)
        os.kill(run.pid, signal.SIGKILL)                       # the control machine dies mid-download
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    lock = json.loads(pf.sh(host, "cat /var/lib/servestack/lock"))

    held = json.loads(doctor(pf, "--json", "--limit", "h3").stdout)["hosts"]["h3"]["checks"]["lock"]
    assert held["status"] == "fail" and "still running on the host" in held["detail"]

    deadline = time.monotonic() + 60
    while busy(pf, host):                                      # the orphaned download gives up
        assert time.monotonic() < deadline
        time.sleep(0.5)
    stale = json.loads(doctor(pf, "--json", "--limit", "h3").stdout)["hosts"]["h3"]["checks"]["lock"]
    assert stale["status"] == "warn" and f"run {lock['run_id']}" in stale["detail"] and "stale" in stale["detail"]

    pf.server_call("reset")
    result = pf.pyinfra(DEPLOY, limit=["h3"])
    assert result.returncode == 0, result.output[-4000:]
    # The take names the dead run from its lock file; no step of it was running any more (the download gave
    # up above, and busy.sh removes the activity record when its command ends), so no "interrupted during".
    taken = re.escape(f"(replaced a stale lock: run {lock['run_id']} from {lock['controller']}, "
                      f"started {lock['started']})")
    assert re.search(rf"lock /var/lib/servestack/lock held by run \S+ {taken}", result.output), result.output[-4000:]
    assert "release 13.0, V13.0.88" in pf.sh(host, "/usr/local/cuda-13.0/bin/nvcc --version")
    assert not pf.exists(host, "/var/lib/servestack/lock")
