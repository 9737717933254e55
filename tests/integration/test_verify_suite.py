"""The verification suite against sandbox GPU-host stand-ins over real SSH, run as users run it:
`pytest tests/verify --inventory INVENTORY` in the lab's controller namespace, read back from JUnit XML.

A suite that cannot fail proves nothing: on hosts before the upgrade, and on converged hosts broken on
purpose (a wrong torch local label, a modified patched file, a stopped service, a changed CUDA 12.8
file, a driver that did not load), the matching check must fail, and on a converged host every check
must pass. The GPU checks pass here against stand-ins (nvidia-smi, the stand-in torch's and nvcc's
SIMULATED GPUs); what they show is that the deploy and the checks agree with a host that has the
expected GPUs, and that a host whose driver does not answer fails them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import pytest

from servestack.checks.outcome import FAILED, PASSED, SKIPPED

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

# The seven checks that need the GPUs to answer (the driver, nvidia-smi's GPUs, the CUDA sample, torch on them).
GPU_CHECKS = {"driver_version", "gpu_capability", "gpu_count", "cuda_sample", "torch_device_capability",
              "torch_cuda_op", "sglang_sm120"}
# The real message and exit status of nvidia-smi on a host whose kernel module did not load; nvidia-smi(1)
# calls exit 9 "NVIDIA driver is not loaded".
NOT_COMMUNICATING = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
                     "the latest NVIDIA driver is installed and running.")


@dataclass
class SuiteRun:
    returncode: int
    output: str
    outcomes: dict  # (host, check) -> (status, message)

    def status(self, host: str, check: str) -> str:
        return self.outcomes[(host, check)][0]

    def message(self, host: str, check: str) -> str:
        return self.outcomes[(host, check)][1]

    def of_host(self, host: str, status: str) -> set[str]:
        return {check for (name, check), (found, _) in self.outcomes.items() if name == host and found == status}


def junit_outcomes(path: Path) -> dict:
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        status, message = PASSED, ""
        for tag, name in (("failure", FAILED), ("error", FAILED), ("skipped", SKIPPED)):
            element = case.find(tag)
            if element is not None:
                status, message = name, element.get("message", "").removeprefix("Failed: ").removeprefix("Skipped: ")
        outcomes[(properties["servestack_host"], properties["servestack_check"])] = (status, message)
    return outcomes


def run_suite(lab, tmp_path: Path, *args: str) -> SuiteRun:
    junit = tmp_path / "verify-junit.xml"
    argv = [sys.executable, "-m", "pytest", "tests/verify", "--inventory", str(lab.inventory_path),
            f"--junitxml={junit}", "-p", "no:cacheprovider", "-q", "-rs", *args]
    proc = subprocess.run(lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert junit.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return SuiteRun(proc.returncode, proc.stdout + proc.stderr, junit_outcomes(junit))


def sh(lab, host, command: str) -> str:
    proc = lab.exec(host, command)
    assert proc.returncode == 0, f"{host.name}: {command!r}: {proc.stderr}"
    return proc.stdout


# --- before the upgrade: the suite works over SSH and fails what is not there yet ----------------


@pytest.fixture(scope="module")
def before_the_upgrade(lab):
    """Two lab hosts no deploy has touched, reached as a sudo user, as group_data/gpu_hosts.py does. The
    tests that share them only run checks, which change nothing there."""
    return lab(2, user="ubuntu")


def test_before_the_upgrade_the_suite_fails_the_old_stack_over_ssh(before_the_upgrade, tmp_path):
    the_lab = before_the_upgrade
    first, second = (host.name for host in the_lab.hosts)
    run = run_suite(the_lab, tmp_path)
    assert run.returncode == 1, run.output[-3000:]
    for host in (first, second):
        # the stand-in driver answers: GPU checks run (and pass against the fleet's expectations)
        assert {"driver_version", "gpu_capability", "gpu_count"} <= run.of_host(host, PASSED)
        assert run.message(host, "nvcc_version") == f"/usr/local/cuda-13.0 does not exist on {host}"
        # the hand-made ml-env holds the CUDA 12.8 build: the local label tells it apart
        assert run.message(host, "package_version[torch]").endswith(f"on {host}, expected 2.9.1+cu130")
        assert "+cu128" in run.message(host, "package_version[torch]")
        assert run.message(host, "torch_cuda_build").endswith("is built for CUDA 12.8, expected 13.0")
        assert run.status(host, "cuda_sample") == FAILED   # no CUDA 13.0 nvcc to build it with yet
        assert run.message(host, "cuda_sample").startswith(
            f"/usr/local/cuda-13.0/bin/nvcc -gencode arch=compute_120,code=sm_120 failed on {host}")
        assert run.status(host, "service_active") == FAILED


def test_limit_and_the_table(before_the_upgrade, tmp_path):
    the_lab = before_the_upgrade
    first, second = (host.name for host in the_lab.hosts)
    run = run_suite(the_lab, tmp_path, "--limit", second, "-m", "not deployed")
    assert {host for host, _ in run.outcomes} == {second}
    argv = [sys.executable, "-m", "servestack.cli", "verify", str(the_lab.inventory_path), "--limit", first]
    proc = subprocess.run(the_lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "servestack verify" in proc.stdout and first in proc.stdout and second not in proc.stdout
    assert f"failed {first} nvcc_version: /usr/local/cuda-13.0 does not exist on {first}" in proc.stdout


# --- converged hosts, then broken on purpose ----------------------------------------------------


BREAKS = {
    # a wrong torch local label in the active release
    "torch_label": "m=$(ls -d /opt/ml-env/lib/python3*/site-packages/torch-*.dist-info)/METADATA; "
                   "sed -i 's/^Version: \\(.*\\)+cu130$/Version: \\1+cu128/' $m",
    # a patched file modified after the patches step recorded it
    "patched_file": "f=$(ls /opt/ml-env/lib/python3*/site-packages/sglang/srt/distributed/device_communicators/"
                    "all_reduce_utils.py); echo '# edited by hand' >> $f",
    # the service stopped
    "service": "systemctl stop sglang.service",
    # a file of the kept CUDA 12.8 toolkit changed
    "cuda_128": "f=$(find /usr/local/cuda-12.8/ -type f -name '*.so*' | head -n 1); echo x >> $f",
    # the kernel module did not load (after a kernel update): no device nodes, nvidia-smi cannot talk to it
    "driver": "sed -i \"s/'driver_loaded': True/'driver_loaded': False/\" /usr/bin/nvidia-smi && "
              "rm -f /dev/nvidiactl /dev/nvidia[0-9]*",
}
EXPECTED_FAILURE = {"torch_label": "package_version[torch]", "patched_file": "patches_applied",
                    "service": "service_active", "cuda_128": "kept_toolkits", "driver": "gpu_count"}


# sandbox hosts cannot run SGLang: the lab's host data has the unit start the stand-in server of
# sandbox/standins (service_launch_module, on the service's PYTHONPATH), so the real
# deploy.py converges them
LAB_DATA = {"service_health_timeout_s": 120}


def verify_operation(run) -> dict:
    """The deploy's verification step in a `--json` run's results."""
    operations = json.loads(run.stdout)["results"]["operations"]
    return next(op for op in operations if op["name"].startswith("servestack verify"))


@pytest.fixture(scope="module")
def converged(lab, tmp_path_factory):
    """Six lab hosts converged: one left as it is, five broken one way each, and the suite's run."""
    from pyinfra_run import run_pyinfra

    workdir = tmp_path_factory.mktemp("verify")
    the_lab = lab(1 + len(BREAKS), host_data=LAB_DATA)
    run = run_pyinfra(the_lab, "-y", "--json", timeout=1800)
    assert run.returncode == 0, run.output[-6000:]
    hosts = the_lab.hosts
    for host, command in zip(hosts[1:], BREAKS.values()):
        sh(the_lab, host, command)
    breaks = {name: host.name for name, host in zip(BREAKS, hosts[1:])}
    return the_lab, hosts[0].name, breaks, run_suite(the_lab, workdir), run


