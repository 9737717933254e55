"""The sandbox stand-ins print, install and fail like the real things they replace.

nvidia-smi and nvcc are compared with real outputs captured on a GPU host (shared/fixtures);
the runfile stand-in only ever runs with SERVESTACK_STANDIN_ROOT set to a temporary directory
(this machine has a real /usr/local/cuda, which a guard checks is untouched); wheels are
installed with uv into temporary venvs made from /usr/bin/python3 (3.11, like the hosts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from sandbox.standins import Gpu, build_artifacts, build_runfile, closure, dress_gpu_host, render_nvidia_smi
from sandbox.standins.index import normalize_project, write_simple_index
from sandbox.standins.pypi import fetch_wheel
from sandbox.standins.runfile import runfile_info
from sandbox.standins.stack import reference_stack
from sandbox.standins.toolkit import write_toolkit_tree
from sandbox.standins.wheels import broken_wheel
from servestack.manifest import load_manifest
from tests.unit.standin_closure import build_with_requirements

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "h200-ubuntu2404"
MANIFEST = load_manifest()
REFERENCE = reference_stack()
UV = shutil.which("uv")

H200 = Gpu(name="NVIDIA H200", compute_cap="9.0", count=1, driver_version="580.159.04", memory_mib=143771,
           power_cap_w=700, power_draw_w=126, temperature_c=39, perf_state="P0",
           bus_ids=("00000000:00:06.0",), uuids=("GPU-b9361222-cb9e-0727-9b70-c512a10ee626",))


def fixture(name: str) -> tuple[str, list[str], int]:
    """(command, output lines, exit status) of a captured real output."""
    if not FIXTURES.is_dir():
        pytest.skip(f"real outputs not found at {FIXTURES}")
    command, _, rest = (FIXTURES / name).read_text().partition("\n")
    output, status = re.fullmatch(r"(.*?)\n?\[exit (\d+)\]\n*", rest, re.S).groups()
    return command.removeprefix("$ "), output.split("\n") if output else [], int(status)


def run(*args, env=None, cwd=None, check=False) -> subprocess.CompletedProcess:
    return subprocess.run([str(arg) for arg in args], capture_output=True, text=True, env=env, cwd=cwd,
                          check=check, timeout=120)


# --- nvidia-smi --------------------------------------------------------------------------

def smi_script(tmp_path: Path, gpu: Gpu | None = None) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(render_nvidia_smi(gpu))
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("name", ["nvidia-smi.txt", "nvidia-smi-L.txt", "nvidia-smi-query.txt",
                                  "nvidia-smi-query-noheader.txt"])
def test_nvidia_smi_prints_what_the_real_one_printed(tmp_path, name):
    command, expected, status = fixture(name)
    result = run(smi_script(tmp_path, H200), *command.split()[1:])
    lines = result.stdout.rstrip("\n").split("\n")
    if name == "nvidia-smi.txt":  # the first line is the time of the run
        assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", lines[0])
        lines, expected = lines[1:], expected[1:]
    assert (lines, result.returncode) == (expected, status)


def test_nvidia_smi_defaults_describe_the_target_fleet(tmp_path):
    smi = smi_script(tmp_path)
    query = run(smi, "--query-gpu=index,name,compute_cap,driver_version,memory.total,count", "--format=csv,noheader")
    rows = [line.split(", ") for line in query.stdout.splitlines()]
    assert len(rows) == MANIFEST.gpu["count"] == 8
    assert rows[7] == ["7", "NVIDIA RTX PRO 6000 Blackwell Server Edition", MANIFEST.gpu["compute_capability"],
                       MANIFEST.cuda["min_driver"], "97887 MiB", "8"]
    table = run(smi).stdout
    assert "|   7  NVIDIA RTX PRO 6000 Blac...    On  |" in table
    assert "CUDA Version: 13.0 " in table and table.count("97887MiB") == 8
    assert all(len(line) == 91 for line in table.splitlines()[1:] if line)


def test_nvidia_smi_ids_and_uuids_are_deterministic(tmp_path):
    smi = smi_script(tmp_path)
    first = run(smi, "-L").stdout
    (tmp_path / "again").mkdir()
    assert first == run(smi_script(tmp_path / "again"), "-L").stdout
    uuids = re.findall(r"\(UUID: (GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\)", first)
    assert len(set(uuids)) == 8
    bus = run(smi, "--query-gpu=pci.bus_id", "--format=csv,noheader").stdout.split()
    assert len(set(bus)) == 8 and all(re.fullmatch(r"00000000:[0-9A-F]{2}:[0-9A-F]{2}\.0", b) for b in bus)


def test_nvidia_smi_units_selection_and_errors(tmp_path):
    smi = smi_script(tmp_path)
    nounits = run(smi, "-i", "3", "--query-gpu=index,memory.total", "--format=csv,nounits")
    assert nounits.stdout == "index, memory.total [MiB]\n3, 97887\n"
    unknown = run(smi, "--query-gpu=name,bogus.field", "--format=csv")
    assert (unknown.returncode, unknown.stdout) == (2, 'Field "bogus.field" is not a valid field to query.\n\n')
    # no --format: csv with its header, as a real 580 nvidia-smi answers (tests/fixtures/h200-device)
    assert run(smi, "--query-gpu=name").stdout == "name\n" + "NVIDIA RTX PRO 6000 Blackwell Server Edition\n" * 8
    assert run(smi, "--bogus").stdout.startswith("ERROR: Option --bogus is not recognized.")


def test_nvidia_smi_without_driver(tmp_path):
    result = run(smi_script(tmp_path, Gpu(driver_loaded=False)), "--query-gpu=name", "--format=csv")
    assert result.returncode == 9
    assert result.stdout.strip() == ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                     "driver. Make sure that the latest NVIDIA driver is installed and running.")


def test_nvidia_smi_says_it_is_a_stand_in():
    assert "STAND-IN for NVIDIA's nvidia-smi (servestack sandbox): no GPU here" in render_nvidia_smi()


# --- toolkit tree ------------------------------------------------------------------------

def test_toolkit_13_nvcc_matches_the_real_one(tmp_path):
    tree = write_toolkit_tree(tmp_path / "cuda-13.0", MANIFEST.cuda["version"], MANIFEST.cuda["nvcc_version"])
    _, expected, _ = fixture("nvcc-version.txt")
    assert run(tree / "bin" / "nvcc", "--version").stdout.splitlines() == expected
    _, arch_line, _ = fixture("nvcc-help-arch.txt")
    real_archs = arch_line[0].split()
    assert run(tree / "bin" / "nvcc", "--list-gpu-arch").stdout.split() == real_archs
    assert run(tree / "bin" / "nvcc", "-arch=sm_120", "x.cu").returncode != 0


def test_toolkit_128_tree(tmp_path):
    tree = write_toolkit_tree(tmp_path / "cuda-12.8")
    version = run(tree / "bin" / "nvcc", "--version").stdout
    assert "Cuda compilation tools, release 12.8, V12.8.93\nBuild cuda_12.8.r12.8/compiler." in version
    data = json.loads((tree / "version.json").read_text())
    assert data["cuda"] == {"name": "CUDA SDK", "version": "12.8.1"}
    assert data["cuda_nvcc"] == {"name": "CUDA NVCC", "version": "12.8.93"}
    assert "cuda_cudart" in data
    assert (tree / "lib64" / "libcudart.so.12").resolve().is_file()
    assert "#define CUDA_VERSION 12080" in (tree / "include" / "cuda.h").read_text()
    assert os.access(tree / "bin" / "cuda-uninstaller", os.X_OK)
    files = [path for path in tree.rglob("*") if path.is_file()]
    assert len(files) >= 12 and sum(path.stat().st_size for path in files) > 200_000
    assert all("STAND-IN" in path.read_bytes().decode(errors="replace") for path in files
               if path.suffix in (".h", ".txt") or path.name in ("nvcc", "cuda-uninstaller"))


# --- the runfile ---------------------------------------------------------------------------

def _machine_cuda_state() -> tuple:
    link = Path("/usr/local/cuda")
    log = Path("/var/log/cuda-installer.log")
    return (os.readlink(link) if link.is_symlink() else link.exists(),
            log.stat().st_mtime if log.exists() else None)


@pytest.fixture(autouse=True)
def machine_untouched():
    """This machine's own /usr/local/cuda and installer log must never change here."""
    before = _machine_cuda_state()
    yield
    assert _machine_cuda_state() == before


