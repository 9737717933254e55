"""The verification checks: their facts' commands (files/scripts/verify-*) run with real sh on a
fake host tree built from outputs captured on a real H200 host (tests/fixtures/h200-ubuntu2404),
and the judgements on what they read."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from facts.framing import BEGIN, Section, printed
from facts.gpu import SMI_TIMEOUT_S, parse_gpu_output
from facts.toolkit import fingerprint_command, parse_fingerprint, parse_toolkits
from facts.verify import (OUTPUT, REPORT, SAMPLE_SOURCE, CudaSample, HostReport, VerifyHost, parse_host_report,
                          reporting, reported)
from operations.toolkit import kept_paths
from sandbox.standins.toolkit import nvcc_version_text
from servestack import patchlib
from servestack.checks.catalogue import CHECKS, CHECKS_BY_NAME, groups_for
from servestack.checks.outcome import FAILED, PASSED, SKIPPED, Outcome
from servestack.checks.parse import patch_record_for, report
from servestack.checks.readings import GROUPS, Readings, read_batch, requests
from servestack.manifest import DEFAULT_MANIFEST, load_manifest
from servestack.scripts import script_text
from servestack.settings import settings_from_data
from tests.unit.h200_captures import assert_passes_every_host_level_check, device_settings, with_report_section

STATE = ("gpu", "toolkit", "kept", "host")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "h200-ubuntu2404"
VERIFY_TESTS = ROOT / "tests" / "verify"


def real(name: str) -> tuple[str, int]:
    """A captured output: (text between the command line and the `[exit N]` line, N)."""
    lines = (FIXTURES / name).read_text().splitlines()
    exit_line = lines[-1]
    match = re.search(r"\[exit (\d+)\]$", exit_line)
    body = lines[1:-1] + ([exit_line[:match.start()]] if exit_line[:match.start()].strip() else [])
    return "\n".join(body) + "\n", int(match.group(1))


def write_script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


class FakeHost:
    """A host tree under tmp_path: the real H200's nvidia-smi, nvcc, dpkg and /usr/local/cuda chain."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.local = root / "usr" / "local"
        self.cuda = self.local / "cuda-13.0"
        self.state = root / "var" / "lib" / "servestack"
        self.state.mkdir(parents=True)
        smi, _ = real("nvidia-smi-query.txt")
        rows = smi.splitlines()[1:]  # the capture has the csv header; the fact asks for noheader
        write_script(self.bin / "nvidia-smi", "#!/bin/sh\ncat <<'EOF'\n" + "\n".join(rows) + "\nEOF\n")
        nvcc, _ = real("nvcc-version.txt")
        self.nvcc(self.cuda, nvcc)
        dpkg = {line.split()[1]: line.split()[2] for line in real("dpkg-cuda.txt")[0].splitlines()}
        write_script(self.bin / "dpkg", '#!/bin/sh\n[ "$1" = -S ] && echo "cuda-nvcc-13-0: $2"\n')
        self.dpkg_admin = root / "var" / "lib" / "dpkg"  # the package lists verify-host.sh greps first
        (self.dpkg_admin / "info").mkdir(parents=True)
        (self.dpkg_admin / "info" / "cuda-nvcc-13-0.list").write_text(f"/usr/local\n{self.cuda}/bin/nvcc\n")
        write_script(self.bin / "dpkg-query", (  # the two queries verify-host.sh makes, answered from the real list
            '#!/bin/sh\ncase "$*" in\n'
            f'*Status-Abbrev*) echo "ii  cuda-compiler-13-0 {dpkg["cuda-compiler-13-0"]}";;\n'
            f'*) echo "dpkg cuda-nvcc-13-0 {dpkg["cuda-nvcc-13-0"]}";;\nesac\n'))
        write_script(self.bin / "rpm", "#!/bin/sh\nexit 1\n")
        # /usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0, as on the real host
        (root / "etc" / "alternatives").mkdir(parents=True)
        (root / "etc" / "alternatives" / "cuda").symlink_to(self.cuda)
        (self.local / "cuda").symlink_to(root / "etc" / "alternatives" / "cuda")
        manifest = DEFAULT_MANIFEST.read_text().replace('link_path = "/usr/local/cuda"',
                                                         f'link_path = "{self.local / "cuda"}"')
        self.manifest = root / "stack.toml"
        self.manifest.write_text(manifest)

    @staticmethod
    def nvcc(toolkit: Path, text: str) -> None:
        write_script(toolkit / "bin" / "nvcc", "#!/bin/sh\ncat <<'EOF'\n" + text + "EOF\n")

    def settings(self, **data):
        base = {"servestack_manifest": str(self.manifest), "cuda_install_path": str(self.cuda),
                "servestack_state_dir": str(self.state), "venv_path": str(self.root / "opt" / "ml-env"),
                "gpu_compute_capability": "9.0", "gpu_count": 1, "service_tp": 1, "cuda_link_policy": "new"}
        return settings_from_data("h200", {**base, **data})

    def run(self, script: str) -> str:
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "DPKG_ADMINDIR": str(self.dpkg_admin)}
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def read(self, settings, *groups: str) -> Readings:
        """What the checks of `groups` (default: the host's state) read here, as they read a host."""
        readings = Readings("h200")
        for group in groups or STATE:
            readings.store(group, read_batch(self.run, requests(settings, group, readings)))
        return readings

    def record(self, settings, link_resolved: str | None = None) -> None:
        """toolkits.json as the toolkit step writes it: kept toolkits' fingerprints, the link chain."""
        toolkits = {}
        for path in kept_paths(settings):
            lines = self.run(fingerprint_command(path)).splitlines()
            toolkits[path] = parse_fingerprint(path, lines).to_record()
        link = {"path": str(self.local / "cuda"), "hops": [], "resolved": link_resolved, "kind": "link"}
        (self.state / "toolkits.json").write_text(json.dumps({"schema": 1, "toolkits": toolkits, "link": link}))


@pytest.fixture
def h200(tmp_path) -> FakeHost:
    return FakeHost(tmp_path)


def outcome(check: str, settings, readings, *args) -> Outcome:
    return CHECKS_BY_NAME[check].outcome(settings, readings, *args)


# --- the facts' commands ----------------------------------------------------------------


