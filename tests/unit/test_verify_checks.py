"""The verification checks: the probe scripts run with real sh on a fake host tree built from
outputs captured on a real H200 host (tests/fixtures/h200-ubuntu2404), and the judgements on them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from facts.toolkit import fingerprint_command, parse_fingerprint
from servestack import checks
from servestack.checks import Probe, Section, parse_sections
from servestack.manifest import DEFAULT_MANIFEST, load_manifest
from servestack.sandbox.standins.toolkit import nvcc_version_text
from servestack.settings import settings_from_data

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
        self.dpkg_admin = root / "var" / "lib" / "dpkg"  # the package lists the probe greps first
        (self.dpkg_admin / "info").mkdir(parents=True)
        (self.dpkg_admin / "info" / "cuda-nvcc-13-0.list").write_text(f"/usr/local\n{self.cuda}/bin/nvcc\n")
        write_script(self.bin / "dpkg-query", (  # the two queries the probe makes, answered from the real list
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

    def probe(self, settings, *groups: str) -> Probe:
        probe = Probe("h200")
        for group in groups or ("host",):
            probe.sections.update(parse_sections(self.run(checks.SCRIPTS[group](settings))))
        return probe

    def record(self, settings, link_resolved: str | None = None) -> None:
        """toolkits.json as the toolkit step writes it: kept toolkits' fingerprints, the link chain."""
        toolkits = {}
        for path in checks.kept_toolkit_paths(settings):
            lines = self.run(fingerprint_command(path)).splitlines()
            toolkits[path] = parse_fingerprint(path, lines).to_record()
        link = {"path": str(self.local / "cuda"), "hops": [], "resolved": link_resolved, "kind": "link"}
        (self.state / "toolkits.json").write_text(json.dumps({"schema": 1, "toolkits": toolkits, "link": link}))


@pytest.fixture
def h200(tmp_path) -> FakeHost:
    return FakeHost(tmp_path)


def outcome(check: str, settings, probe, *args) -> checks.Outcome:
    return checks.CHECKS_BY_NAME[check].judge(settings, probe, *args)


# --- sections -----------------------------------------------------------------------------


def test_sections_keep_each_output_and_exit_status():
    text = (f"{checks.MARK} begin a\nline 1\nline 2\n{checks.MARK} end a 0\n"
            f"noise\n{checks.MARK} begin b\n{checks.MARK} end b 127\n{checks.MARK} begin d\n"
            f'{{"no": "newline"}}{checks.MARK} end d 0\n{checks.MARK} begin c\ncut off')
    sections = parse_sections(text)
    assert sections["a"] == Section(0, "line 1\nline 2")
    assert sections["b"] == Section(127, "")
    assert sections["d"] == Section(0, '{"no": "newline"}')
    assert sections["c"] == Section(None, "cut off") and not sections["c"].ok
    assert Probe("h")["missing"].rc is None


def test_every_probe_script_is_valid_posix_sh_and_always_exits_0(h200):
    settings = h200.settings(service_secret_env=["HF_TOKEN"], service_env={"NCCL_P2P_DISABLE": "1"})
    scripts = [script(settings) for script in checks.SCRIPTS.values()]
    scripts.append(checks.patches_script(settings, None))
    for script in scripts:
        assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
        assert script.rstrip().endswith("exit 0")
    assert len(checks.host_script(settings)) < 32 * 1024  # one SSH argument, well under Linux's 128 KiB


def test_the_host_script_replays_the_gpu_output_preflight_read_instead_of_asking_again(h200):
    """The deploy's verify step hands in what preflight read: same section, same checks, no nvidia-smi."""
    from facts.gpu import gpu_command
    from facts.preflight import HostPreflight

    settings = h200.settings()
    read = HostPreflight().process(h200.run("echo '@@section gpu'; ( " + gpu_command() + " )").splitlines())
    assert read.gpu_output and read.gpu.gpus
    live = parse_sections(h200.run(checks.host_script(settings)))
    write_script(h200.bin / "nvidia-smi", "#!/bin/sh\necho asked >&2; exit 9\n")  # must not be run
    replayed = parse_sections(h200.run(checks.host_script(settings, replay={"gpu": read.gpu_output})))
    assert replayed["gpu"] == live["gpu"]
    assert "asked" not in replayed["gpu"].text
    probe = Probe("h200")
    probe.sections.update(replayed)
    assert outcome("gpu_capability", settings, probe).passed


