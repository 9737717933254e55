"""GPU facts: parsers against real nvidia-smi output (shared/fixtures/h200-ubuntu2404), the
stand-in nvidia-smi run through the fact's own command, and the preflight GPU/driver checks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from facts.gpu import (
    QUERY_FIELDS,
    GpuReport,
    NvidiaGpus,
    gpu_command,
    parse_gpu_output,
    parse_gpu_query,
    parse_proc_driver_version,
)
from operations.preflight import check_compute_capability, check_driver, check_gpus
from sandbox.standins.nvidia_smi import Gpu as StandinGpu
from sandbox.standins.nvidia_smi import render_nvidia_smi
from servestack.settings import settings_from_data
from tests.unit.h200_captures import FIXTURES, fixture_lines


def settings(**data):
    if data.get("gpu_count", 8) < 8:
        data.setdefault("service_tp", data["gpu_count"])
    return settings_from_data("gpu-host", data)


def h200_report() -> GpuReport:
    lines = fixture_lines("nvidia-smi-query.txt")
    assert lines[0].startswith("index, name, compute_cap"), "the fixture's header names our fields"
    return parse_gpu_output(["smi_exit 0"] + [f"smi {line}" for line in lines[1:]])


def test_query_fields_match_the_captured_command():
    command = (FIXTURES / "nvidia-smi-query.txt").read_text().splitlines()[0]
    assert f"--query-gpu={','.join(QUERY_FIELDS)}" in command


def test_parse_real_h200_query():
    [gpu] = parse_gpu_query(fixture_lines("nvidia-smi-query.txt")[1:])
    assert gpu.index == 0
    assert gpu.name == "NVIDIA H200"
    assert gpu.compute_cap == "9.0"
    assert gpu.driver_version == "580.159.04"
    assert gpu.memory_mib == 143771
    assert gpu.uuid == "GPU-b9361222-cb9e-0727-9b70-c512a10ee626"
    assert gpu.bus_id == "00000000:00:06.0"


def test_parse_query_rejects_wrong_field_count():
    with pytest.raises(ValueError):
        parse_gpu_query(fixture_lines("nvidia-smi-query-noheader.txt"))


def test_driver_version_from_real_proc_file():
    assert parse_proc_driver_version("\n".join(fixture_lines("proc-driver-version.txt"))) == "580.159.04"


def test_driver_version_from_proprietary_module_line():
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.10  Fri Jan 17 21:26:24 UTC 2025"
    assert parse_proc_driver_version(line) == "570.86.10"


def test_report_of_real_h200():
    report = h200_report()
    assert report.error is None
    assert report.driver_version == "580.159.04"
    assert [g.name for g in report.gpus] == ["NVIDIA H200"]


def test_nvidia_smi_missing_falls_back_to_proc_for_the_driver():
    proc = [f"proc {line}" for line in fixture_lines("proc-driver-version.txt")]
    report = parse_gpu_output(["smi_missing"] + proc)
    assert report.gpus == ()
    assert report.driver_version == "580.159.04"
    assert "nvidia-smi not found" in report.error


def test_driver_not_loaded():
    message = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.")
    report = parse_gpu_output(["smi_exit 9", f"smi {message}"])
    assert report.driver_version is None
    assert "exit 9" in report.error and "couldn't communicate" in report.error


def test_no_devices_found():
    report = parse_gpu_output(["smi_exit 6", "smi No devices were found"])
    assert report.error.startswith("no GPU visible")


def _run_fact_command(tmp_path: Path, script: str) -> list[str]:
    """Run NvidiaGpus' own command with a stand-in nvidia-smi first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(script)
    smi.chmod(0o755)
    result = subprocess.run(["sh", "-c", gpu_command()], capture_output=True, text=True,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    # The build machine may or may not have /proc/driver/nvidia: keep only nvidia-smi's lines.
    return [line for line in result.stdout.splitlines() if not line.startswith("proc ")]


def test_fact_command_with_the_standin_blackwell_host(tmp_path):
    report = NvidiaGpus().process(_run_fact_command(tmp_path, render_nvidia_smi(StandinGpu())))
    assert report.error is None
    assert len(report.gpus) == 8
    assert {g.compute_cap for g in report.gpus} == {"12.0"}
    assert len({g.uuid for g in report.gpus}) == 8
    assert report.driver_version == "580.82.07"


def test_fact_command_with_the_driver_not_loaded(tmp_path):
    lines = _run_fact_command(tmp_path, render_nvidia_smi(StandinGpu(driver_loaded=False)))
    report = parse_gpu_output(lines)
    assert report.gpus == () and "couldn't communicate" in report.error


def test_wrong_architecture_names_each_gpu():
    check = check_compute_capability(settings(gpu_count=1), h200_report())
    assert check.status == "fail"
    assert "GPU 0 (NVIDIA H200, 00000000:00:06.0) is 9.0" in check.detail
    assert "12.0" in check.detail


def test_right_architecture_passes():
    report = h200_report()
    check = check_compute_capability(settings(gpu_count=1, gpu_compute_capability="9.0"), report)
    assert check.status == "ok"


def test_driver_compared_as_versions_not_strings():
    # As strings "580.159.04" < "580.82.07"; as versions 159 > 82.
    assert check_driver(settings(), h200_report()).status == "ok"


def test_driver_too_old_is_refused():
    old = GpuReport(driver_version="570.124.06")
    check = check_driver(settings(), old)
    assert check.status == "fail"
    assert "570.124.06 is older than 580.82.07" in check.detail


def test_no_driver_is_refused():
    check = check_driver(settings(), GpuReport(error="nvidia-smi not found (no NVIDIA driver installed?)"))
    assert check.status == "fail" and "no NVIDIA driver answers" in check.detail


def test_gpu_count_must_match():
    check = check_gpus(settings(gpu_count=8), h200_report())
    assert check.status == "fail" and "1 GPUs visible, expected 8" in check.detail
    assert check_gpus(settings(gpu_count=1), h200_report()).status == "ok"


def test_no_gpu_visible_is_refused():
    check = check_gpus(settings(), parse_gpu_output(["smi_exit 6", "smi No devices were found"]))
    assert check.status == "fail" and "no GPU visible" in check.detail


def test_preflight_and_the_verify_checks_judge_the_gpus_alike():
    """One judgement (servestack/checks/gpus.py): the same GPUs differ for both, each named."""
    from dataclasses import replace

    from servestack.checks.catalogue import CHECKS_BY_NAME
    from servestack.checks.readings import Readings

    [h200] = h200_report().gpus
    report = GpuReport(gpus=(h200, replace(h200, index=1, compute_cap="12.0", bus_id="00000000:00:07.0")),
                       driver_version=h200.driver_version)
    wanted = settings(gpu_count=2, gpu_compute_capability="12.0")
    preflight = check_compute_capability(wanted, report)
    verify = CHECKS_BY_NAME["gpu_capability"].outcome(wanted, Readings("gpu-host", gpu=report))
    assert preflight.status == "fail" and verify.status == "failed"
    assert "GPU 0 (NVIDIA H200, 00000000:00:06.0) is 9.0" in preflight.detail and "GPU 1" not in preflight.detail
    assert "GPU 0 (NVIDIA H200, 00000000:00:06.0) reports 9.0" in verify.detail and "GPU 1" not in verify.detail
    assert check_gpus(settings(gpu_count=1), report).status == "fail"
    one = settings(gpu_count=1)
    assert CHECKS_BY_NAME["gpu_count"].outcome(one, Readings("gpu-host", gpu=report)).status == "failed"