@pytest.fixture(scope="module")
def runfiles(tmp_path_factory):
    """One stand-in runfile per mode."""
    base = tmp_path_factory.mktemp("runfiles")
    return {mode: build_runfile(base / mode, mode) for mode in ("normal", "repoint", "fail_midway", "broken_nvcc")}


def install(runfile: Path, root: Path, *flags, tmpdir: Path | None = None, env_tmpdir: str | None = None):
    """Run a stand-in runfile as the deploy does, confined to `root`."""
    tmpdir = tmpdir or root / "extract-tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "SERVESTACK_STANDIN_ROOT": str(root), "TMPDIR": env_tmpdir or str(tmpdir)}
    flags = flags or (*MANIFEST.cuda["installer_flags"], f"--installpath={MANIFEST.cuda['install_path']}",
                      f"--tmpdir={tmpdir}")
    return run("sh", runfile, *flags, env=env, cwd=root)


def test_runfile_named_like_nvidias_and_small(runfiles):
    info = runfile_info(runfiles["normal"])
    assert info.file == MANIFEST.runfiles["x86_64"].file
    assert 100_000 < info.size < 400_000
    data = runfiles["normal"].read_bytes()
    assert (info.md5, info.sha256) == (hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest())
    assert b"STAND-IN" in data[:20_000]