def test_the_host_script_replays_the_toolkit_tree_and_link_the_toolkit_step_read(h200):
    """The toolkit step's read (CudaToolkits) ran the same commands: same sections, same state digest
    and judgements, and neither nvcc nor readlink runs again."""
    from facts.toolkit import CudaToolkits
    from operations.toolkit import toolkit_fact_arguments

    settings = h200.settings()
    h200.record(settings, link_resolved=str(h200.cuda))
    arguments = toolkit_fact_arguments(settings)
    read = CudaToolkits().process(h200.run(CudaToolkits().command(**arguments)).splitlines())
    live = parse_sections(h200.run(checks.host_script(settings)))
    started = h200.root / "started"
    h200.nvcc(h200.cuda, "")
    write_script(h200.cuda / "bin" / "nvcc", f"#!/bin/sh\necho nvcc >> {started}; exit 9\n")
    write_script(h200.bin / "readlink", f"#!/bin/sh\necho readlink >> {started}; exec /bin/readlink \"$@\"\n")
    replay = {section: read.section_lines(section) for section in ("tree", "link")}
    replayed = parse_sections(h200.run(checks.host_script(settings, replay=replay)))
    assert {name: replayed[name] for name in ("tree", "link")} == {name: live[name] for name in ("tree", "link")}
    assert "nvcc" in live["tree"].text and "link_resolved" in live["link"].text
    assert not started.exists()  # no nvcc, and toolkit_path resolves its directory with shell builtins
    judged = []
    for sections in (live, replayed):
        probe = Probe("h200")
        probe.sections.update(sections)
        judged.append([outcome(name, settings, probe) for name in ("nvcc_version", "version_json", "cuda_link")])
    assert judged[0] == judged[1] and judged[0][0].passed and judged[0][2].passed


# --- GPU: the real H200's nvidia-smi ------------------------------------------------------


def test_the_real_h200_passes_the_gpu_checks_with_its_own_expectations(h200):
    settings = h200.settings()
    probe = h200.probe(settings)
    assert outcome("driver_version", settings, probe).detail == "driver 580.159.04 >= 580.82.07"
    assert outcome("gpu_capability", settings, probe).passed
    assert outcome("gpu_count", settings, probe).passed


def test_the_h200_fails_the_sm120_expectations_naming_the_gpu(h200):
    settings = h200.settings(gpu_compute_capability="12.0", gpu_count=8, service_tp=8)
    probe = h200.probe(settings)
    capability = outcome("gpu_capability", settings, probe)
    assert capability.status == checks.FAILED
    assert capability.detail == ("expected compute capability 12.0 on h200: "
                                 "GPU 0 (NVIDIA H200, 00000000:00:06.0) reports 9.0")
    assert outcome("gpu_count", settings, probe).detail == "nvidia-smi lists 1 GPU(s) on h200, host data gpu_count is 8"


def test_driver_versions_compare_as_versions_not_strings(h200):
    settings = h200.settings()
    smi = h200.bin / "nvidia-smi"
    smi.write_text(smi.read_text().replace("580.159.04", "580.65.06"))  # "580.65" > "580.159" as text
    result = outcome("driver_version", settings, h200.probe(settings))
    assert result.status == checks.FAILED and "580.65.06 on h200 is older than the manifest minimum 580.82.07" in result.detail


def test_without_a_driver_gpu_checks_are_skipped_with_the_reason(h200):
    settings = h200.settings()
    (h200.bin / "nvidia-smi").unlink()
    write_script(h200.bin / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed because it couldn'\"'\"'t "
                                          "communicate with the NVIDIA driver.'\nexit 9\n")
    result = outcome("driver_version", settings, h200.probe(settings))
    assert result.status == checks.SKIPPED
    assert result.detail.startswith("no NVIDIA driver answers on h200: nvidia-smi failed (exit 9): NVIDIA-SMI has failed")


# --- toolkit: the real nvcc, dpkg-packaged tree, alternatives chain -------------------------