def test_a_converged_host_passes_every_check(converged):
    _, good, _, run, _ = converged
    assert run.of_host(good, FAILED) == set() and run.of_host(good, SKIPPED) == set(), run.output[-4000:]
    assert GPU_CHECKS <= run.of_host(good, PASSED)


def test_where_host_data_expects_gpus_a_driver_that_did_not_load_fails_every_gpu_check(converged):
    """Nothing skips: each of the seven GPU checks fails, naming the cause."""
    _, _, breaks, run, _ = converged
    host = breaks["driver"]
    assert run.of_host(host, FAILED) == GPU_CHECKS, run.output[-4000:]
    assert run.returncode == 1
    expects = f"on {host}, host data expects gpu_count = 8: "
    assert run.message(host, "gpu_count") == (f"no NVIDIA driver answers {expects}"
                                              f"nvidia-smi failed (exit 9: NVIDIA driver is not loaded): "
                                              f"{NOT_COMMUNICATING}")
    assert run.message(host, "cuda_sample").startswith(f"no /dev/nvidiactl {expects}")
    assert run.message(host, "torch_cuda_op") == (f"torch.cuda.is_available() is False {expects}CUDA initialization: "
                                                  "Found no NVIDIA driver on your system. Please check that you have "
                                                  "an NVIDIA GPU and installed a driver from "
                                                  "http://www.nvidia.com/Download/index.aspx")


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_broken_host_fails_the_matching_check(converged, name):
    _, _, breaks, run, _ = converged
    host = breaks[name]
    assert run.status(host, EXPECTED_FAILURE[name]) == FAILED, run.output[-4000:]