def test_a_reported_command_keeps_its_output_and_exit_status():
    def run(command):
        return reported(subprocess.run(["sh", "-c", reporting(command)], capture_output=True, text=True)
                        .stdout.splitlines())

    assert run("echo line 1; echo line 2 >&2") == Section(0, ("line 1", "line 2"))
    assert run("printf '{\"no\": \"newline\"}'; exit 3") == Section(3, ('{"no": "newline"}',))
    assert run("echo a; echo") == Section(0, ("a", ""))
    assert run("exit 127") == Section(127, ())
    assert reported([BEGIN + OUTPUT, "cut off"]) == Section(None, ("cut off",))


def test_every_read_is_valid_sh_and_succeeds_where_nothing_is_installed(h200):
    """pyinfra fails a host whose fact command fails: the checks' reads report what is missing."""
    settings = h200.settings(service_secret_env=["HF_TOKEN"], service_env={"NCCL_P2P_DISABLE": "1"})
    for group in GROUPS:
        for request in requests(settings, group, Readings("h200")):
            command = request.command()
            assert subprocess.run(["sh", "-n", "-c", command]).returncode == 0, group
            h200.run(command)  # exits 0
    for name in ("verify-host.sh", "verify-sample.sh", "verify-http.sh"):
        assert subprocess.run(["bash", "-n", "-c", script_text(name)]).returncode == 0, name
    assert len(requests(settings, "host")[0].command()) < 32 * 1024  # one SSH argument, well under 128 KiB


@pytest.mark.parametrize("name", ["verify-host.sh", "verify-sample.sh", "verify-http.sh", "verify-python.py",
                                  "verify-http.py"])
def test_each_verify_script_states_its_contract_at_the_top(name):
    text = script_text(name)
    assert text.startswith(f"# {name} " if name.endswith(".sh") else f'"""{name} ')
    assert "Output" in text and "Exit: " in text


def test_the_gpus_and_toolkits_are_read_with_the_steps_own_facts(h200):
    """The GPUs as preflight reads them, the toolkits as the toolkit step does: one read each per
    stage while nothing changed (servestack.reads), nvidia-smi and nvcc once."""
    from operations import preflight, toolkit

    settings = h200.settings()
    assert requests(settings, "gpu")[0].key in {request.key for request in preflight.host_reads(settings)}
    assert requests(settings, "toolkit")[0].key in {request.key for request in toolkit.host_reads(settings)}


def test_the_toolkit_path_of_a_directory_is_resolved_without_readlink(h200):
    settings = h200.settings()
    started = h200.root / "started"
    write_script(h200.bin / "readlink", f"#!/bin/sh\necho readlink >> {started}; exec /bin/readlink \"$@\"\n")
    assert h200.read(settings, "host").host.toolkit_path == str(h200.cuda)
    assert not started.exists()


# --- GPU: the real H200's nvidia-smi ------------------------------------------------------


def test_the_real_h200_passes_the_gpu_checks_with_its_own_expectations(h200):
    settings = h200.settings()
    readings = h200.read(settings)
    assert outcome("driver_version", settings, readings).detail == "driver 580.159.04 >= 580.82.07"
    assert outcome("gpu_capability", settings, readings).passed
    assert outcome("gpu_count", settings, readings).passed


def test_the_h200_fails_the_sm120_expectations_naming_the_gpu(h200):
    settings = h200.settings(gpu_compute_capability="12.0", gpu_count=8, service_tp=8)
    readings = h200.read(settings)
    capability = outcome("gpu_capability", settings, readings)
    assert capability.status == FAILED
    assert capability.detail == ("expected compute capability 12.0 on h200: "
                                 "GPU 0 (NVIDIA H200, 00000000:00:06.0) reports 9.0")
    assert outcome("gpu_count", settings, readings).detail == (
        "nvidia-smi lists 1 GPU(s) on h200, host data gpu_count is 8")


def test_driver_versions_compare_as_versions_not_strings(h200):
    settings = h200.settings()
    smi = h200.bin / "nvidia-smi"
    smi.write_text(smi.read_text().replace("580.159.04", "580.65.06"))  # "580.65" > "580.159" as text
    result = outcome("driver_version", settings, h200.read(settings))
    assert result.status == FAILED and "580.65.06 on h200 is older than the manifest minimum 580.82.07" in result.detail


NOT_COMMUNICATING = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


@pytest.mark.parametrize("smi, cause", [
    (None, "nvidia-smi not found (no NVIDIA driver installed?)"),
    # the real message and status of a host whose kernel module did not load (nvidia-smi(1): 9 "NVIDIA driver
    # is not loaded")
    (f"echo \"{NOT_COMMUNICATING}\"; exit 9",
     f"nvidia-smi failed (exit 9: NVIDIA driver is not loaded): {NOT_COMMUNICATING}"),
    ("exit 124", "nvidia-smi did not answer within 60 s (exit 124: the driver hangs)"),   # coreutils timeout
    ("echo 'No devices were found'; exit 6", "no GPU visible (nvidia-smi exit 6: No devices were found)"),
    ("echo 'garbled'", "unexpected nvidia-smi output: expected 7 values, got ['garbled']"),
])
def test_where_host_data_expects_gpus_a_driver_that_does_not_answer_fails_each_gpu_check(h200, smi, cause):
    settings = h200.settings()
    (h200.bin / "nvidia-smi").unlink()
    if smi is not None:
        write_script(h200.bin / "nvidia-smi", f"#!/bin/sh\n{smi}\n")
    readings = h200.read(settings)
    for check in ("driver_version", "gpu_capability", "gpu_count"):
        result = outcome(check, settings, readings)
        assert (result.status, result.detail) == (
            FAILED, f"no NVIDIA driver answers on h200, host data expects gpu_count = 1: {cause}")


# --- toolkit: the real nvcc, dpkg-packaged tree, alternatives chain -------------------------


def test_a_distribution_packaged_toolkit_is_judged_by_its_packages(h200):
    settings = h200.settings()
    readings = h200.read(settings)
    assert outcome("nvcc_version", settings, readings).detail.endswith("reports release 13.0, V13.0.88")
    result = outcome("version_json", settings, readings)
    assert result.status == FAILED  # nvcc 13.0.88 is in 13.0.1 and 13.0.2: not confirmed as 13.0.1
    assert result.detail == (
        f"{h200.cuda}/version.json is missing on h200: a toolkit from dpkg package cuda-nvcc-13-0 13.0.88-1, "
        "release cuda-compiler-13-0 13.0.2-1, which cannot be confirmed as CUDA 13.0.1 (its nvcc 13.0.88 is "
        "shared by other releases); host data cuda_existing_toolkit = 'accept' accepts it")
    accepted = h200.settings(cuda_existing_toolkit="accept")
    result = outcome("version_json", accepted, h200.read(accepted))
    assert result.passed and "release cuda-compiler-13-0 13.0.2-1; nvcc 13.0.88 as pinned, accepted" in result.detail