def test_a_distribution_packaged_toolkit_is_judged_by_its_packages(h200):
    settings = h200.settings()
    probe = h200.probe(settings)
    assert outcome("nvcc_version", settings, probe).detail.endswith("reports release 13.0, V13.0.88")
    result = outcome("version_json", settings, probe)
    assert result.status == checks.FAILED  # nvcc 13.0.88 is in 13.0.1 and 13.0.2: not confirmed as 13.0.1
    assert result.detail == (
        f"{h200.cuda}/version.json is missing on h200: a toolkit from dpkg package cuda-nvcc-13-0 13.0.88-1, "
        "release cuda-compiler-13-0 13.0.2-1, which cannot be confirmed as CUDA 13.0.1 (its nvcc 13.0.88 is "
        "shared by other releases); host data cuda_existing_toolkit = 'accept' accepts it")
    accepted = h200.settings(cuda_existing_toolkit="accept")
    result = outcome("version_json", accepted, h200.probe(accepted))
    assert result.passed and "release cuda-compiler-13-0 13.0.2-1; nvcc 13.0.88 as pinned, accepted" in result.detail


def test_version_json_missing_with_no_owner_fails(h200):
    settings = h200.settings(cuda_existing_toolkit="accept")
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")
    result = outcome("version_json", settings, h200.probe(settings))
    assert result.status == checks.FAILED and "version.json is missing on h200 and no package owns" in result.detail


def test_a_toolkit_assembled_from_nvidia_wheels_is_recognised_by_their_dist_info(h200):
    settings = h200.settings(cuda_existing_toolkit="accept")
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")
    (h200.cuda / "dist-info" / "nvidia_cuda_nvcc-13.0.88.dist-info").mkdir(parents=True)
    result = outcome("version_json", settings, h200.probe(settings))
    assert result.passed and "toolkit from wheel package nvidia-cuda-nvcc 13.0.88;" in result.detail


def test_a_toolkit_with_version_json_is_not_looked_up_in_the_package_lists(h200):
    """The package query only serves a toolkit without version.json (the runfile's has one)."""
    settings = h200.settings()
    assert h200.probe(settings)["toolkit_package"].text.startswith("dpkg cuda-nvcc-13-0")
    (h200.cuda / "version.json").write_text(json.dumps(
        {"cuda": {"name": "CUDA SDK", "version": "13.0.1"}, "cuda_nvcc": {"name": "CUDA NVCC", "version": "13.0.88"}}))
    write_script(h200.bin / "grep", "#!/bin/sh\necho grep ran >&2; exit 2\n")
    probe = h200.probe(settings)
    assert probe["toolkit_package"] == Section(0, "")
    assert outcome("version_json", settings, probe).passed


@pytest.mark.parametrize("cuda, nvcc_version, status", [
    ("13.0.1", "13.0.88", checks.PASSED), ("13.0.20250801", "13.0.88", checks.PASSED),
    ("13.0.2", "13.0.88", checks.FAILED), ("13.0.1", "12.8.93", checks.FAILED)])
def test_version_json_of_a_runfile_install_must_agree(h200, cuda, nvcc_version, status):
    settings = h200.settings()
    write_script(h200.bin / "dpkg", "#!/bin/sh\nexit 1\n")  # a runfile install belongs to no package
    (h200.cuda / "version.json").write_text(json.dumps(
        {"cuda": {"name": "CUDA SDK", "version": cuda}, "cuda_nvcc": {"name": "CUDA NVCC", "version": nvcc_version}}))
    assert outcome("version_json", settings, h200.probe(settings)).status == status


def test_a_wrong_nvcc_fails(h200):
    settings = h200.settings()
    h200.nvcc(h200.cuda, nvcc_version_text("12.8.93"))
    result = outcome("nvcc_version", settings, h200.probe(settings))
    assert result.status == checks.FAILED and "reports V12.8.93, the manifest pins V13.0.88" in result.detail


def test_the_alternatives_chain_counts_by_where_it_ends(h200):
    settings = h200.settings(cuda_link_policy="new")
    result = outcome("cuda_link", settings, h200.probe(settings))
    assert result.passed, result.detail
    assert f"{h200.local}/cuda -> {h200.root}/etc/alternatives/cuda -> {h200.cuda}" in result.detail