def test_runfile_installs_with_the_real_flags(runfiles, tmp_path):
    result = install(runfiles["normal"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tree = tmp_path / MANIFEST.cuda["install_path"].lstrip("/")
    version = run(tree / "bin" / "nvcc", "--version").stdout
    assert f"Cuda compilation tools, release 13.0, V{MANIFEST.cuda['nvcc_version']}" in version
    assert "Build cuda_13.0.r13.0/compiler.36424714_0" in version
    data = json.loads((tree / "version.json").read_text())
    assert data["cuda"]["version"] == MANIFEST.cuda["version"]
    assert data["cuda_nvcc"]["version"] == MANIFEST.cuda["nvcc_version"]
    assert (tree / "bin" / "cuda-uninstaller").is_file()
    assert oct(tree.stat().st_mode & 0o777) == "0o755" and oct((tree / "bin").stat().st_mode & 0o777) == "0o755"
    log = (tmp_path / MANIFEST.cuda["log_path"].lstrip("/")).read_text().splitlines()
    assert log and all(re.match(r"\[(INFO|ERROR|WARNING)\]: ", line) for line in log)
    assert not (tmp_path / "usr/local/cuda").exists()
    assert list((tmp_path / "extract-tmp").iterdir()) == []


def test_runfile_accepts_toolkitpath_and_extra_flags(runfiles, tmp_path):
    result = install(runfiles["normal"], tmp_path, "--silent", "--toolkit", "--toolkitpath=/opt/cuda-x", "--override",
                     "--no-man-page")
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "opt/cuda-x/bin/nvcc").is_file()


@pytest.mark.parametrize("flags, message", [
    (("--toolkit", "--installpath=/usr/local/cuda-13.0"), "pass --silent"),
    (("--silent", "--driver", "--toolkit"), "--driver is refused"),
    (("--silent", "--installpath=/usr/local/cuda-13.0"), "without --toolkit"),
    (("--silent", "--toolkit", "--samples"), "Unknown option: --samples"),
])
def test_runfile_refuses(runfiles, tmp_path, flags, message):
    result = install(runfiles["normal"], tmp_path, *flags)
    assert result.returncode == 1 and message in result.stdout
    assert not (tmp_path / "usr/local/cuda-13.0").exists()


def test_runfile_extracts_into_tmpdir(runfiles, tmp_path):
    extract = tmp_path / "big-tmp"
    ok = install(runfiles["normal"], tmp_path / "a", tmpdir=extract, env_tmpdir="/nonexistent")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    flags = (*MANIFEST.cuda["installer_flags"], "--installpath=/usr/local/cuda-13.0")
    without = install(runfiles["normal"], tmp_path / "b", *flags, env_tmpdir="/nonexistent")
    assert without.returncode != 0 and "/nonexistent" in without.stdout + without.stderr


def test_runfile_repoint_mode_moves_the_cuda_link(runfiles, tmp_path):
    (tmp_path / "usr/local").mkdir(parents=True)
    (tmp_path / "usr/local/cuda").symlink_to("cuda-12.8")
    assert install(runfiles["repoint"], tmp_path).returncode == 0
    assert os.readlink(tmp_path / "usr/local/cuda") == MANIFEST.cuda["install_path"]
    assert "Created symlink /usr/local/cuda" in (tmp_path / "var/log/cuda-installer.log").read_text()


def test_runfile_fail_midway_leaves_half_a_tree(runfiles, tmp_path):
    result = install(runfiles["fail_midway"], tmp_path)
    assert result.returncode == 1 and "Installation failed. See log at /var/log/cuda-installer.log" in result.stdout
    tree = tmp_path / "usr/local/cuda-13.0"
    assert (tree / "targets").is_dir() and not (tree / "bin" / "nvcc").exists()
    assert "[ERROR]: " in (tmp_path / "var/log/cuda-installer.log").read_text()


def test_runfile_broken_nvcc_exits_zero_but_nvcc_fails(runfiles, tmp_path):
    assert install(runfiles["broken_nvcc"], tmp_path).returncode == 0
    with pytest.raises(OSError):
        subprocess.run([tmp_path / "usr/local/cuda-13.0/bin/nvcc", "--version"], capture_output=True)
    assert run("sh", "-c", f"{tmp_path}/usr/local/cuda-13.0/bin/nvcc --version").returncode != 0


# --- wheels ---------------------------------------------------------------------------------

class Uv:
    """uv with one cache for the whole module and no configuration of this machine."""

    def __init__(self, cache: Path):
        assert UV, "uv is needed for these tests"
        self.env = {key: value for key, value in os.environ.items() if not key.startswith(("UV_", "PIP_"))}
        self.env.update(UV_CACHE_DIR=str(cache), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never")

    def __call__(self, *args) -> subprocess.CompletedProcess:
        return run(UV, *args, env=self.env)

    def venv(self, path: Path) -> Path:
        """A new venv on /usr/bin/python3 (3.11, as on the hosts); returns its python."""
        assert self("venv", "-q", "-p", "/usr/bin/python3", path).returncode == 0
        return path / "bin" / "python"

    def install(self, python: Path, *args) -> subprocess.CompletedProcess:
        result = self("pip", "install", "--python", python, *args)
        if result.returncode == -signal.SIGSEGV:
            # uv 0.13.9 can crash at exit after a complete install (astral-sh/uv#21428; it failed CI once
            # here). The deploy repeats such a step once (files/scripts/ml_env.py), and so does this.
            result = self("pip", "install", "--python", python, *args)
        return result


@pytest.fixture(scope="module")
def uv(tmp_path_factory) -> Uv:
    return Uv(tmp_path_factory.mktemp("uv-cache"))


def py(python: Path, code: str, **env) -> subprocess.CompletedProcess:
    return run(python, "-c", code, env={**os.environ, **env})


#: Projects a stand-in requires unpinned that have no stand-in builder (the sandbox serves the real
#: wheels); these tests put metadata-only wheels of them beside the stand-ins, at these versions.
@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    """Every stand-in wheel of the stack, old and new, with a wheel for each thing they require (the
    +cu130 torch family's nvidia libraries and triton, filelock, sympy, numpy, pillow, ...)."""
    out = tmp_path_factory.mktemp("wheels")
    for name, version in [("torch", "2.9.1+cu130"), ("torch", "2.9.1+cu128"), ("torch", "2.9.1"),
                          ("torchvision", "0.24.1+cu130"), ("torchaudio", "2.9.1+cu130"),
                          ("sgl-kernel", "0.3.21"), ("sgl-kernel", "0.3.21+cu130"),
                          ("flashinfer-python", "0.6.3"), ("flashinfer-python", "0.6.4"),
                          ("flashinfer-cubin", "0.6.3"), ("flashinfer-cubin", "0.6.4"),
                          ("flashinfer-jit-cache", "0.6.4+cu130"), ("cuda-python", "12.9")]:
        build_with_requirements(name, version, out)
    return out


def test_wheel_names_follow_the_real_ones(standin_dir):
    names = {path.name for path in standin_dir.iterdir()}
    assert "torch-2.9.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl" in names
    assert "sgl_kernel-0.3.21+cu130-cp310-abi3-manylinux2014_x86_64.whl" in names
    assert "flashinfer_jit_cache-0.6.4+cu130-cp39-abi3-manylinux_2_28_x86_64.whl" in names
    assert "flashinfer_python-0.6.4-py3-none-any.whl" in names
    with zipfile.ZipFile(standin_dir / "torch-2.9.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl") as wheel:
        metadata = wheel.read("torch-2.9.1+cu130.dist-info/METADATA").decode()
    assert "Summary: STAND-IN for PyTorch 2.9.1+cu130" in metadata


@pytest.mark.parametrize("label, cuda, cudnn", [("+cu130", "13.0", "91300"), ("+cu128", "12.8", "None"),
                                                ("", "12.8", "None")])
def test_torch_reports_the_cuda_of_its_label(uv, tmp_path, label, cuda, cudnn):
    """torch.version.cuda follows the label; the +cu130 build requires (and so installs) its pinned
    nvidia-cudnn-cu13 9.13.0.50, whose version torch.backends.cudnn reports; the cu128 and PyPI
    stand-ins keep no requirements, so no cuDNN is installed with them."""
    wheels = build_with_requirements("torch", f"2.9.1{label}", tmp_path / "wheels")
    python = uv.venv(tmp_path / "venv")
    result = uv.install(python, "--offline", "--no-index", "--find-links", wheels[0].parent, "torch==2.9.1")
    assert result.returncode == 0, result.stderr
    out = py(python, "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), "
                     "torch.cuda.device_count(), torch.backends.cudnn.version()); "
                     "print(torch.__doc__)").stdout.splitlines()
    # torch.__version__ has the build's label even where the wheel's version has none (PyPI's 2.9.1 is cu128)
    assert out[0] == f"2.9.1{label or '+cu128'} {cuda} False 0 {cudnn}" and "STAND-IN" in out[1]


def test_flashinfer_checks_its_companions(uv, tmp_path, standin_dir):
    python = uv.venv(tmp_path / "venv")
    base = ("--offline", "--no-index", "--find-links", standin_dir)
    assert uv.install(python, *base, "flashinfer-python==0.6.4", "flashinfer-cubin==0.6.3").returncode == 0
    wrong_cubin = py(python, "import flashinfer")
    assert ("RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4). Please "
            "install the same version of both packages. Set FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this "
            "check.") in wrong_cubin.stderr
    assert py(python, "import flashinfer", FLASHINFER_DISABLE_VERSION_CHECK="1").returncode == 0
    assert uv.install(python, *base, "flashinfer-cubin==0.6.4", "flashinfer-jit-cache==0.6.4+cu130").returncode == 0
    right = py(python, "import flashinfer; print(flashinfer.__version__)")
    assert (right.returncode, right.stdout) == (0, "0.6.4\n")
    assert uv.install(python, *base, "flashinfer-python==0.6.3", "flashinfer-cubin==0.6.3").returncode == 0
    wrong_jit = py(python, "import flashinfer")
    assert "flashinfer-jit-cache version (0.6.4+cu130) does not match flashinfer version (0.6.3)" in wrong_jit.stderr


#: What uv 0.13.9 says of each broken torch, and its exit status: a wheel it cannot open fails the
#: resolution (1: no solution), one whose METADATA names another version fails the install (2: an error).
BROKEN_TORCH = {
    "corrupt_zip": (1, "error: No solution found when resolving dependencies\n"
                       "  cause: Because torch==2.9.1+cu130 has an invalid package format and you require "
                       "torch==2.9.1+cu130, we can conclude that your requirements are unsatisfiable.\n\n"
                       "hint: The structure of `torch` (v2.9.1+cu130) was invalid:\n"
                       "  Failed to read from zip file\n"),
    "bad_metadata": (2, "error: Failed to install: torch-2.9.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl "
                        "(torch==2.9.1+cu130)\n"
                        "  cause: Wheel version does not match filename (0.0.0 != 2.9.1+cu130), which indicates "
                        "a malformed wheel."),
}


def assert_refused_as_broken(result: subprocess.CompletedProcess, kind: str) -> None:
    status, reason = BROKEN_TORCH[kind]
    assert (result.returncode, reason in result.stderr) == (status, True), result.stderr


@pytest.mark.parametrize("kind", ["corrupt_zip", "bad_metadata"])
def test_broken_wheels_fail_to_install(uv, tmp_path, standin_dir, kind):
    """The broken torch fails the install, itself: the stand-ins it requires are there beside it."""
    bad = broken_wheel(standin_dir / "torch-2.9.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl", tmp_path / "bad", kind)
    for wheel in build_with_requirements("torch", "2.9.1+cu130", tmp_path / "good")[1:]:
        shutil.copy2(wheel, bad.parent)
    python = uv.venv(tmp_path / "venv")
    result = uv.install(python, "--offline", "--no-index", "--find-links", bad.parent, "torch==2.9.1+cu130")
    assert_refused_as_broken(result, kind)


def test_simple_index_resolves_with_uv(uv, tmp_path, standin_dir):
    index = write_simple_index(tmp_path / "simple", sorted(standin_dir.iterdir()))
    page = (index / "torch" / "index.html").read_text()
    wheel = index / "torch" / "torch-2.9.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert f'href="torch-2.9.1%2Bcu130-cp311-cp311-manylinux_2_28_x86_64.whl#sha256={digest}"' in page
    assert 'href="flashinfer-python/"' in (index / "index.html").read_text()
    python = uv.venv(tmp_path / "venv")
    result = uv.install(python, "--index-url", index.as_uri(), "torch==2.9.1+cu130", "torchvision==0.24.1+cu130",
                        "torchaudio", "sgl-kernel==0.3.21+cu130")
    assert result.returncode == 0, result.stderr
    assert "torchaudio==2.9.1+cu130" in result.stderr


# --- sglang (real wheel from PyPI, cached) and the whole artifact tree -----------------------

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return build_artifacts(tmp_path_factory.mktemp("artifacts") / "srv")


def test_the_pypi_index_serves_each_stack_as_pypi_resolves_it_with_the_real_sglang(artifacts):
    """Every package of each stack's real resolution (closure.py), at its version, from an upload time
    before that stack's bound; sglang itself is PyPI's wheel, byte for byte."""
    served = artifacts.indexes["pypi"]
    times = json.loads((served / "upload-times.json").read_text())
    for stack in MANIFEST.stacks.values():
        elsewhere = {normalize_project(package.name) for package in stack.packages if package.index != "pypi"}
        for project, version in closure.resolve(stack).items():
            if project in elsewhere:
                continue
            found = [path for path in (served / project).glob("*.whl") if path.name.split("-")[1] == version]
            assert len(found) == 1, (project, version, found)
            assert times[found[0].name] < stack.exclude_newer, (found[0].name, times[found[0].name])
        sglang = stack.package("sglang").version
        (served_sglang,) = (served / "sglang").glob(f"sglang-{sglang}-*.whl")
        assert served_sglang.read_bytes() == fetch_wheel("sglang", sglang).read_bytes()


def test_artifact_tree_mirrors_the_manifest_urls(artifacts):
    runfile = MANIFEST.runfiles["x86_64"]
    assert artifacts.runfile == artifacts.root / runfile.url.split("://", 1)[1]
    assert artifacts.md5sum.read_text() == f"{artifacts.runfile_info.md5}  {runfile.file}\n"
    data = artifacts.host_data("http://10.9.0.1:8080")
    assert data["cuda_runfile_url"] == "http://10.9.0.1:8080/" + runfile.url.split("://", 1)[1]
    for name, url in MANIFEST.indexes.items():
        assert data[f"index_{name}_url"] == "http://10.9.0.1:8080/" + url.split("://", 1)[1]
    sgl = REFERENCE.package("sgl-kernel").wheel["x86_64"]
    assert data["wheel_url_sgl_kernel"] == "http://10.9.0.1:8080/" + sgl.split("://", 1)[1]
    assert data["uv_index_url"] == data["index_pypi_url"]
    uv_wheels = list((artifacts.indexes["pypi"] / "uv").glob(f"uv-{MANIFEST.uv['version']}-*manylinux*x86_64*.whl"))
    assert len(uv_wheels) == 1
    assert {path.name for path in artifacts.indexes["pypi"].iterdir()} >= {
        "sglang", "torch", "flashinfer-python", "flashinfer-cubin", "sglang-kernel", "cuda-python", "numpy",
        "nvidia-cudnn-cu13", "triton", "transformers", "pillow"}


def test_stack_installs_from_the_artifact_indexes(uv, tmp_path, artifacts):
    """The deploy's install of the reference stack: explicit indexes, every pin of the default index
    as an override (flashinfer 0.6.4 over sglang's 0.6.3, nvidia-cudnn-cu13 9.16.0.29 over torch's
    9.13.0.50), then `import sglang` works and torch sees the overriding cuDNN."""
    python = uv.venv(tmp_path / "venv")
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("".join(f"{package.requirement}\n" for package in REFERENCE.packages
                                 if package.index == "pypi"))
    assert {"flashinfer-python==0.6.4", "flashinfer-cubin==0.6.4",
            "nvidia-cudnn-cu13==9.16.0.29"} <= set(overrides.read_text().split())
    indexes = ("--index-url", artifacts.indexes["pypi"].as_uri(),
               "--extra-index-url", artifacts.indexes["torch"].as_uri(),
               "--extra-index-url", artifacts.indexes["flashinfer"].as_uri(), "--overrides", overrides)
    result = uv.install(python, *indexes, *(package.requirement for package in REFERENCE.packages if not package.wheel),
                        artifacts.wheels["sgl-kernel"])
    assert result.returncode == 0, result.stderr
    out = py(python, "import sglang, torch, flashinfer, sgl_kernel; print(sglang.__version__, torch.version.cuda, "
                     "flashinfer.__version__, torch.backends.cudnn.version())")
    assert (out.returncode, out.stdout) == (0, f"{REFERENCE.package('sglang').version} 13.0 0.6.4 91600\n"), out.stderr


def test_upstream_sglang_release_is_served_for_the_patch_tests(uv, tmp_path, artifacts):
    """sglang 0.5.10 (the release with upstream fixes) installs as the patch tests install it: alone."""
    python = uv.venv(tmp_path / "venv")
    result = uv.install(python, "--no-deps", "--index-url", artifacts.indexes["pypi"].as_uri(), "sglang==0.5.10")
    assert result.returncode == 0, result.stderr
    assert py(python, "import importlib.metadata as m; print(m.version('sglang'))").stdout == "0.5.10\n"


@pytest.mark.parametrize("kind", ["corrupt_zip", "bad_metadata"])
def test_broken_torch_index_fails(uv, tmp_path, artifacts, kind):
    """The broken torch fails the install, itself: what it requires comes from the pypi index, as in the deploy."""
    python = uv.venv(tmp_path / "venv")
    overrides = tmp_path / "overrides.txt"   # as the deploy: the stack's pins of the default index win
    overrides.write_text("".join(f"{p.requirement}\n" for p in REFERENCE.packages if p.index == "pypi"))
    result = uv.install(python, "--index-url", artifacts.indexes["pypi"].as_uri(), "--overrides", overrides,
                        "--extra-index-url", artifacts.broken_indexes[kind].as_uri(), "torch==2.9.1+cu130")
    assert_refused_as_broken(result, kind)


# --- a dressed host root ---------------------------------------------------------------------

def test_dress_gpu_host(uv, tmp_path):
    root = dress_gpu_host(tmp_path / "host")
    smi = root / "usr/bin/nvidia-smi"
    assert os.access(smi, os.X_OK) and run(smi, "-L").stdout.count("RTX PRO 6000") == 8
    assert os.readlink(root / "usr/local/cuda") == "cuda-12.8"
    assert "V12.8.93" in run(root / "usr/local/cuda/bin/nvcc", "--version").stdout
    venv = root / MANIFEST.venv["path"].lstrip("/")
    config = (venv / "pyvenv.cfg").read_text()
    assert config.startswith("home = /usr/bin\n") and f"uv = {MANIFEST.uv['version']}\n" in config
    assert "version_info = 3.11.2\ninclude-system-site-packages = false\n" in config
    assert os.readlink(venv / "bin/python") == "/usr/bin/python3" and os.readlink(venv / "bin/python3") == "python"
    site = venv / "lib/python3.11/site-packages"
    assert (site / "torch-2.9.1+cu128.dist-info/INSTALLER").read_text() == "uv"
    # This machine's /usr/bin/python3 is the hosts' (3.11), so the venv runs here as it will there.
    out = py(venv / "bin/python", "import sys, torch, torchvision, torchaudio; print(sys.prefix); "
                                  "print(torch.__version__, torch.version.cuda, "
                                  "torchvision.__version__, torchaudio.__version__)")
    assert out.stdout.splitlines() == [str(venv), "2.9.1+cu128 12.8 0.24.1+cu128 2.9.1+cu128"]
    listed = json.loads(uv("pip", "list", "--python", venv / "bin/python", "--format", "json").stdout)
    assert {item["name"]: item["version"] for item in listed} == {
        "torch": "2.9.1+cu128", "torchvision": "0.24.1+cu128", "torchaudio": "2.9.1+cu128"}
    check = uv("pip", "check", "--python", venv / "bin/python")
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_changed_host_is_reported_by_the_lines_that_differ():
    """A dry run that changes a host fails the rehearsal naming what changed, not only that something did."""
    from sandbox.lab import Lab

    before = {"h1": "/etc/a 1 10.0  644\n/etc/b 1 10.0  644\nsglang.service loaded active running", "h2": "/etc/a"}
    after = {"h1": "/etc/a 1 10.0  644\n/etc/b 2 11.0  644\nsglang.service loaded active running", "h2": "/etc/a"}
    assert Lab.changes(before, after) == ["h1: - /etc/b 1 10.0  644", "h1: + /etc/b 2 11.0  644"]
    assert Lab.changes(before, before) == []
    assert len(Lab.changes({"h": "\n".join(map(str, range(50)))}, {"h": ""}, limit=5)) == 5