def test_version_json_missing_with_no_owner_fails(h200):
    settings = h200.settings(cuda_existing_toolkit="accept")
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")
    result = outcome("version_json", settings, h200.read(settings))
    assert result.status == FAILED and "version.json is missing on h200 and no package owns" in result.detail


def test_a_toolkit_assembled_from_nvidia_wheels_is_recognised_by_their_dist_info(h200):
    settings = h200.settings(cuda_existing_toolkit="accept")
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")
    (h200.cuda / "dist-info" / "nvidia_cuda_nvcc-13.0.88.dist-info").mkdir(parents=True)
    result = outcome("version_json", settings, h200.read(settings))
    assert result.passed and "toolkit from wheel package nvidia-cuda-nvcc 13.0.88;" in result.detail


def test_a_toolkit_with_version_json_is_not_looked_up_in_the_package_lists(h200):
    """The package query only serves a toolkit without version.json (the runfile's has one)."""
    settings = h200.settings()
    assert h200.read(settings, "host").host.toolkit_package[0] == "dpkg cuda-nvcc-13-0 13.0.88-1"
    (h200.cuda / "version.json").write_text(json.dumps(
        {"cuda": {"name": "CUDA SDK", "version": "13.0.1"}, "cuda_nvcc": {"name": "CUDA NVCC", "version": "13.0.88"}}))
    write_script(h200.bin / "grep", "#!/bin/sh\necho grep ran >&2; exit 2\n")
    readings = h200.read(settings)
    assert readings.host.toolkit_package == ()
    assert outcome("version_json", settings, readings).passed


@pytest.mark.parametrize("cuda, nvcc_version, status", [
    ("13.0.1", "13.0.88", PASSED), ("13.0.20250801", "13.0.88", PASSED),
    ("13.0.2", "13.0.88", FAILED), ("13.0.1", "12.8.93", FAILED)])
def test_version_json_of_a_runfile_install_must_agree(h200, cuda, nvcc_version, status):
    settings = h200.settings()
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")  # a runfile install belongs to no package
    (h200.cuda / "version.json").write_text(json.dumps(
        {"cuda": {"name": "CUDA SDK", "version": cuda}, "cuda_nvcc": {"name": "CUDA NVCC", "version": nvcc_version}}))
    assert outcome("version_json", settings, h200.read(settings)).status == status


def test_a_wrong_nvcc_fails(h200):
    settings = h200.settings()
    h200.nvcc(h200.cuda, nvcc_version_text("12.8.93"))
    result = outcome("nvcc_version", settings, h200.read(settings))
    assert result.status == FAILED and "reports V12.8.93, the manifest pins V13.0.88" in result.detail


def test_the_alternatives_chain_counts_by_where_it_ends(h200):
    settings = h200.settings(cuda_link_policy="new")
    result = outcome("cuda_link", settings, h200.read(settings))
    assert result.passed, result.detail
    assert f"{h200.local}/cuda -> {h200.root}/etc/alternatives/cuda -> {h200.cuda}" in result.detail


def test_link_policy_keep_compares_with_the_record_taken_before_the_install(h200):
    settings = h200.settings(cuda_link_policy="keep")
    assert "no record of where" in outcome("cuda_link", settings, h200.read(settings)).detail
    h200.record(settings, link_resolved=str(h200.local / "cuda-12.8"))
    result = outcome("cuda_link", settings, h200.read(settings))
    assert result.status == FAILED and f"before the install, now {h200.local}/cuda ->" in result.detail
    h200.record(settings, link_resolved=str(h200.cuda))
    assert outcome("cuda_link", settings, h200.read(settings)).passed


def test_the_kept_toolkit_must_keep_its_recorded_fingerprint(h200):
    settings = h200.settings()
    kept = h200.local / "cuda-12.8"
    h200.nvcc(kept, nvcc_version_text("12.8.93"))
    (kept / "lib64").mkdir()
    (kept / "lib64" / "libcudart.so.12").write_bytes(b"x" * 100)
    assert outcome("kept_toolkits", settings, h200.read(settings)).status == FAILED  # no record yet
    h200.record(settings)
    result = outcome("kept_toolkits", settings, h200.read(settings))
    assert result.detail == f"{kept} unchanged (4 files, nvcc 12.8.93)"
    (kept / "lib64" / "libcudart.so.12").write_bytes(b"x" * 101)  # "a changed 12.8 file"
    result = outcome("kept_toolkits", settings, h200.read(settings))
    assert result.status == FAILED
    assert result.detail == (f"on h200: {kept} changed since it was recorded: "
                             "file list or sizes changed (4 files before, 4 now)")


# --- the CUDA sample ------------------------------------------------------------------------


def sample_read(rc: int, text: str) -> Readings:
    return Readings("h200", sample=Section(rc, tuple(text.splitlines())))


def test_the_sample_passes_only_when_every_device_added_correctly(h200):
    settings = h200.settings()
    good = ('nvcc -gencode arch=compute_90,code=sm_90\n'
            'device 0 sm_90 "NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error\ndevices 1: PASS')
    assert outcome("cuda_sample", settings, sample_read(0, good)).passed
    wrong_arch = ('nvcc -gencode arch=compute_120,code=sm_120\n'
                  'device 0 sm_90 "NVIDIA H200": FAIL bad=1048576/1048576 launch=no error sync=no error\n'
                  'devices 1: FAIL')
    result = outcome("cuda_sample", settings, sample_read(1, wrong_arch))
    assert result.status == FAILED and "FAIL bad=1048576/1048576" in result.detail


def test_the_sample_reports_compiler_failures_and_fails_without_a_gpu_device(h200):
    settings = h200.settings()
    result = outcome("cuda_sample", settings, sample_read(7, "nvcc -gencode arch=compute_90,code=sm_90\n"
                                                               "nvcc fatal : cannot find g++\nnvcc failed"))
    assert result.status == FAILED and "cannot find g++" in result.detail
    no_node = outcome("cuda_sample", settings, sample_read(4, "no /dev/nvidiactl"))
    assert (no_node.status, no_node.detail) == (
        FAILED, "no /dev/nvidiactl on h200, host data expects gpu_count = 1: "
                "the NVIDIA kernel module made no device node the CUDA runtime could open")


def test_the_sample_source_checks_launch_errors_and_every_result():
    source = SAMPLE_SOURCE.read_text()
    assert "cudaGetLastError()" in source and "cudaDeviceSynchronize()" in source
    assert "c[i] != 3.0f * (float)i" in source