def test_link_policy_keep_compares_with_the_record_taken_before_the_install(h200):
    settings = h200.settings(cuda_link_policy="keep")
    assert "no record of where" in outcome("cuda_link", settings, h200.probe(settings)).detail
    h200.record(settings, link_resolved=str(h200.local / "cuda-12.8"))
    result = outcome("cuda_link", settings, h200.probe(settings))
    assert result.status == checks.FAILED and f"before the install, now {h200.local}/cuda ->" in result.detail
    h200.record(settings, link_resolved=str(h200.cuda))
    assert outcome("cuda_link", settings, h200.probe(settings)).passed


def test_the_kept_toolkit_must_keep_its_recorded_fingerprint(h200):
    settings = h200.settings()
    kept = h200.local / "cuda-12.8"
    h200.nvcc(kept, nvcc_version_text("12.8.93"))
    (kept / "lib64").mkdir()
    (kept / "lib64" / "libcudart.so.12").write_bytes(b"x" * 100)
    assert outcome("kept_toolkits", settings, h200.probe(settings)).status == checks.FAILED  # no record yet
    h200.record(settings)
    result = outcome("kept_toolkits", settings, h200.probe(settings))
    assert result.detail == f"{kept} unchanged (4 files, nvcc 12.8.93)"
    (kept / "lib64" / "libcudart.so.12").write_bytes(b"x" * 101)  # "a changed 12.8 file"
    result = outcome("kept_toolkits", settings, h200.probe(settings))
    assert result.status == checks.FAILED
    assert result.detail == (f"on h200: {kept} changed since it was recorded: "
                             "file list or sizes changed (4 files before, 4 now)")


# --- the CUDA sample ------------------------------------------------------------------------


def sample_probe(rc: int, text: str) -> Probe:
    return Probe("h200", {"sample": Section(rc, text)})


def test_the_sample_passes_only_when_every_device_added_correctly(h200):
    settings = h200.settings()
    good = ('nvcc -gencode arch=compute_90,code=sm_90\n'
            'device 0 sm_90 "NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error\ndevices 1: PASS')
    assert outcome("cuda_sample", settings, sample_probe(0, good)).passed
    wrong_arch = ('nvcc -gencode arch=compute_120,code=sm_120\n'
                  'device 0 sm_90 "NVIDIA H200": FAIL bad=1048576/1048576 launch=no error sync=no error\n'
                  'devices 1: FAIL')
    result = outcome("cuda_sample", settings, sample_probe(1, wrong_arch))
    assert result.status == checks.FAILED and "FAIL bad=1048576/1048576" in result.detail


def test_the_sample_reports_compiler_failures_and_skips_without_a_gpu_device(h200):
    settings = h200.settings()
    result = outcome("cuda_sample", settings, sample_probe(7, "nvcc -gencode arch=compute_90,code=sm_90\n"
                                                               "nvcc fatal : cannot find g++\nnvcc failed"))
    assert result.status == checks.FAILED and "cannot find g++" in result.detail
    assert outcome("cuda_sample", settings, sample_probe(4, "no /dev/nvidiactl")).detail == (
        "no /dev/nvidiactl on h200: no GPU device the CUDA runtime could open")


def test_the_sample_source_checks_launch_errors_and_every_result():
    source = checks.SAMPLE_SOURCE.read_text()
    assert "cudaGetLastError()" in source and "cudaDeviceSynchronize()" in source
    assert "c[i] != 3.0f * (float)i" in source


def test_the_sample_script_skips_where_there_is_no_gpu_device_node(h200):
    settings = h200.settings()
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA device node")
    assert h200.probe(settings, "sample")["sample"].rc == 4


# --- the release: torch and packages ------------------------------------------------------


def torch_report(**torch) -> Probe:
    text, _ = real("torch.txt")
    version, cuda = text.splitlines()[1].split()
    info = {"version": version, "cuda": cuda, "available": True, "count": 1, "names": ["NVIDIA H200"],
            "capabilities": [[9, 0]], "ops": [{"device": 0, "sum": 1047552.0, "matmul": 262144.0}], **torch}
    packages = {package.name: package.version for package in load_manifest().packages}
    report = {"prefix": "/opt/ml-env", "packages": packages, "torch": info}
    return Probe("h200", {"python": Section(0, "warning: noise\n" + checks.MARK + json.dumps(report))})


def test_the_real_h200_torch_passes_the_torch_checks(h200):
    settings = h200.settings()
    probe = torch_report()
    assert outcome("torch_cuda_build", settings, probe).detail == "torch 2.11.0+cu130, torch.version.cuda == '13.0'"
    assert outcome("torch_device_capability", settings, probe).passed
    assert outcome("torch_cuda_op", settings, probe).passed


