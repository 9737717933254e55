"""The real H200 host of tests/fixtures/h200-ubuntu2404: its captured outputs, the expectations
run_on_device.sh's inventory set for it, and what every host-level check says of it."""

from __future__ import annotations

from pathlib import Path

from facts.framing import Section, printed
from facts.verify import REPORT
from servestack.checks.catalogue import CHECKS
from servestack.checks.outcome import PASSED
from servestack.checks.readings import Readings
from servestack.settings import settings_from_data

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200-ubuntu2404"


def fixture_lines(name: str) -> list[str]:
    """A fixture's output: without its first line (the command) and last line (`[exit N]`)."""
    path = FIXTURES / name
    lines = path.read_text().splitlines()
    assert lines[0].startswith("$ ") and lines[-1].startswith("[exit ")
    return lines[1:-1]


# What started the python probes' report line when the captures were made (2026-11-30, 2026-12-01);
# the probes now print their report as the section REPORT (facts/framing.py).
CAPTURED_REPORT_MARK = "::servestack-verify::"


def with_report_section(section: Section) -> Section:
    """A captured probe's output as the probe prints it today: its report line as the REPORT section."""
    lines = [line for captured in section.lines
             for line in (printed(REPORT, captured.removeprefix(CAPTURED_REPORT_MARK))
                          if captured.startswith(CAPTURED_REPORT_MARK + "{") else (captured,))]
    return Section(section.rc, tuple(lines))


def device_settings(**data):
    """The expectations run_on_device.sh's inventory set for that host (`data`: others instead)."""
    base = {"gpu_compute_capability": "9.0", "gpu_count": 1, "service_tp": 1, "cuda_link_policy": "new",
            "venv_path": "/opt/torch/.venv", "cuda_existing_toolkit": "accept"}
    return settings_from_data("@local", {**base, **data})


def assert_passes_every_host_level_check(readings: Readings, version_json: str) -> None:
    """`readings` of the H200 pass every host-level check against device_settings(), with the
    details that host gives; `version_json`: that check's detail, which depends on the captures."""
    settings = device_settings()
    details = {check.name: check.outcome(settings, readings) for check in CHECKS if not check.deployed}
    assert {name: result.status for name, result in details.items()} == {name: PASSED for name in details}
    assert details["driver_version"].detail == "driver 580.159.04 >= 580.82.07"
    assert details["version_json"].detail == version_json
    assert details["cuda_link"].detail == ("/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0 "
                                           "(policy 'new')")
    assert details["cuda_sample"].detail == ('built with `nvcc -gencode arch=compute_90,code=sm_90`; device 0 sm_90 '
                                             '"NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error; '
                                             'devices 1: PASS')
    assert details["torch_cuda_build"].detail == "torch 2.11.0+cu130, torch.version.cuda == '13.0'"