def test_the_sample_script_exits_4_where_there_is_no_gpu_device_node(h200):
    settings = h200.settings()
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA device node")
    assert h200.read(settings, "sample").sample.rc == 4


def run_sample_script(h200, nvcc: str, sample: str, smi: str = "printf '9.0\\n9.0\\n'",
                      smi_timeout: int = SMI_TIMEOUT_S) -> Section:
    """verify-sample.sh with stand-ins for nvidia-smi (its shell `smi`) and nvcc (whose program
    prints $SAMPLE), its device node test taken as passed (this machine has no GPU)."""
    write_script(h200.bin / "nvidia-smi", f"#!/bin/sh\n{smi}\n")
    write_script(h200.bin / "nvcc", "#!/bin/sh\n" + nvcc)
    env = {"NVCC": str(h200.bin / "nvcc"), "WORK_PARENT": str(h200.state),
           "PATH": f"{h200.bin}:{os.environ['PATH']}", "SAMPLE": sample, "SMI_TIMEOUT": str(smi_timeout)}
    text = script_text("verify-sample.sh").replace("test -e /dev/nvidiactl", "true")  # no device node here
    run = subprocess.run(["bash", "-c", reporting(f"bash -c {shlex.quote(text)} verify-sample.sh")],
                         capture_output=True, text=True, env=env, timeout=60)
    return reported(run.stdout.splitlines())


def test_the_sample_script_builds_for_each_gpu_architecture_once_and_cleans_up(h200):
    # the stand-in nvcc writes a program printing $SAMPLE, from the flags and -o it was given
    nvcc = ('echo "flags: $*" | sed "s# -o .*##"; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
            'printf "#!/bin/sh\\nprintf \'%%s\\\\n\' \\"\\$SAMPLE\\"\\n" > "$out"; chmod +x "$out"\n')
    result = run_sample_script(h200, nvcc, "devices 2: PASS")
    assert result.rc == 0, result
    assert result.lines[0] == "nvcc -gencode arch=compute_90,code=sm_90"
    assert result.lines[-1] == "devices 2: PASS"
    assert list(h200.state.iterdir()) == []  # the work directory is gone
    failed = run_sample_script(h200, "echo 'nvcc fatal : cannot find g++' >&2; exit 1\n", "")
    assert failed.rc == 7 and "nvcc fatal : cannot find g++" in failed.lines and failed.lines[-1] == "nvcc failed"
    assert list(h200.state.iterdir()) == []


def test_the_sample_script_gives_a_hung_nvidia_smi_the_gpu_facts_time_and_no_more(h200):
    started = time.monotonic()
    hung = run_sample_script(h200, "exit 1\n", "", smi="exec sleep 30", smi_timeout=1)
    assert time.monotonic() - started < 20
    assert hung.rc == 5 and hung.lines[-1] == "nvidia-smi reported no compute capability within 1 s"
    assert f"SMI_TIMEOUT={SMI_TIMEOUT_S} " in CudaSample().command(nvcc="/x/nvcc", work_parent="/var/lib/servestack")


# --- the release: torch and packages ------------------------------------------------------


def torch_report(**torch) -> Readings:
    text, _ = real("torch.txt")
    version, cuda = text.splitlines()[1].split()
    info = {"version": version, "cuda": cuda, "available": True, "count": 1, "names": ["NVIDIA H200"],
            "capabilities": [[9, 0]], "ops": [{"device": 0, "sum": 1047552.0, "matmul": 262144.0}], **torch}
    manifest = load_manifest()   # the default profile's stack
    stack = manifest.stacks[manifest.service["profiles"][manifest.service["profile"]]["stack"]]
    packages = {package.name: package.version for package in stack.packages}
    found = {"prefix": "/opt/ml-env", "packages": packages, "torch": info}
    return Readings("h200", python=Section(0, ("warning: noise", *printed(REPORT, json.dumps(found)))))


def test_the_real_h200_torch_passes_the_torch_checks(h200):
    settings = h200.settings()
    readings = torch_report()
    assert outcome("torch_cuda_build", settings, readings).detail == "torch 2.11.0+cu130, torch.version.cuda == '13.0'"
    assert outcome("torch_device_capability", settings, readings).passed
    assert outcome("torch_cuda_op", settings, readings).passed


def test_torch_checks_fail_on_the_wrong_gpu_or_result_and_without_cuda(h200):
    settings = h200.settings(gpu_compute_capability="12.0")
    assert "torch sees 1: cuda:0 is (9, 0)" in outcome("torch_device_capability", settings, torch_report()).detail
    wrong = torch_report(ops=[{"device": 0, "error": "CUDA error: no kernel image is available for execution"}])
    assert "no kernel image" in outcome("torch_cuda_op", settings, wrong).detail
    assert outcome("torch_cuda_build", settings, torch_report(cuda="12.8")).status == FAILED
    # what real torch warns from is_available() on a host without a driver (torch/cuda/__init__.py)
    reason = ("CUDA initialization: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
              "and installed a driver from http://www.nvidia.com/Download/index.aspx")
    no_gpu = torch_report(available=False, unavailable_reason=reason)
    for check in ("torch_device_capability", "torch_cuda_op", "sglang_sm120"):
        result = outcome(check, settings, no_gpu)
        assert (result.status, result.detail) == (
            FAILED, f"torch.cuda.is_available() is False on h200, host data expects gpu_count = 1: {reason}")


def test_package_versions_must_match_local_labels_too(h200):
    settings = h200.settings()
    readings = torch_report()
    assert outcome("package_version", settings, readings, "torch").detail == "torch 2.9.1+cu130"
    found = report(readings.python)
    found["packages"]["torch"] = "2.9.1+cu128"
    found["packages"]["sgl-kernel"] = None
    readings = Readings("h200", python=Section(0, printed(REPORT, json.dumps(found))))
    assert outcome("package_version", settings, readings, "torch").detail == (
        "torch 2.9.1+cu128 in /opt/ml-env on h200, expected 2.9.1+cu130")
    assert "sgl-kernel is not installed" in outcome("package_version", settings, readings, "sgl-kernel").detail