def test_torch_checks_fail_on_the_wrong_gpu_or_result_and_skip_without_cuda(h200):
    settings = h200.settings(gpu_compute_capability="12.0")
    assert "torch sees 1: cuda:0 is (9, 0)" in outcome("torch_device_capability", settings, torch_report()).detail
    wrong = torch_report(ops=[{"device": 0, "error": "CUDA error: no kernel image is available for execution"}])
    assert "no kernel image" in outcome("torch_cuda_op", settings, wrong).detail
    assert outcome("torch_cuda_build", settings, torch_report(cuda="12.8")).status == checks.FAILED
    no_gpu = torch_report(available=False)
    assert outcome("torch_cuda_op", settings, no_gpu).detail == "torch.cuda.is_available() is False on h200"
    assert outcome("sglang_sm120", settings, no_gpu).status == checks.SKIPPED


def test_package_versions_must_match_local_labels_too(h200):
    settings = h200.settings()
    probe = torch_report()
    assert outcome("package_version", settings, probe, "torch").detail == "torch 2.9.1+cu130"
    report = probe["python"].json()
    report["packages"]["torch"] = "2.9.1+cu128"
    report["packages"]["sgl-kernel"] = None
    probe = Probe("h200", {"python": Section(0, checks.MARK + json.dumps(report))})
    assert outcome("package_version", settings, probe, "torch").detail == (
        "torch 2.9.1+cu128 in /opt/ml-env on h200, expected 2.9.1+cu130")
    assert "sgl-kernel is not installed" in outcome("package_version", settings, probe, "sgl-kernel").detail


