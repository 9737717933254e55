"""The facts the verification checks and the deploy read, as they printed on a real H200
(docs/validation/h200-refactor-2026-12-01.md; tests/fixtures/h200-ubuntu2404/verify/fact-*.txt and
batch-*.txt): each fact's own parser on its real output, the batch's framing (facts/batch.py,
facts/framing.py) on a real batch, and every host-level check judged from them.

Unlike test_verify_checks.py's captures of 2026-11-30 (made before the refactor, translated line by
line), these are the refactored facts' own outputs, read with one translation: the python probe's
report line, which it now prints as a report section (h200_captures.py `with_report_section`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from facts.batch import FactRequest, section_name
from facts.framing import Section, split
from facts.verify import VerificationRecord
from servestack.checks.readings import Readings, requests
from tests.unit.h200_captures import assert_passes_every_host_level_check, device_settings, with_report_section

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200-ubuntu2404" / "verify"
# The groups of the "verify" batch, in the order run_on_device.sh sent them (one fact each on this
# host: one kept toolkit), then the verification record.
BATCH_GROUPS = ("gpu", "toolkit", "kept", "host", "python", "sample")
ALONE = {"gpu": "fact-nvidia-gpus.txt", "toolkit": "fact-cuda-toolkits.txt", "kept": "fact-toolkit-fingerprint.txt",
         "host": "fact-verify-host.txt", "python": "fact-verify-python.txt", "sample": "fact-cuda-sample.txt"}
# The "deploy-prepare" batch: every step's host_reads as they were on 2026-12-01 (facts.json of that
# run); the indices of the facts checked here.
PREPARE = {"NvidiaGpus": 0, "CudaToolkits": 3}
PREPARE_FACTS = 16


def lines(name: str) -> tuple[str, ...]:
    return tuple((CAPTURES / name).read_text().splitlines())


def request(group: str) -> FactRequest:
    (only,) = requests(device_settings(), group)
    return only


def alone(group: str):
    """The fact's value from its output read alone (exit 0, as host.get_fact saw it)."""
    return request(group).value(Section(0, lines(ALONE[group])))


def batch_sections(name: str) -> dict[str, Section]:
    return split(lines(name))


def captured_readings() -> Readings:
    readings = Readings("@local")
    for group in BATCH_GROUPS:
        value = alone(group)
        readings.store(group, [with_report_section(value) if group == "python" else value])
    return readings


@pytest.mark.parametrize("group", BATCH_GROUPS)
def test_each_fact_reads_the_same_alone_and_in_the_real_batch(group):
    sections = batch_sections("batch-verify-sh.txt")
    section = sections[section_name(BATCH_GROUPS.index(group))]
    assert section.rc == 0
    assert request(group).value(section) == alone(group)


def test_the_real_batch_frames_every_fact_and_the_reporting_facts_nest():
    sections = batch_sections("batch-verify-sh.txt")
    assert sorted(sections) == sorted(section_name(index) for index in range(len(BATCH_GROUPS) + 1))
    assert all(section.rc == 0 for section in sections.values())
    # VerifyPython and CudaSample frame their program's output themselves (facts/verify.py reporting)
    python = sections[section_name(BATCH_GROUPS.index("python"))]
    assert python.lines[0] == "@@servestack begin output" and python.lines[-1] == "@@servestack end output 0"
    record = FactRequest.of(VerificationRecord, path="/var/lib/servestack/verified.json")
    assert record.value(sections[section_name(len(BATCH_GROUPS))]) is None   # no record before the first run


def test_the_real_facts_parse_to_what_the_host_is():
    gpus = alone("gpu")
    assert gpus.error is None and gpus.driver_version == "580.159.04"
    assert [(gpu.name, gpu.compute_cap, gpu.memory_mib) for gpu in gpus.gpus] == [("NVIDIA H200", "9.0", 143771)]
    toolkits = alone("toolkit")
    assert toolkits.install.nvcc.version == "13.0.88" and toolkits.install.dpkg_owner == "cuda-nvcc-13-0"
    assert toolkits.install.version_json is None
    assert toolkits.link.describe() == "/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0"
    assert toolkits.kept == {"/usr/local/cuda-12.8": False}
    assert not alone("kept").present
    host = alone("host")
    assert host.devices == ("/dev/nvidiactl", "/dev/nvidia0")
    assert host.toolkit_package == ("dpkg cuda-nvcc-13-0 13.0.88-1", "dpkg-release cuda-compiler-13-0 13.0.2-1")
    assert host.venv == "/opt/torch/.venv" and not host.systemd and host.unit_exit == 127
    assert not host.unit_readable and host.secrets_file is None


def test_the_real_h200_facts_pass_every_host_level_check():
    # the release comes from the meta package (the 2026-11-30 captures predate verify-host.sh asking for it)
    assert_passes_every_host_level_check(captured_readings(), version_json=(
        "no version.json: toolkit from dpkg package cuda-nvcc-13-0 13.0.88-1, release cuda-compiler-13-0 13.0.2-1; "
        "nvcc 13.0.88 as pinned, accepted (cuda_existing_toolkit = 'accept')"))


def test_the_deploys_real_prepare_batch_reads_the_gpus_and_toolkits_as_alone():
    sections = batch_sections("batch-deploy-prepare-sh.txt")
    assert sorted(sections) == sorted(section_name(index) for index in range(PREPARE_FACTS))
    assert all(section.rc == 0 for section in sections.values())
    assert request("gpu").value(sections[section_name(PREPARE["NvidiaGpus"])]) == alone("gpu")
    assert request("toolkit").value(sections[section_name(PREPARE["CudaToolkits"])]) == alone("toolkit")