def test_the_python_probe_runs_in_the_venv_and_reports_what_is_missing(h200, tmp_path):
    settings = h200.settings(venv_path=str(tmp_path / "venv"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.9.1+cu128'\nclass version:\n    cuda = '12.8'\n"
        "import warnings\n\n\ndef _none():\n    warnings.warn('CUDA initialization: Found no NVIDIA driver')\n"
        "    return False\n\n\nclass cuda:\n    is_available = staticmethod(_none)\n")
    (site / "torch-2.9.1+cu128.dist-info").mkdir()
    (site / "torch-2.9.1+cu128.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.9.1+cu128\n")
    readings = h200.read(settings, "python")
    assert outcome("torch_cuda_build", settings, readings).detail.endswith("is built for CUDA 12.8, expected 13.0")
    assert "torch 2.9.1+cu128 in" in outcome("package_version", settings, readings, "torch").detail
    flashinfer = outcome("package_version", settings, readings, "flashinfer-python")
    assert "flashinfer-python is not installed" in flashinfer.detail
    assert outcome("torch_cuda_op", settings, readings).detail == (
        "torch.cuda.is_available() is False on h200, host data expects gpu_count = 1: "
        "CUDA initialization: Found no NVIDIA driver")   # the warning, as verify-python.py caught it
    assert "ModuleNotFoundError" in report(readings.python)["sm120_error"]


def test_a_missing_venv_python_fails_the_release_checks(h200):
    settings = h200.settings()
    result = outcome("torch_cuda_build", settings, h200.read(settings, "python"))
    assert result.status == FAILED and "no python at" in result.detail and "(exit 127)" in result.detail


# --- patches --------------------------------------------------------------------------------


def patch_read(record: str = "current", state: str = "applied") -> Readings:
    found = {"installed": True, "version": "0.5.9", "patch_set": "0.5.9", "record": record,
             "record_path": "/opt/servestack/releases/r-1/patches.json",
             "patches": [{"name": "0001-sm120-torch-symm-mem", "state": state}]}
    return Readings("h200", patches=Section(0, printed(patchlib.RESULT, json.dumps(found))))


def test_patches_must_be_applied_and_match_their_record(h200):
    settings = h200.settings()
    assert outcome("patches_applied", settings, patch_read()).passed
    modified = outcome("patches_applied", settings, patch_read(record="stale"))
    assert modified.status == FAILED and "is stale" in modified.detail
    assert "is conflict" in outcome("patches_applied", settings, patch_read(state="conflict")).detail


def test_an_sglang_without_a_patch_set_is_a_skip_not_a_pass(h200):
    """GLM-5's stack (sglang 0.5.14) has no servestack patch set: nothing is checked, so nothing passes."""
    found = {"installed": True, "version": "0.5.14", "patch_set": None, "record": None, "patches": []}
    readings = Readings("h200", patches=Section(0, printed(patchlib.RESULT, json.dumps(found))))
    result = outcome("patches_applied", h200.settings(), readings)
    assert result.status == SKIPPED
    assert result.detail == "sglang 0.5.14 on h200 has no servestack patch set: nothing to check"


def test_the_patch_check_reports_a_missing_python_as_the_check_says(h200):
    settings = h200.settings()
    result = outcome("patches_applied", settings, h200.read(settings, "host", "patches"))
    assert result.status == FAILED and result.detail == f"no python at {settings.venv_path}/bin/python on h200"


def test_the_patch_record_of_the_active_release_is_chosen_from_what_the_host_read():
    assert patch_record_for(HostReport(venv="/opt/r/r-1/venv", records=("/opt/r/r-1/patches.json",))) == \
        "/opt/r/r-1/patches.json"
    assert patch_record_for(HostReport(venv="/opt/r/r-1/venv")) is None


def test_the_host_script_finds_the_active_release_and_its_records(h200):
    release = h200.root / "opt" / "servestack" / "releases" / "r-1"
    site = release / "venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (release / "patches.json").write_text("{}")
    (h200.root / "opt" / "ml-env").symlink_to(release / "venv")
    host = h200.read(h200.settings(), "host").host
    assert host.venv == str(release / "venv")
    assert host.records == (str(release / "patches.json"),)
    record_sha256 = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # of "{}"
    assert [line.split()[0] for line in host.release_state] == [str(site), record_sha256]


def test_a_version_edited_in_place_changes_the_release_state_the_reuse_is_keyed_on(h200):
    """An in-place edit of a dist-info's METADATA leaves site-packages' mtime as it was; the state the
    deploy's verify step keys its reuse on (operations/verify.py state_key) still changes."""
    release = h200.root / "opt" / "servestack" / "releases" / "r-1"
    site = release / "venv" / "lib" / "python3.12" / "site-packages"
    (site / "torch-2.9.1+cu130.dist-info").mkdir(parents=True)
    metadata = site / "torch-2.9.1+cu130.dist-info" / "METADATA"
    metadata.write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1+cu130\n")
    (h200.root / "opt" / "ml-env").symlink_to(release / "venv")
    before = h200.read(h200.settings(), "host").host.release_state
    mtime = site.stat().st_mtime
    metadata.write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1+cu128\n")
    os.utime(site, (mtime, mtime))
    after = h200.read(h200.settings(), "host").host.release_state
    assert before[0].split()[:2] == after[0].split()[:2]   # the same site-packages, the same mtime
    assert before != after


def test_the_active_release_is_named_through_a_linked_releases_dir(h200):
    """The releases dir may be a link to another disk (/opt/servestack -> /data/servestack): the
    host script reports the venv path's link as written, which names the release, as the venv
    step reads it."""
    disk = h200.root / "data" / "releases"
    (disk / "r-0123456789ab" / "venv" / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    (h200.root / "opt" / "servestack").mkdir(parents=True)
    (h200.root / "opt" / "servestack" / "releases").symlink_to(disk)
    settings = h200.settings(venv_releases_dir=str(h200.root / "opt" / "servestack" / "releases"))
    linked = f"{settings.venv_releases_dir}/r-0123456789ab/venv"
    (h200.root / "opt" / "ml-env").symlink_to(linked)
    host = h200.read(settings, "host").host
    assert (host.venv, host.venv_link) == (str(disk / "r-0123456789ab" / "venv"), linked)
    result = outcome("service_environment", settings, service_read(settings, venv=host.venv))
    assert result.passed, result.detail


# --- the service ------------------------------------------------------------------------------


def documented_environment(settings, release: str = "r-0123456789ab") -> dict:
    """A converged service's environment, written out as docs/operating.md ("service": CUDA 13.0 pinned in its
    environment) and docs/design.md (the JIT caches of one toolkit + release under
    /var/cache/servestack/flashinfer/) describe the unit: the manifest's toolkit first, the release's python,
    the service user's home, then host data."""
    cuda, venv = settings.cuda_install_path, f"{settings.venv_releases_dir}/{release}/venv"
    cache = f"/var/cache/servestack/flashinfer/13.0.1-{release}"
    return {"CUDA_HOME": cuda, "CUDA_PATH": cuda,
            "PATH": f"{cuda}/bin:{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LD_LIBRARY_PATH": f"{cuda}/lib64", "CUDA_LIB_PATH": f"{cuda}/lib64", "FLASHINFER_WORKSPACE_BASE": cache,
            "TRITON_CACHE_DIR": f"{cache}/triton",
            "SGLANG_DG_CACHE_DIR": f"{cache}/deep_gemm", "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
            "HOME": "/var/lib/sglang", "SERVESTACK_RELEASE": release, "SERVESTACK_PATCHSET": "digest",
            **settings.service_env}


def service_read(settings, env: dict | None = None, user: str = "sglang", stat: str = "600 root root",
                  names: int = 0, values: int = 0, active: str = "active", venv: str | None = None) -> Readings:
    """The service as the checks read it; `venv`: where venv_path resolves (default: as linked)."""
    pinned = documented_environment(settings)
    linked = f"{settings.venv_releases_dir}/r-0123456789ab/venv"
    return Readings("h200", host=HostReport(
        systemd=True, venv=venv or linked, venv_link=linked,
        unit={"LoadState": "loaded", "UnitFileState": "enabled", "ActiveState": active, "SubState": "running",
              "MainPID": "42"},
        process_user=user, process_env={**pinned, **(env or {})},
        unit_readable=True, unit_secret_names=names, unit_secret_values=values, secrets_file=stat))


def test_a_converged_service_passes(h200):
    settings = h200.settings(service_env={"NCCL_P2P_DISABLE": "1"})
    readings = service_read(settings)
    for check in ("service_active", "service_user", "service_environment", "service_secrets"):
        assert outcome(check, settings, readings).passed, outcome(check, settings, readings).detail


def test_a_stopped_service_fails(h200):
    settings = h200.settings()
    result = outcome("service_active", settings, service_read(settings, active="inactive"))
    assert result.detail == ("sglang.service on h200 must be enabled and active: "
                             "UnitFileState=enabled, ActiveState=inactive/running")


def test_a_service_systemd_gave_up_on_is_named_so(h200):
    """The unit's start limit (StartLimitBurst): systemd stops restarting a server that keeps exiting."""
    settings = h200.settings()
    readings = service_read(settings, active="failed")
    readings.host.unit.update(SubState="failed", Result="start-limit-hit")
    result = outcome("service_active", settings, readings)
    assert result.status == FAILED
    assert result.detail.startswith("systemd gave up on sglang.service (Result=start-limit-hit): its server kept "
                                    "exiting until the unit's StartLimitBurst was reached")
    assert "journalctl -u sglang.service" in result.detail and "ActiveState=failed/failed" in result.detail


def test_the_live_environment_must_be_the_pinned_cuda_13_one(h200):
    settings = h200.settings(service_env={"NCCL_P2P_DISABLE": "1"})
    library_path = f"/usr/local/cuda-12.8/lib64:{settings.cuda_install_path}/lib64"
    readings = service_read(settings, env={"LD_LIBRARY_PATH": library_path, "NCCL_P2P_DISABLE": "0"})
    result = outcome("service_environment", settings, readings)
    assert result.status == FAILED
    assert "another toolkit is on the search paths: /usr/local/cuda-12.8/lib64" in result.detail
    assert "NCCL_P2P_DISABLE is '0', the service step pins '1'" in result.detail
    assert outcome("service_user", settings, service_read(settings, user="root")).status == FAILED


def test_secrets_stay_out_of_the_unit_and_in_a_root_0600_file(h200):
    settings = h200.settings(service_secret_env=["HF_TOKEN"])
    assert outcome("service_secrets", settings, service_read(settings)).passed
    result = outcome("service_secrets", settings, service_read(settings, stat="644 root root", values=1))
    assert "contains a value from /etc/servestack/sglang.service.env" in result.detail
    assert "mode/owner/group 644 root root, expected 600 root root" in result.detail


def fake_systemctl(h200, *properties: str) -> Path:
    """A systemctl answering `show` with `properties`, logging each call."""
    asked = h200.root / "systemctl.log"
    lines = " ".join(properties)
    write_script(h200.bin / "systemctl", f'#!/bin/sh\necho "$*" >> {asked}\nprintf "%s\\n" {lines}\n')
    return asked


def test_the_host_script_asks_systemd_once_and_reads_the_units_fragment_and_drop_ins(h200):
    """What `systemctl cat` would print, from the files `systemctl show` names: a secret variable
    set in a drop-in is found as one in the unit itself."""
    unit = h200.root / "etc" / "systemd" / "system" / "sglang.service"
    dropin = unit.parent / "sglang.service.d" / "10-token.conf"
    dropin.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/opt/ml-env/bin/python -m sglang.launch_server\n")
    dropin.write_text("[Service]\nEnvironment=HF_TOKEN=hf_abcdefgh123\n")
    asked = fake_systemctl(h200, "LoadState=loaded", "ActiveState=active", "MainPID=0", f"FragmentPath={unit}",
                           f"DropInPaths={dropin}")
    settings = h200.settings(service_secret_env=["HF_TOKEN"])
    host = h200.read(settings, "host").host
    assert (host.unit_readable, host.unit_secret_names) == (True, 1)
    assert host.unit["FragmentPath"] == str(unit) and host.unit_exit == 0
    assert not host.has_process  # MainPID=0
    assert len(asked.read_text().splitlines()) == 1
    dropin.write_text("[Service]\nEnvironment=OTHER=1\n")
    assert h200.read(settings, "host").host.unit_secret_names == 0
    fake_systemctl(h200, "LoadState=not-found", "FragmentPath=")
    assert not h200.read(settings, "host").host.unit_readable


def test_the_host_script_reads_only_the_services_own_variables_and_counts_secret_values(h200, tmp_path):
    """Of the live environment only the names asked for leave the host, never a secret's; a secret
    value written into the unit is counted, never printed."""
    secrets = tmp_path / "sglang.env"
    secrets.write_text('# servestack\nHF_TOKEN="hf_abcdefgh123"\nSHORT=ab\n')
    unit = tmp_path / "sglang.service"
    unit.write_text("[Service]\nEnvironment=A=1\nExecStart=/x --token hf_abcdefgh123\nEnvironment=B=ab\n")
    process = subprocess.Popen(["sleep", "60"], env={"CUDA_HOME": "/usr/local/cuda-13.0", "HF_TOKEN": "hf_abcdefgh123",
                                                     "OTHER": "x"})
    try:
        fake_systemctl(h200, "LoadState=loaded", f"MainPID={process.pid}", f"FragmentPath={unit}")
        command = VerifyHost().command(install_path=str(h200.cuda), venv_path=str(tmp_path / "none"),
                                       unit="sglang.service", env_names=("CUDA_HOME", "HF_TOKEN"),
                                       secret_names=("HF_TOKEN",), secrets_file=str(secrets))
        output = h200.run(command)
    finally:
        process.kill()
        process.wait()
    assert "hf_" not in output
    host = parse_host_report(output.splitlines())
    assert host.process_env == {"CUDA_HOME": "/usr/local/cuda-13.0"}
    assert (host.unit_secret_names, host.unit_secret_values) == (0, 1)
    assert host.secrets_file.split()[1:] == [tmp_path.owner(), tmp_path.group()]


def test_without_systemd_service_checks_are_skipped_with_the_reason(h200):
    settings = h200.settings()
    readings = Readings("h200", host=HostReport(systemd=False))
    for check in ("service_active", "service_environment", "service_health", "service_secrets"):
        assert outcome(check, settings, readings).detail == "systemd is not running on h200 (no /run/systemd/system)"


def test_health_and_generate_need_200_and_text(h200):
    settings = h200.settings()

    def http(**found):
        answer = printed(REPORT, json.dumps({"base": "http://127.0.0.1:30000", **found}))
        return Readings("h200", host=HostReport(systemd=True), http=Section(0, answer))

    assert outcome("service_health", settings, http(health=200)).passed
    assert outcome("service_health", settings, http(health=503)).detail == (
        "GET http://127.0.0.1:30000/health on h200: 503")
    assert outcome("service_generate", settings, http(generate_status=200, generate_text=" Paris.")).passed
    assert "text ''" in outcome("service_generate", settings, http(generate_status=200, generate_text="")).detail


@pytest.fixture
def health_server():
    """A loopback HTTP server answering GET /health with 200 (or 503 once `.status` says so)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self):
            self.send_response(Health.status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.handler = Health
    yield server
    server.shutdown()
    server.server_close()


def bare_path(h200, *tools: str) -> str:
    """A PATH holding bash (one built without /dev/tcp), python3 and `tools` only (no curl unless
    named), so the health probe takes the branch for what the host has."""
    bare = h200.root / ("bin-" + "-".join(tools or ("python",)))
    bare.mkdir()
    for tool in ("python3", *tools):
        (bare / tool).symlink_to(sys.executable if tool == "python3" else shutil.which(tool))
    bash_without_dev_tcp(bare)
    return str(bare)


def bash_without_dev_tcp(directory: Path) -> None:
    """`bash` in `directory`: the real one, but its /dev/tcp/ redirections fail (as in a bash built
    without /dev/tcp: a connection fails as to a missing file)."""
    write_script(directory / "bash", "#!/bin/sh\n"
                 f"script=$(printf '%s' \"$2\" | {shutil.which('sed')} 's#/dev/tcp/#/nonexistent/tcp/#g')\n"
                 f"shift 2\nexec {shutil.which('bash')} -c \"$script\" \"$@\"\n")


def health_command(settings) -> str:
    """The deploy's health read: /health only."""
    return requests(settings, "http", generate=False)[0].command()


def health_of(settings, command: str, env: dict) -> Outcome:
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, env=env, timeout=60).stdout
    readings = Readings("h200", host=HostReport(systemd=True), http=reported(out.splitlines()))
    return outcome("service_health", settings, readings)


# bash reports no refusal of its own: it leaves that to curl (or Python), which say why
REFUSED = {"bash": "connection refused (curl exit 7)", "curl": "connection refused (curl exit 7)",
           "python": "Connection refused"}


@pytest.mark.parametrize("tool", ["bash", "curl", "python"])
def test_the_deploys_health_probe_reports_alike_with_bash_curl_or_python(h200, health_server, tool):
    port = health_server.server_address[1]
    settings = h200.settings(service_port=port)
    command = health_command(settings)
    path = os.environ["PATH"] if tool == "bash" else bare_path(h200, *(("curl",) if tool == "curl" else ()))
    env = {**os.environ, "PATH": path}

    assert health_of(settings, command, env).detail == f"GET http://127.0.0.1:{port}/health: 200"
    health_server.handler.status = 503
    assert health_of(settings, command, env).detail == f"GET http://127.0.0.1:{port}/health on h200: 503"
    health_server.shutdown()
    health_server.server_close()
    refused = health_of(settings, command, env).detail
    assert refused.startswith(f"GET http://127.0.0.1:{port}/health on h200: ")
    assert REFUSED[tool].format(port=port) in refused, refused


def test_a_bash_that_cannot_connect_leaves_the_health_probe_to_curl(h200, health_server):
    """A bash built without /dev/tcp fails the connect like a refused one: curl then asks."""
    assert '|| exit "$BASH_CANNOT_CONNECT"' in script_text("verify-http.sh")
    port = health_server.server_address[1]
    settings = h200.settings(service_port=port)
    env = {**os.environ, "PATH": bare_path(h200, "curl")}
    assert health_of(settings, health_command(settings), env).detail == f"GET http://127.0.0.1:{port}/health: 200"


def test_the_generate_request_is_asked_by_the_venvs_python(h200):
    """The suite's http read: a real POST /generate, answered here by a stand-in server."""
    import http.server
    import threading

    class Generate(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"text": " Paris." if body["text"] else ""}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = h200.settings(service_port=server.server_address[1])
        command = requests(settings, "http")[0].command()
        out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=60).stdout
    finally:
        server.shutdown()
        server.server_close()
    readings = Readings("h200", host=HostReport(systemd=True), http=reported(out.splitlines()))
    assert outcome("service_generate", settings, readings).detail.endswith("'The capital of France is' -> 'Paris.'")