def test_the_python_probe_runs_in_the_venv_and_reports_what_is_missing(h200, tmp_path):
    settings = h200.settings(venv_path=str(tmp_path / "venv"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '2.9.1+cu128'\nclass version:\n    cuda = '12.8'\n"
        "class cuda:\n    is_available = staticmethod(lambda: False)\n")
    (site / "torch-2.9.1+cu128.dist-info").mkdir()
    (site / "torch-2.9.1+cu128.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.9.1+cu128\n")
    probe = h200.probe(settings, "python")
    assert outcome("torch_cuda_build", settings, probe).detail.endswith("is built for CUDA 12.8, expected 13.0")
    assert "torch 2.9.1+cu128 in" in outcome("package_version", settings, probe, "torch").detail
    assert "flashinfer-python is not installed" in outcome("package_version", settings, probe, "flashinfer-python").detail
    assert outcome("torch_cuda_op", settings, probe).status == checks.SKIPPED
    assert "ModuleNotFoundError" in probe["python"].json()["sm120_error"]


def test_a_missing_venv_python_fails_the_release_checks(h200):
    settings = h200.settings()
    result = outcome("torch_cuda_build", settings, h200.probe(settings, "python"))
    assert result.status == checks.FAILED and "no python at" in result.detail


# --- patches --------------------------------------------------------------------------------


def patch_probe(record: str = "current", state: str = "applied") -> Probe:
    report = {"installed": True, "version": "0.5.9", "patch_set": "0.5.9", "record": record,
              "record_path": "/opt/servestack/releases/r-1/patches.json",
              "patches": [{"name": "0001-sm120-torch-symm-mem", "state": state}]}
    return Probe("h200", {"patches": Section(0, json.dumps(report))})


def test_patches_must_be_applied_and_match_their_record(h200):
    settings = h200.settings()
    assert outcome("patches_applied", settings, patch_probe()).passed
    modified = outcome("patches_applied", settings, patch_probe(record="stale"))
    assert modified.status == checks.FAILED and "is stale" in modified.detail
    assert "is conflict" in outcome("patches_applied", settings, patch_probe(state="conflict")).detail


def test_the_patch_record_of_the_active_release_is_chosen_from_the_probe():
    probe = Probe("h", {"release": Section(0, "venv\t/opt/r/r-1/venv\nrecord\t/opt/r/r-1/patches.json")})
    assert checks.patch_record_for(probe) == "/opt/r/r-1/patches.json"
    assert checks.patch_record_for(Probe("h", {"release": Section(0, "venv\t/opt/r/r-1/venv")})) is None


# --- the service ------------------------------------------------------------------------------


def service_probe(settings, env: dict | None = None, user: str = "sglang", stat: str = "600 root root",
                  names: int = 0, values: int = 0, active: str = "active") -> Probe:
    from operations.service import release, service_environment

    pinned = dict(service_environment(settings, release(settings, "r-0123456789ab"), "digest"))
    env = {**pinned, **(env or {})}
    process = f"user\t{user}\n" + "".join(f"env\t{name}={value}\n" for name, value in env.items())
    return Probe("h200", {
        "systemd": Section(0, "running"),
        "release": Section(0, f"venv\t{settings.venv_releases_dir}/r-0123456789ab/venv"),
        "service": Section(0, f"LoadState=loaded\nUnitFileState=enabled\nActiveState={active}\nSubState=running\nMainPID=42"),
        "service_process": Section(0, process),
        "unit_secrets": Section(0, f"names\t{names}\nvalues\t{values}"),
        "secrets_file": Section(0, stat),
    })


def test_a_converged_service_passes(h200):
    settings = h200.settings(service_env={"NCCL_P2P_DISABLE": "1"})
    probe = service_probe(settings)
    for check in ("service_active", "service_user", "service_environment", "service_secrets"):
        assert outcome(check, settings, probe).passed, outcome(check, settings, probe).detail


def test_a_stopped_service_fails(h200):
    settings = h200.settings()
    result = outcome("service_active", settings, service_probe(settings, active="inactive"))
    assert result.detail == "sglang.service on h200 must be enabled and active: UnitFileState=enabled, ActiveState=inactive/running"


def test_the_live_environment_must_be_the_pinned_cuda_13_one(h200):
    settings = h200.settings(service_env={"NCCL_P2P_DISABLE": "1"})
    probe = service_probe(settings, env={"LD_LIBRARY_PATH": f"/usr/local/cuda-12.8/lib64:{settings.cuda_install_path}/lib64",
                                         "NCCL_P2P_DISABLE": "0"})
    result = outcome("service_environment", settings, probe)
    assert result.status == checks.FAILED
    assert "another toolkit is on the search paths: /usr/local/cuda-12.8/lib64" in result.detail
    assert "NCCL_P2P_DISABLE is '0', the service step pins '1'" in result.detail
    assert outcome("service_user", settings, service_probe(settings, user="root")).status == checks.FAILED


def test_secrets_stay_out_of_the_unit_and_in_a_root_0600_file(h200):
    settings = h200.settings(service_secret_env=["HF_TOKEN"])
    assert outcome("service_secrets", settings, service_probe(settings)).passed
    result = outcome("service_secrets", settings, service_probe(settings, stat="644 root root", values=1))
    assert "contains a value from /etc/servestack/sglang.service.env" in result.detail
    assert "mode/owner/group 644 root root, expected 600 root root" in result.detail


def test_the_host_script_asks_systemd_once_and_reads_the_units_fragment_and_drop_ins(h200):
    """What `systemctl cat` would print, from the files `systemctl show` names: a secret variable
    set in a drop-in is found as one in the unit itself."""
    unit = h200.root / "etc" / "systemd" / "system" / "sglang.service"
    dropin = unit.parent / "sglang.service.d" / "10-token.conf"
    dropin.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/opt/ml-env/bin/python -m sglang.launch_server\n")
    dropin.write_text("[Service]\nEnvironment=HF_TOKEN=hf_abcdefgh123\n")
    asked = h200.root / "systemctl.log"
    write_script(h200.bin / "systemctl", f'#!/bin/sh\necho "$*" >> {asked}\nprintf "%s\\n" LoadState=loaded '
                                         f'ActiveState=active MainPID=0 FragmentPath={unit} DropInPaths={dropin}\n')
    settings = h200.settings(service_secret_env=["HF_TOKEN"])
    sections = parse_sections(h200.run(checks.host_script(settings)))
    assert sections["unit_secrets"] == Section(0, "names\t1")
    assert sections["service"].ok and "FragmentPath=" in sections["service"].text
    assert len(asked.read_text().splitlines()) == 1
    dropin.write_text("[Service]\nEnvironment=OTHER=1\n")
    assert parse_sections(h200.run(checks.host_script(settings)))["unit_secrets"] == Section(0, "names\t0")
    write_script(h200.bin / "systemctl", "#!/bin/sh\necho LoadState=not-found; echo FragmentPath=\n")
    assert parse_sections(h200.run(checks.host_script(settings)))["unit_secrets"].rc == 3


def test_the_secret_scan_prints_a_count_never_a_value(tmp_path):
    secrets = tmp_path / "sglang.env"
    secrets.write_text('# servestack\nHF_TOKEN="hf_abcdefgh123"\nSHORT=ab\n')
    script = f"set -- {secrets}; printf '%s\\n' 'Environment=A=1' 'ExecStart=/x --token hf_abcdefgh123' | {checks._SECRET_SCAN}"
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert result.stdout == "1\n" and "hf_" not in result.stderr


def test_without_systemd_service_checks_are_skipped_with_the_reason(h200):
    settings = h200.settings()
    probe = Probe("h200", {"systemd": Section(0, "not running")})
    for check in ("service_active", "service_environment", "service_health", "service_secrets"):
        assert outcome(check, settings, probe).detail == "systemd is not running on h200 (no /run/systemd/system)"


def test_health_and_generate_need_200_and_text(h200):
    settings = h200.settings()

    def http(**report):
        return Probe("h200", {"systemd": Section(0, "running"),
                              "http": Section(0, checks.MARK + json.dumps({"base": "http://127.0.0.1:30000", **report}))})

    assert outcome("service_health", settings, http(health=200)).passed
    assert outcome("service_health", settings, http(health=503)).detail == "GET http://127.0.0.1:30000/health on h200: 503"
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
    """A PATH holding python3 and `tools` only (no bash, no curl unless named), so the health probe
    takes the branch for what the host has."""
    bare = h200.root / ("bin-" + "-".join(tools or ("python",)))
    bare.mkdir()
    for tool in ("python3", *tools):
        (bare / tool).symlink_to(sys.executable if tool == "python3" else shutil.which(tool))
    return str(bare)


def health_of(settings, script: str, env: dict) -> checks.Outcome:
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env, timeout=60).stdout
    return outcome("service_health", settings, Probe("h200", {"systemd": Section(0, "running"), **parse_sections(out)}))