def test_the_breaks_fail_only_what_they_touch(converged):
    _, _, breaks, run, _ = converged
    assert run.of_host(breaks["torch_label"], FAILED) == {"package_version[torch]"}
    assert run.of_host(breaks["patched_file"], FAILED) == {"patches_applied"}
    assert run.of_host(breaks["cuda_128"], FAILED) == {"kept_toolkits"}
    assert run.of_host(breaks["driver"], FAILED) == GPU_CHECKS
    assert "service_active" in run.of_host(breaks["service"], FAILED)
    assert "must be enabled and active" in run.message(breaks["service"], "service_active")


def test_the_deploys_last_step_verified_every_host_without_changing_anything(converged):
    _, _, _, _, deploy_run = converged
    step = verify_operation(deploy_run)
    assert not step.get("error") and not step.get("success"), step  # passed on all six, changed nothing
    assert " skipped: " not in deploy_run.stderr   # every check applies where host data expects GPUs


def test_the_deploys_last_step_does_not_reuse_a_pass_the_release_no_longer_earns(converged, tmp_path):
    """The torch_label break edits a METADATA in place: site-packages' mtime stays, what the checks read
    does not, so the recorded pass of the python checks is not reused."""
    from pyinfra_run import run_pyinfra

    the_lab, _, breaks, _, _ = converged
    deploy = tmp_path / "verify_only.py"
    deploy.write_text("from operations import verify\n\nverify.verify()\n")
    run = run_pyinfra(the_lab, "-y", "--json", "--limit", breaks["torch_label"], target=str(deploy))
    assert run.returncode != 0, run.output[-3000:]
    assert "verify package_version" in run.output, run.output[-3000:]
    assert f"torch 2.9.1+cu128 in /opt/ml-env on {breaks['torch_label']}, expected 2.9.1+cu130" in run.output


def test_the_deploys_last_step_fails_a_broken_host(converged, tmp_path):
    from pyinfra_run import run_pyinfra

    the_lab, _, breaks, _, _ = converged
    deploy = tmp_path / "verify_only.py"
    deploy.write_text("from operations import verify\n\nverify.verify()\n")
    run = run_pyinfra(the_lab, "-y", "--json", "--limit", breaks["cuda_128"], target=str(deploy))
    assert run.returncode != 0
    assert "kept_toolkits: on " + breaks["cuda_128"] in run.output
    assert "/usr/local/cuda-12.8 changed since it was recorded: file list or sizes changed" in run.output


# --- two sandboxes at once -------------------------------------------------------------------------

READ_MARKER = ("import sys; from servestack.fleet import load_inventory; from servestack.verify import backend_for; "
               "[host] = load_inventory(sys.argv[1]); "
               "print(backend_for(host).connect().run('cat /etc/servestack-marker').stdout.strip())")


def test_two_sandboxes_with_the_same_addresses_are_read_each_its_own(lab):
    """The verification suite's master SSH connections outlive a run (ControlPersist). Two sandboxes give
    their hosts the same addresses, each in its own network namespace; each must be read as itself."""
    first, second = lab(1), lab(1)
    assert first.hosts[0].address == second.hosts[0].address   # what made them collide
    for the_lab, marker in ((first, "first"), (second, "second")):
        the_lab.exec(the_lab.hosts[0], f"echo {marker} > /etc/servestack-marker", check=True)
    for the_lab, marker in ((first, "first"), (second, "second"), (first, "first")):
        argv = [sys.executable, "-c", READ_MARKER, str(the_lab.inventory_path)]
        read = subprocess.run(the_lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert read.stdout.strip() == marker, read.stdout + read.stderr