def test_the_health_probe_bounds_a_connection_to_another_address_of_the_host(h200):
    """A service bound to one address of the host (not loopback) is asked there, under `timeout`;
    an answer that is not HTTP is reported as such."""
    import socketserver
    import threading

    class NotHttp(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()
            self.wfile.write(b"SSH-2.0-OpenSSH_9.2\r\n")

    with socketserver.TCPServer(("127.0.0.2", 0), NotHttp) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        settings = h200.settings(service_host="127.0.0.2", service_port=port)
        command = health_command(settings)
        assert "timeout 35 bash" in command
        detail = health_of(settings, command, dict(os.environ)).detail
        server.shutdown()
    assert detail == f"GET http://127.0.0.2:{port}/health on h200: no HTTP status line in the answer"


# --- the catalogue and the suite ------------------------------------------------------------------


def test_every_check_has_its_test_in_the_suite_with_the_right_marker():
    source = "".join(path.read_text() for path in sorted(VERIFY_TESTS.glob("test_*.py")))
    for check in CHECKS:
        assert f"def test_{check.name}(" in source, check.name
        assert f'target.check("{check.name}"' in source, check.name
    service = (VERIFY_TESTS / "test_service.py").read_text()
    for check in CHECKS:
        block = source[:source.index(f"def test_{check.name}(")].rsplit("\n\n\n", 1)[-1]
        deployed = "@pytest.mark.deployed" in block or f"def test_{check.name}(" in service
        assert deployed == check.deployed, check.name


def test_groups_run_in_dependency_order():
    selected = [CHECKS_BY_NAME[name] for name in ("patches_applied", "cuda_sample", "driver_version")]
    assert groups_for(selected) == ("gpu", "host", "patches", "sample")


# --- the real H200 run (docs/validation/h200-2026-11-30.md): each probe's raw output ----------------

DEVICE = FIXTURES / "verify"
CAPTURED = "::servestack-verify:: "


def captured_sections(name: str) -> dict[str, Section]:
    """The sections of a capture: the verify scripts' output before they moved to files/scripts,
    framed `::servestack-verify:: begin NAME` ... `end NAME RC`."""
    sections, current, body = {}, None, []
    for line in (DEVICE / name).read_text().splitlines():
        if line.startswith(CAPTURED + "begin "):
            current, body = line.split()[2], []
        elif line.startswith(CAPTURED + "end ") and current:
            sections[current], current = Section(int(line.split()[3]), tuple(body)), None
        elif current:
            body.append(line)
    return sections


def device_readings(*groups: str) -> Readings:
    """The captures as today's facts read them: each captured section is what one of them prints
    (the GPUs' and toolkits' facts ran the same commands), the host script's translated line by
    line into verify-host.sh's `KEY<TAB>VALUE` lines, the python probe's report line into its
    report section."""
    readings = Readings("@local")
    if "host" in groups:
        host = captured_sections("probe-host.txt")
        readings.gpu = parse_gpu_output(list(host["gpu"].lines))
        toolkit_lines = [*host["tree"].lines, *host["link"].lines]
        if host["record"].ok:
            toolkit_lines.append("record " + host["record"].text.replace("\n", ""))
        readings.toolkits = parse_toolkits("/usr/local/cuda-13.0", "/usr/local/cuda", toolkit_lines)
        readings.kept = {"/usr/local/cuda-12.8": parse_fingerprint("/usr/local/cuda-12.8", list(host["kept_0"].lines))}
        lines = [*(f"device\t{line}" for line in host["device_nodes"].lines),
                 *(f"package\t{line}" for line in host["toolkit_package"].lines),
                 *(f"toolkit_path\t{line}" for line in host["toolkit_path"].lines),
                 *host["release"].lines, f"systemd\t{host['systemd'].text}", f"unit_exit\t{host['service'].rc}",
                 *(f"unit\t{line}" for line in host["service"].lines if host["service"].ok),
                 *(["pid\t0", *host["service_process"].lines] if host["service_process"].ok else []),
                 *([line.replace("names", "unit_secret_names").replace("values", "unit_secret_values")
                    for line in host["unit_secrets"].lines] if host["unit_secrets"].ok else ["unit_files\tunreadable"]),
                 f"secrets_file\t{host['secrets_file'].text}"]
        readings.host = parse_host_report(lines)
    if "sample" in groups:
        readings.sample = captured_sections("probe-sample.txt")["sample"]
    if "python" in groups:
        readings.python = with_report_section(captured_sections("probe-python.txt")["python"])
    return readings


def test_the_real_h200_probes_pass_every_host_level_check():
    assert_passes_every_host_level_check(device_readings("host", "python", "sample"), version_json=(
        "no version.json: toolkit from dpkg package cuda-nvcc-13-0 13.0.88-1; "
        "nvcc 13.0.88 as pinned, accepted (cuda_existing_toolkit = 'accept')"))


def test_the_real_h200_fails_the_fleets_expectations_where_it_should():
    settings, readings = device_settings(gpu_compute_capability="12.0", gpu_count=8, service_tp=8,
                                         cuda_link_policy="keep"), device_readings("host", "python")
    assert outcome("gpu_capability", settings, readings).status == FAILED
    assert outcome("torch_device_capability", settings, readings).detail == (
        "expected 8 device(s) of capability (12, 0) on @local, torch sees 1: cuda:0 is (9, 0)")
    assert "no record of where /usr/local/cuda pointed" in outcome("cuda_link", settings, readings).detail
    # PyPI's torch 2.11.0 carries no local label: it is not the pinned +cu130 build
    assert outcome("package_version", settings, readings, "torch").detail == (
        "torch 2.11.0 in /opt/torch/.venv on @local, expected 2.9.1+cu130")
    assert outcome("service_active", settings, readings).detail == (
        "systemd is not running on @local (no /run/systemd/system)")
    refused = device_settings(cuda_existing_toolkit="refuse")
    assert "cannot be confirmed as CUDA 13.0.1" in outcome("version_json", refused, readings).detail


def test_the_sample_must_run_on_every_gpu_the_host_data_expects():
    """The real H200 run (one device) against host data expecting the fleet's 8."""
    text = (DEVICE / "sample-own-arch.txt").read_text()
    body = "\n".join(["nvcc -gencode arch=compute_90,code=sm_90", *text.splitlines()[1:-1]])
    assert outcome("cuda_sample", device_settings(), sample_read(0, body)).passed   # gpu_count = 1, as the host has
    result = outcome("cuda_sample", device_settings(gpu_count=8), sample_read(0, body))
    assert result.status == FAILED
    assert result.detail.startswith(
        "the CUDA sample ran on 1 device(s) on h200, expected gpu_count = 8: device 0 sm_90")


def test_the_sample_built_for_the_wrong_architecture_fails_on_the_real_h200():
    text, rc = (DEVICE / "sample-sm120.txt").read_text(), 1
    body = "\n".join(["nvcc -gencode arch=compute_120,code=sm_120", *text.splitlines()[1:-1]])
    result = outcome("cuda_sample", device_settings(), sample_read(rc, body))
    assert result.status == FAILED
    assert "FAIL bad=1048576/1048576 launch=no kernel image is available for execution on the device" in result.detail