# bash reports no refusal of its own: it leaves that to curl (or Python), which say why
REFUSED = {"bash": "connection refused (curl exit 7)", "curl": "connection refused (curl exit 7)",
           "python": "Connection refused"}


@pytest.mark.parametrize("tool", ["bash", "curl", "python"])
def test_the_deploys_health_probe_reports_alike_with_bash_curl_or_python(h200, health_server, tool):
    port = health_server.server_address[1]
    settings = h200.settings(service_port=port)
    script = checks.http_script(settings, generate=False)
    path = os.environ["PATH"] if tool == "bash" else bare_path(h200, *(("curl",) if tool == "curl" else ()))
    env = {**os.environ, "PATH": path}

    assert health_of(settings, script, env).detail == f"GET http://127.0.0.1:{port}/health: 200"
    health_server.handler.status = 503
    assert health_of(settings, script, env).detail == f"GET http://127.0.0.1:{port}/health on h200: 503"
    health_server.shutdown()
    health_server.server_close()
    refused = health_of(settings, script, env).detail
    assert refused.startswith(f"GET http://127.0.0.1:{port}/health on h200: ")
    assert REFUSED[tool].format(port=port) in refused, refused


def test_a_bash_that_cannot_connect_leaves_the_health_probe_to_curl(h200, health_server):
    """A bash built without /dev/tcp fails the connect like a refused one: curl then asks."""
    assert f"|| exit {checks.BASH_NO_CONNECTION}" in checks._BASH_HEALTH
    port = health_server.server_address[1]
    settings = h200.settings(service_port=port)
    path = bare_path(h200, "curl")
    write_script(Path(path) / "bash", f"#!/bin/sh\nexit {checks.BASH_NO_CONNECTION}\n")
    env = {**os.environ, "PATH": path}
    assert health_of(settings, checks.http_script(settings, generate=False), env).detail == \
        f"GET http://127.0.0.1:{port}/health: 200"


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
        script = checks.http_script(settings, generate=False)
        assert "timeout 35 bash" in script
        detail = health_of(settings, script, dict(os.environ)).detail
        server.shutdown()
    assert detail == f"GET http://127.0.0.2:{port}/health on h200: no HTTP status line in the answer"


# --- the catalogue and the suite ------------------------------------------------------------------


