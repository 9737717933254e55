"""The sandbox's simulated GPUs agree with the real captures of a GPU host and with each other.

On sandbox hosts the stand-in torch and the program the stand-in nvcc "builds" see the GPUs the
stand-in nvidia-smi lists (sandbox/standins/payload/torch_gpus.py, toolkit.py's
SIMULATED_SAMPLE). Configured as the captured H200, they must print what the real ones printed
there (tests/fixtures/h200-ubuntu2404/verify/: the verify python report, the sample built for the
GPU's own architecture and for SM120); with a driver that is not loaded, nothing sees a GPU, and
torch warns as real torch does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from facts.framing import split
from facts.verify import REPORT
from sandbox.standins import Gpu, dress_gpu_host, render_nvidia_smi
from sandbox.standins.toolkit import write_toolkit_tree
from sandbox.standins.wheels import build_wheel, torch_wheel
from tests.unit.h200_captures import CAPTURED_REPORT_MARK
from servestack.scripts import script_text

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "fixtures" / "h200-ubuntu2404" / "verify"
H200 = Gpu(name="NVIDIA H200", compute_cap="9.0", count=1, driver_version="580.159.04", memory_mib=143771)


def captured_output(name: str) -> list[str]:
    """The output lines of a captured command (between its `$ command` line and `[exit N]`)."""
    lines = (CAPTURES / name).read_text().splitlines()
    return [line for line in lines[1:] if line and not line.startswith("[exit ")]


def host_bin(tmp_path: Path, gpu: Gpu) -> Path:
    """A directory with the stand-in nvidia-smi for `gpu`, to put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(render_nvidia_smi(gpu))
    smi.chmod(0o755)
    return bin_dir


def stand_in_torch(tmp_path: Path, version: str = "2.11.0") -> Path:
    """The stand-in torch wheel of `version`, unpacked: a directory to put on PYTHONPATH."""
    site = tmp_path / "site"
    zipfile.ZipFile(build_wheel(torch_wheel(version), tmp_path)).extractall(site)
    return site


def verify_python_report(tmp_path: Path, gpu: Gpu | None, **env: str) -> dict:
    """The report of the real files/scripts/verify-python.py run against the stand-in torch."""
    path = os.environ["PATH"] if gpu is None else f"{host_bin(tmp_path, gpu)}:{os.environ['PATH']}"
    script = script_text("verify-python.py")   # as it is sent
    environment = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(["torch"])], capture_output=True, text=True,
                         env={**environment, "PATH": path, "PYTHONPATH": str(stand_in_torch(tmp_path)), **env},
                         timeout=120)
    return json.loads(split(run.stdout.splitlines())[REPORT].text)


def test_the_stand_in_torch_reports_the_stand_in_h200_as_real_torch_reported_the_real_one(tmp_path):
    real = json.loads(next(line for line in captured_output("fact-verify-python.txt")
                           if line.startswith(CAPTURED_REPORT_MARK)).removeprefix(CAPTURED_REPORT_MARK))
    assert verify_python_report(tmp_path, H200)["torch"] == real["torch"]


def test_with_the_driver_not_loaded_the_stand_in_torch_sees_no_gpu_and_says_why_as_real_torch_does(tmp_path):
    found = verify_python_report(tmp_path, Gpu(driver_loaded=False))["torch"]
    # real torch's warning from torch.cuda.is_available() without a driver (c10/cuda/CUDAFunctions.cpp)
    assert found == {"version": "2.11.0+cu130", "cuda": "13.0", "available": False,
                     "unavailable_reason": "CUDA initialization: Found no NVIDIA driver on your system. Please check "
                                           "that you have an NVIDIA GPU and installed a driver from "
                                           "http://www.nvidia.com/Download/index.aspx"}


