"""The first release built from the REAL wheels (issue 33): a sandbox host builds the current stack's release
(sglang 0.5.14, profile glm-5-mtp) through the ordinary deploy from every file of its resolution as the real
wheel from PyPI (sandbox/standins/realwheels.py: fetched once into the sandbox cache, served by the lab's
artifact server). No stand-in is installed in the release: its own checks and SGLang's own server-args
validation run on real torch 2.11.0, real sglang 0.5.14 and everything they import. The GPU is missing (the
test says where SGLang and the deploy's verification stop for it), and the unit still starts the stand-in
server (sandbox/lab.py STANDIN_SERVER_MODULE) with the release's python.

The first run on a machine downloads the wheels from PyPI (4.6 GB, docs/sandbox.md); later runs take them
from the sandbox cache.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from pyinfra_run import PyinfraRun, apply, run_pyinfra
from sandbox.standins import closure, realwheels
from servestack.manifest import load_manifest

pytestmark = pytest.mark.integration

STACK, PROFILE = "sglang-0.5.14", "glm-5-mtp"
VENV = load_manifest().venv["path"]
RELEASES = load_manifest().venv["releases_dir"]
# Where SGLang's own validation stops on a host without a GPU, in torch's words: sglang 0.5.14
# srt/server_args.py L3625-3627 (_handle_model_specific_adjustments, for a DSA model such as GLM-5) asks
# torch.cuda.get_device_capability() to choose the DSA KV cache dtype and backends.
STOPS_AT = ("not checked: SGLang's checks past where it needs a GPU (RuntimeError: Found no NVIDIA driver on "
            "your system. Please check that you have an NVIDIA GPU and installed a driver from "
            "http://www.nvidia.com/Download/index.aspx)")
# The deploy's verification refuses only what needs a GPU: real torch sees none here.
NO_GPU = {f"refused: verify {check}: torch.cuda.is_available() is False on h1, host data expects gpu_count = 8: "
          "torch gave no reason" for check in ("torch_device_capability", "torch_cuda_op", "sglang_sm120")}


class RealLab:
    """One lab host on the glm-5-mtp profile, every PyPI package served from the real wheels."""

    def __init__(self, lab):
        self.lab = lab
        self.host = lab.hosts[0]
        self.index = lab.serve_real_wheels(STACK)
        self.files = realwheels.served_files(self.index)
        lab.sandbox.write_inventory(lambda host: lab.host_data(host, lab.state_dir / "stack.toml", {
            "service_profile": PROFILE, **lab.real_wheels_data(host, self.index)}))

    def sh(self, command: str) -> str:
        return self.lab.exec(self.host, command, check=True).stdout

    def active(self) -> str:
        return re.fullmatch(rf"{RELEASES}/([^/]+)/venv", self.sh(f"readlink {VENV}").strip()).group(1)

    def release(self) -> dict:
        return json.loads(self.sh(f"cat {RELEASES}/{self.active()}/release.json"))

    def python(self, code: str) -> str:
        return self.sh(f"{VENV}/bin/python -c {shlex.quote(code)}").strip()

    def wheel_bytes(self) -> dict[str, int]:
        """Bytes the artifact server sent of each real wheel, by file name."""
        prefix = self.lab.artifacts.url(self.index, "")
        return {path.rsplit("/", 1)[-1]: sent for path, sent in self.lab.artifact_bytes().items()
                if path.startswith(prefix) and path.endswith(".whl")}

    def whole_downloads(self) -> dict[str, int]:
        """How many times each real wheel was sent whole (200), by file name."""
        prefix = self.lab.artifacts.url(self.index, "")
        return {path.rsplit("/", 1)[-1]: count for path, count in self.lab.artifact_requests(status=200).items()
                if path.startswith(prefix) and path.endswith(".whl")}


def deploy(lab) -> PyinfraRun:
    """deploy.py on the GPU-less host: it fails only where its verification needs a GPU."""
    run = run_pyinfra(lab, "-y", "--json")
    refused = {line.split("] ", 1)[1] for line in run.output.splitlines() if "] refused: " in line}
    assert run.returncode != 0 and refused == NO_GPU, run.output[-6000:]
    return run


def changed(run: PyinfraRun) -> int:
    """The operations a run changed (its servestack_recap)."""
    recap = next(json.loads(line) for line in run.output.splitlines() if line.startswith('{"servestack_recap"'))
    return recap["servestack_recap"][0]["changed"]


@pytest.fixture(scope="module")
def real(lab):
    return RealLab(lab(1, private_artifacts=True))


@pytest.fixture(scope="module")
def first(real):
    """The first deploy: it builds the release from the real wheels."""
    return deploy(real.lab)


def test_the_release_is_built_from_the_real_wheels_each_downloaded_once(real, first):
    release = real.release()
    assert release["inputs"]["stack"] == STACK and release["status"] == "ok"
    # every file of the stack's resolution (and uv) was served whole exactly once, and nothing else of PyPI's
    lock = closure.resolve(load_manifest().stacks[STACK])
    assert real.whole_downloads() == dict.fromkeys(real.files, 1)
    sent = real.wheel_bytes()
    assert all(sent[name] >= size for name, size in real.files.items())
    assert sum(sent.values()) < 1.01 * sum(real.files.values())   # besides the files: uv's metadata reads
    # the pins hold: what is installed is the resolution, package for package
    installed = {closure.normalize_project(name): version for name, version in release["packages"].items()}
    assert {name: installed.get(name) for name in lock} == lock


def test_the_releases_own_checks_pass_on_real_torch_and_sglang(real, first):
    # PyPI's torch 2.11.0 carries no +cu130 in its version; it is a CUDA 13.0 build all the same
    assert real.release()["packages"]["torch"] == "2.11.0"
    said = real.python("import torch, torch.version; print(torch.__version__, torch.version.cuda, "
                       "torch.cuda.is_available())")
    assert said == "2.11.0+cu130 13.0 False"
    assert "STAND-IN" not in real.python("import torch; print(torch.__doc__ or '')")
    assert real.python("import sglang; print(sglang.__version__)") == "0.5.14"
    # the check's own record: what it found, importing with the environment the unit gives the server
    checked = json.loads(real.sh(f"cat {RELEASES}/{real.active()}/check.json"))
    assert checked["ok"] and checked["problems"] == [], checked["problems"]
    assert checked["found"]["torch"] == {"version": "2.11.0+cu130", "cuda": "13.0"}
    assert set(checked["found"]["imports"]) == {"torch", "flashinfer", "sglang"}
    unit = dict(line.removeprefix("Environment=").split("=", 1) for line in
                real.sh(f"grep -h '^Environment=' {RELEASES}/{real.active()}/*.service").splitlines())
    for name in ("CUDA_HOME", "CUDA_PATH", "PATH", "LD_LIBRARY_PATH", "CUDA_LIB_PATH", "SERVESTACK_RELEASE"):
        assert checked["environment"][name] == unit[name], name
    assert checked["environment"]["HOME"] == f"{RELEASES}/{real.active()}/check-scratch/home" != unit["HOME"]


def test_sglangs_own_server_args_validation_runs_until_it_needs_a_gpu(real, first):
    assert f"SGLang's pre-start check of release {real.active()} (profile {PROFILE})" in first.output
    assert "checked: SGLang's argument parser accepts the unit's command line" in first.output
    assert STOPS_AT in first.output, first.output[-6000:]
    assert "checked: ServerArgs" not in first.output    # it stopped inside ServerArgs.__post_init__


def test_a_second_converge_changes_nothing_and_downloads_nothing(real, first):
    sent = real.wheel_bytes()
    assert changed(first) > 0 and changed(deploy(real.lab)) == 0
    assert real.wheel_bytes() == sent


def test_a_rollback_and_a_roll_forward_download_nothing(real, first):
    built, sent = real.active(), real.wheel_bytes()
    back = apply(real.lab, "rollback.py")
    assert back.totals["success"] >= 1 and real.active().startswith("adopted-")
    assert "STAND-IN" in real.python("import torch; print(torch.__doc__ or '')")   # the hand-made env again
    assert changed(deploy(real.lab)) > 0 and real.active() == built
    assert real.wheel_bytes() == sent
    assert real.python("import torch; print(torch.version.cuda)") == "13.0"