def test_every_check_has_its_test_in_the_suite_with_the_right_marker():
    source = "".join(path.read_text() for path in sorted(VERIFY_TESTS.glob("test_*.py")))
    for check in checks.CHECKS:
        assert f"def test_{check.name}(" in source, check.name
        assert f'target.check("{check.name}"' in source, check.name
    service = (VERIFY_TESTS / "test_service.py").read_text()
    for check in checks.CHECKS:
        block = source[:source.index(f"def test_{check.name}(")].rsplit("\n\n\n", 1)[-1]
        deployed = "@pytest.mark.deployed" in block or f"def test_{check.name}(" in service
        assert deployed == check.deployed, check.name


def test_groups_run_in_dependency_order():
    selected = [checks.CHECKS_BY_NAME[name] for name in ("patches_applied", "cuda_sample", "driver_version")]
    assert checks.groups_for(selected) == ("host", "patches", "sample")


# --- the real H200 run (docs/validation/h200-2026-11-30.md): each probe's raw output ----------------

DEVICE = FIXTURES / "verify"


def device_probe(*groups: str) -> Probe:
    probe = Probe("@local")
    for group in groups:
        probe.sections.update(parse_sections((DEVICE / f"probe-{group}.txt").read_text()))
    return probe


def device_settings(**data):
    base = {"gpu_compute_capability": "9.0", "gpu_count": 1, "service_tp": 1, "cuda_link_policy": "new",
            "venv_path": "/opt/torch/.venv", "cuda_existing_toolkit": "accept"}
    return settings_from_data("@local", {**base, **data})


def test_the_real_h200_probes_pass_every_host_level_check():
    settings, probe = device_settings(), device_probe("host", "python", "sample")
    details = {check.name: check.judge(settings, probe) for check in checks.CHECKS if not check.deployed}
    assert {name: result.status for name, result in details.items()} == {name: checks.PASSED for name in details}
    assert details["driver_version"].detail == "driver 580.159.04 >= 580.82.07"
    assert details["version_json"].detail == ("no version.json: toolkit from dpkg package cuda-nvcc-13-0 13.0.88-1; "
                                              "nvcc 13.0.88 as pinned, accepted (cuda_existing_toolkit = 'accept')")
    assert details["cuda_link"].detail == ("/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0 "
                                           "(policy 'new')")
    assert details["cuda_sample"].detail == ('built with `nvcc -gencode arch=compute_90,code=sm_90`; device 0 sm_90 '
                                             '"NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error; '
                                             'devices 1: PASS')
    assert details["torch_cuda_build"].detail == "torch 2.11.0+cu130, torch.version.cuda == '13.0'"


def test_the_real_h200_fails_the_fleets_expectations_where_it_should():
    settings, probe = device_settings(gpu_compute_capability="12.0", gpu_count=8, service_tp=8,
                                      cuda_link_policy="keep"), device_probe("host", "python")
    assert outcome("gpu_capability", settings, probe).status == checks.FAILED
    assert outcome("torch_device_capability", settings, probe).detail == (
        "expected 8 device(s) of capability (12, 0) on @local, torch sees 1: cuda:0 is (9, 0)")
    assert "no record of where /usr/local/cuda pointed" in outcome("cuda_link", settings, probe).detail
    # PyPI's torch 2.11.0 carries no local label: it is not the pinned +cu130 build
    assert outcome("package_version", settings, probe, "torch").detail == (
        "torch 2.11.0 in /opt/torch/.venv on @local, expected 2.9.1+cu130")
    assert outcome("service_active", settings, probe).detail == "systemd is not running on @local (no /run/systemd/system)"
    refused = device_settings(cuda_existing_toolkit="refuse")
    assert "cannot be confirmed as CUDA 13.0.1" in outcome("version_json", refused, probe).detail


def test_the_sample_built_for_the_wrong_architecture_fails_on_the_real_h200():
    text, rc = (DEVICE / "sample-sm120.txt").read_text(), 1
    body = "\n".join(["nvcc -gencode arch=compute_120,code=sm_120", *text.splitlines()[1:-1]])
    result = outcome("cuda_sample", device_settings(), sample_probe(rc, body))
    assert result.status == checks.FAILED
    assert "FAIL bad=1048576/1048576 launch=no kernel image is available for execution on the device" in result.detail