def test_gpus_hidden_by_cuda_visible_devices_are_named_as_the_reason(tmp_path):
    """Real torch 2.11.0 on the H200 with CUDA_VISIBLE_DEVICES=none: is_available() False and no warning
    (docs/validation/h200-torch-2.11-2026-12-02.md); the report names the variable."""
    found = verify_python_report(tmp_path, H200, CUDA_VISIBLE_DEVICES="none")["torch"]
    assert found == {"version": "2.11.0+cu130", "cuda": "13.0", "available": False,
                     "unavailable_reason": "CUDA_VISIBLE_DEVICES='none'"}
    (tmp_path / "b").mkdir()
    assert verify_python_report(tmp_path / "b", Gpu(count=4), CUDA_VISIBLE_DEVICES="2,1,x,0")["torch"]["count"] == 2


def test_a_real_nvidia_smi_is_never_taken_for_the_stand_in(tmp_path):
    """The stand-in torch simulates only the sandbox's stand-in GPUs: any other nvidia-smi, even one that
    answers, gives it none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 9.0, 143771'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    run = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                              "PYTHONPATH": str(stand_in_torch(tmp_path))})
    assert run.stdout.strip() == "False", run.stderr


@pytest.mark.parametrize("capture, arch", [("sample-own-arch.txt", "90"), ("sample-sm120.txt", "120")])
def test_the_stand_in_nvcc_builds_a_sample_that_prints_what_the_real_one_printed_on_the_h200(tmp_path, capture, arch):
    toolkit = write_toolkit_tree(tmp_path / "cuda-13.0", "13.0.1", "13.0.88")
    source = ROOT / "files" / "verify" / "vector_add.cu"
    path = f"{host_bin(tmp_path, H200)}:{os.environ['PATH']}"
    built = subprocess.run([str(toolkit / "bin" / "nvcc"), "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-o",
                            str(tmp_path / "sample"), str(source)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(tmp_path / "sample")], capture_output=True, text=True, timeout=60, env={"PATH": path})
    lines = ran.stdout.splitlines()
    assert lines[0] == "[SIMULATED by the stand-in nvcc's program: no GPU code ran]"
    assert lines[1:] == captured_output(capture)
    assert ran.returncode == {"90": 0, "120": 1}[arch]   # the captures' exit statuses


def test_the_stand_in_sample_finds_no_device_when_the_driver_is_not_loaded(tmp_path):
    toolkit = write_toolkit_tree(tmp_path / "cuda-13.0", "13.0.1", "13.0.88")
    subprocess.run([str(toolkit / "bin" / "nvcc"), "-gencode", "arch=compute_120,code=sm_120", "-o",
                    str(tmp_path / "sample"), str(ROOT / "files" / "verify" / "vector_add.cu")], check=True)
    path = f"{host_bin(tmp_path, Gpu(driver_loaded=False))}:{os.environ['PATH']}"
    ran = subprocess.run([str(tmp_path / "sample")], capture_output=True, text=True, timeout=60, env={"PATH": path})
    # vector_add.cu's own line when cudaGetDeviceCount fails (its exit 2)
    assert (ran.returncode, ran.stdout.splitlines()[-1]) == (
        2, "devices 0: FAIL cudaGetDeviceCount: no CUDA-capable device is detected")


def test_a_dressed_host_has_device_nodes_only_when_its_driver_is_loaded(tmp_path):
    unit = "etc/systemd/system/servestack-standin-gpu-nodes.service"
    loaded = dress_gpu_host(tmp_path / "a", gpu=Gpu(count=2), with_cuda_128=False, with_ml_env=False)
    text = (loaded / unit).read_text()
    assert "ExecStart=/usr/bin/touch /dev/nvidiactl /dev/nvidia0 /dev/nvidia1\n" in text
    assert (loaded / "etc/systemd/system/sysinit.target.wants/servestack-standin-gpu-nodes.service").is_symlink()
    not_loaded = dress_gpu_host(tmp_path / "b", gpu=Gpu(driver_loaded=False), with_cuda_128=False,
                                with_ml_env=False)
    assert not (not_loaded / unit).exists()
