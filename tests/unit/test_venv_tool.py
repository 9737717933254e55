"""The host-side tool (files/scripts/ml_env.py), run here against temporary directories.

The build tests resolve and install the stand-in stack with the real uv from a loopback index
(tests/unit/venv_index.py); they are skipped where uv is not installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.context import ctx_host, ctx_state

from facts import venv as facts_venv
from facts.venv import MlEnvState, tool_result
from operations import venv as venv_step
from operations.venv import activate_release, mlenv_fact_arguments
from sandbox.standins.stack import reference_stack
from sandbox.standins.wheels import TORCH_TAG, WheelSpec, build_wheel, standin_wheel
from servestack.manifest import load_manifest
from servestack.releases import CHECK, TOOL, encode, release_at, release_plan

sys.path.insert(0, str(Path(__file__).parent))
import venv_index  # noqa: E402

from servestack.serving import service_environment  # noqa: E402
from servestack.settings import host_settings, settings_from_data  # noqa: E402
from tests.unit.fake_host import fake_state, read_keys, run_here  # noqa: E402
from tests.unit.flock_holder import flock_held  # noqa: E402

spec = importlib.util.spec_from_file_location("ml_env", TOOL)
ml_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ml_env)

UV = shutil.which("uv")
HOST_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
needs_uv = pytest.mark.skipif(UV is None or ml_env.uv_version(UV) != load_manifest().uv["version"],
                              reason="needs uv at the manifest's version on PATH")

LOCK = """\
filelock==3.0 \\
    --hash=sha256:aa
    # via torch
    # from https://pypi.org/simple
flashinfer-python==0.6.4 \\
    --hash=sha256:bb
    # via
    #   --override overrides.txt
    #   servestack-release (pyproject.toml)
    #   sglang
    # from https://pypi.org/simple
sgl-kernel @ https://github.com/x/sgl_kernel-0.3.21+cu130-cp310-abi3-manylinux2014_x86_64.whl \\
    --hash=sha256:cc
    # via
    #   servestack-release (pyproject.toml)
    #   sglang
requests==2.32.0 \\
    --hash=sha256:dd
    # via sglang
sglang==0.5.9 \\
    --hash=sha256:ee
    # via servestack-release (pyproject.toml)
    # from https://pypi.org/simple
torch==2.9.1+cu130 \\
    --hash=sha256:ff
    --hash=sha256:ab
    # via
    #   servestack-release (pyproject.toml)
    #   sglang
    # from https://download.pytorch.org/whl/cu130
"""
STEPS = {"torch": 1, "sglang": 2, "sgl-kernel": 3, "flashinfer-python": 4}


def test_parse_lock_reads_pins_urls_hashes_and_indexes():
    entries = {entry["name"]: entry for entry in ml_env.parse_lock(LOCK)}
    assert entries["torch"]["version"] == "2.9.1+cu130"
    assert entries["torch"]["hashes"] == ["sha256:ff", "sha256:ab"]
    assert entries["torch"]["index"] == "https://download.pytorch.org/whl/cu130"
    assert entries["sgl-kernel"]["url"].endswith(".whl") and entries["sgl-kernel"]["index"] is None
    assert entries["flashinfer-python"]["via"] == ["--override overrides.txt",
                                                   "servestack-release (pyproject.toml)", "sglang"]


def test_steps_follow_the_documented_order_and_dependencies_join_their_first_user():
    step_of = ml_env.assign_steps(ml_env.parse_lock(LOCK), STEPS)
    assert step_of == {"filelock": 1, "flashinfer-python": 4, "sgl-kernel": 3, "requests": 2,
                       "sglang": 2, "torch": 1}


def test_step_files_group_by_step_and_index():
    files = ml_env.step_files(ml_env.parse_lock(LOCK), STEPS)
    assert [(step, index) for step, index, _ in files] == [
        (1, "https://download.pytorch.org/whl/cu130"), (1, "https://pypi.org/simple"),
        (2, None), (2, "https://pypi.org/simple"), (3, None), (4, "https://pypi.org/simple")]
    torch_file = files[0][2]
    assert torch_file == "torch==2.9.1+cu130 \\\n    --hash=sha256:ff \\\n    --hash=sha256:ab\n"


def run_tool(command, params):
    result = subprocess.run([sys.executable, str(TOOL), command, encode(params)], capture_output=True, text=True)
    # the result is the section `result`; a build prints its progress before it
    output = tool_result(result.stdout.splitlines()) if result.returncode == 0 else None
    return result.returncode, output, result.stderr


@pytest.fixture
def host(tmp_path):
    """Paths of a pretend host under tmp_path (nothing outside it is touched)."""
    paths = {"venv_path": str(tmp_path / "ml-env"), "releases_dir": str(tmp_path / "releases"),
             "state_dir": str(tmp_path / "state"), "uv": str(tmp_path / "uv" / "bin" / "uv")}
    if UV:
        Path(paths["uv"]).parent.mkdir(parents=True)
        os.symlink(UV, paths["uv"])
    return paths


def hand_made_venv(path, packages):
    """A venv made by hand (uv venv) holding stand-in wheels `packages` [(name, version)]."""
    subprocess.run([UV, "venv", "-q", "--python", HOST_PYTHON, path], check=True,
                   env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    wheels = [str(build_wheel(standin_wheel(name, version), Path(path).parent / "wheels"))
              for name, version in packages]
    subprocess.run([UV, "pip", "install", "-q", "--python", f"{path}/bin/python", "--no-deps", *wheels],
                   check=True)


def read_state(paths: dict, python: str = sys.executable) -> dict | None:
    """The MlEnvState fact's value on the pretend host `paths`: its real command run with sh here."""
    fact = MlEnvState()
    arguments = {key: paths[key] for key in ("venv_path", "releases_dir", "state_dir")}
    result = subprocess.run(["sh", "-c", fact.command(**arguments, python=python)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return fact.process(result.stdout.splitlines())


def test_state_of_an_empty_host(host):
    state = read_state(host)
    assert state["venv_path"] == {"path": host["venv_path"], "kind": "missing", "target": None, "realpath": None,
                                  "release": None}
    assert state["releases"] == {} and state["history"] == [] and state["backups"] == []
    assert state["latest_backup"] is None


def test_state_calls_a_plain_directory_other(host):
    os.makedirs(host["venv_path"])
    assert read_state(host)["venv_path"]["kind"] == "other"


def fake_uv(path, body):
    """An executable shell script standing in for uv at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    Path(path).write_text("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return str(path)


def test_state_starts_no_python_but_its_version(host, tmp_path):
    """MlEnvState runs on every converge, twice: the only Python it starts is `PYTHON -V`."""
    calls = tmp_path / "calls"
    python = fake_uv(tmp_path / "bin" / "python3", f'echo "$*" >> {calls}; exec {sys.executable} "$@"')
    os.makedirs(host["venv_path"])
    state = read_state(host, python=python)
    assert state["venv_path"]["kind"] == "other" and calls.read_text() == "-V\n"


def test_state_reports_python_and_machine_as_platform_does(host):
    state = read_state(host)
    assert state["python"] == {"version": platform.python_version(), "executable": sys.executable}
    assert state["machine"] == platform.machine()


@pytest.mark.parametrize("sys_version", [
    "3.11.2 (main, Mar 13 2023, 12:18:29) [GCC 12.2.0]",
    "3.13.0rc1 (main, Aug  1 2024, 00:00:00) [GCC 13.2.0]",
    "3.14.0a1+ (heads/main:0123abc, Oct  1 2024, 10:00:00) [Clang 16.0.0 ]",
    "3.12 (default, Jan  1 2024, 00:00:00) [GCC 13.2.0]",
    "3.9.18 (main, Sep 11 2023, 13:41:44) \n[GCC 11.2.0]",
    "3.10.13 (f1607341da97, Oct 06 2023, 00:00:00)\n[PyPy 7.3.13 with GCC 10.2.1 20210130 (Red Hat 10.2.1-11)]",
])
def test_python_version_is_what_platform_derives_from_sys_version(sys_version):
    """`python -V` prints `Python ` and sys.version's first word."""
    assert facts_venv.python_version(sys_version.split()[0]) == platform._sys_version(sys_version)[1]


def test_state_is_none_without_the_python(host):
    assert read_state(host, python="no-such-python3") is None


def _at_venv_path(kind: str, host: dict, tmp_path: Path) -> None:
    venv_path, releases = Path(host["venv_path"]), Path(host["releases_dir"])
    release_venv = releases / "r-0123456789ab" / "venv"
    release_venv.mkdir(parents=True)
    (release_venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if kind == "link to a release":
        venv_path.symlink_to(release_venv)
    elif kind == "relative link to a release":
        venv_path.symlink_to(os.path.relpath(release_venv, venv_path.parent))
    elif kind == "link elsewhere":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "pyvenv.cfg").write_text("")
        venv_path.symlink_to(tmp_path / "elsewhere")
    elif kind == "broken link":
        venv_path.symlink_to(releases / "r-000000000000" / "venv")
    elif kind == "link to a directory without pyvenv.cfg":
        (tmp_path / "bare").mkdir()
        venv_path.symlink_to(tmp_path / "bare")
    elif kind == "venv":
        venv_path.mkdir()
        (venv_path / "pyvenv.cfg").write_text("")
    elif kind == "plain directory":
        venv_path.mkdir()
    elif kind == "file":
        venv_path.write_text("not a venv")


@pytest.mark.parametrize("kind", ["missing", "link to a release", "relative link to a release", "link elsewhere",
                                  "broken link", "link to a directory without pyvenv.cfg", "venv",
                                  "plain directory", "file"])
def test_the_fact_judges_venv_path_as_the_host_tool_does(host, tmp_path, kind):
    """The fact (shell, parsed here) and the host tool's `venv_path_state` (used by backup and
    activate) are two readings of one rule: they must agree."""
    _at_venv_path(kind, host, tmp_path)
    assert read_state(host)["venv_path"] == ml_env.venv_path_state(host["venv_path"], host["releases_dir"])


def test_a_release_behind_a_linked_releases_dir_is_named(host, tmp_path):
    """releases_dir may sit on another disk behind a symlink: the link venv_path holds names the
    release all the same, for the fact as for the host tool (neither resolves it first)."""
    disk = tmp_path / "data" / "releases"
    disk.mkdir(parents=True)
    os.symlink(disk, host["releases_dir"])
    _at_venv_path("link to a release", host, tmp_path)
    state = read_state(host)["venv_path"]
    assert state["release"] == "r-0123456789ab" and state["realpath"] == str(disk / "r-0123456789ab" / "venv")
    assert state == ml_env.venv_path_state(host["venv_path"], host["releases_dir"])


def test_release_records_as_the_host_tool_wrote_them(host):
    releases = Path(host["releases_dir"])
    for name, record in (("r-0123456789ab", '{"id": "r-0123456789ab", "status": "ok"}'),
                         ("r-ba9876543210", "not json"), ("adopted-20260101T000000Z", None)):
        (releases / name / "venv").mkdir(parents=True)
        if record is not None:
            (releases / name / "release.json").write_text(record)
    (releases / "r-ba9876543210" / "venv" / "pyvenv.cfg").write_text("")
    (releases / "not-a-release").mkdir()
    (releases / ".build-guard").write_text("")
    assert read_state(host)["releases"] == {
        "adopted-20260101T000000Z": {"status": "incomplete", "has_venv": False},
        "r-0123456789ab": {"id": "r-0123456789ab", "status": "ok", "has_venv": False},
        "r-ba9876543210": {"status": "incomplete", "has_venv": True},
    }


def test_backups_are_listed_in_order_and_the_latest_read(host):
    backups = Path(host["state_dir"], "backups")
    backups.mkdir(parents=True)
    for name in ("20260102T000000Z.json", "20260101T000000Z.json", "20260102T000000Z-2.json", "notes.json"):
        backups.joinpath(name).write_text(json.dumps({"name": name}))
    state = read_state(host)
    assert state["backups"] == ["20260101T000000Z.json", "20260102T000000Z-2.json", "20260102T000000Z.json"]
    assert state["latest_backup"] == {"name": "20260102T000000Z.json"}


def test_the_active_packages_of_a_host_without_an_environment_are_none(host):
    assert run_tool("packages", host)[:2] == (0, None)


@needs_uv
def test_the_active_packages_are_listed_by_the_environments_own_python(host):
    hand_made_venv(host["venv_path"], [("torch", "2.9.1+cu128")])
    code, active, _ = run_tool("packages", host)
    assert code == 0 and active["packages"]["torch"] == "2.9.1+cu128" and active["prefix"] == host["venv_path"]


@pytest.mark.parametrize("body, version", [
    ("echo 'uv 0.13.9 (abc 2026-01-01)'; echo noise >&2", "0.13.9"),
    ("echo 'uv 0.13.9'; exit 1", None),
    ("echo uv", None),
    ("exit 0", None),
])
def test_uv_version_reads_the_second_word_of_a_successful_run(tmp_path, body, version):
    assert ml_env.uv_version(fake_uv(tmp_path / "uv", body)) == version


def test_uv_version_is_none_when_uv_cannot_run(tmp_path):
    not_executable = tmp_path / "plain-file"
    not_executable.write_text("uv 0.13.9\n")
    for uv in (tmp_path / "missing", tmp_path, not_executable):
        assert ml_env.uv_version(str(uv)) is None


def test_a_uv_that_outlives_its_timeout_gives_no_version(tmp_path):
    started = time.monotonic()
    assert ml_env.uv_version(fake_uv(tmp_path / "uv", "echo uv 1.0; exec sleep 30"), timeout=0.3) is None
    assert time.monotonic() - started < 10


# A uv stand-in that kills itself with SIGSEGV while `crashes` marker files remain, then works.
CRASHING_UV = """
for marker in {markers}; do
    if [ -e "$marker" ]; then rm "$marker"; echo "installed everything"; kill -SEGV $$; fi
done
echo "installed everything"
"""


def crashing_uv(tmp_path, crashes):
    markers = [tmp_path / f"crash-{number}" for number in range(crashes)]
    for marker in markers:
        marker.touch()
    return fake_uv(tmp_path / "uv", CRASHING_UV.format(markers=" ".join(map(str, markers)))), markers


def test_a_uv_step_killed_by_a_crash_signal_runs_once_more(tmp_path):
    uv, markers = crashing_uv(tmp_path, crashes=1)
    with open(tmp_path / "build.log", "w") as log:
        ml_env.run([uv, "pip", "install"], log, dict(os.environ), what="install step 1", retry_crash=True)
    text = (tmp_path / "build.log").read_text()
    assert not any(marker.exists() for marker in markers)
    assert text.count("$ " + uv) == 2 and f"# {uv} died from SIGSEGV; running it once more" in text
    assert text.rstrip().splitlines()[-1].startswith("# exit 0 after")


def test_a_second_crash_fails_the_step_and_names_the_signal(tmp_path):
    uv, _ = crashing_uv(tmp_path, crashes=2)
    with open(tmp_path / "build.log", "w") as log, pytest.raises(ml_env.Failure) as failure:
        ml_env.run([uv, "pip", "install"], log, dict(os.environ), what="install step 1", retry_crash=True)
    assert str(failure.value).startswith("install step 1 failed (killed by SIGSEGV): ")
    assert (tmp_path / "build.log").read_text().count("$ " + uv) == 2


@pytest.mark.parametrize("body, retried", [("kill -SEGV $$", False), ("exit 3", True)])
def test_only_a_crash_in_a_retryable_step_is_retried(tmp_path, body, retried):
    """`uv venv` (retry_crash=False) is not repeated, nor is an ordinary failure of any step."""
    uv = fake_uv(tmp_path / "uv", body)
    with open(tmp_path / "build.log", "w") as log, pytest.raises(ml_env.Failure):
        ml_env.run([uv, "venv"], log, dict(os.environ), retry_crash=retried)
    assert (tmp_path / "build.log").read_text().count("$ " + uv) == 1


def test_backup_without_environment_writes_nothing(host):
    code, result, _ = run_tool("backup", {**host, "keep": 5})
    assert code == 0 and result["written"] is None
    assert not os.path.exists(os.path.join(host["state_dir"], "backups"))


@needs_uv
def test_backup_records_packages_with_local_labels_once_and_prunes(host):
    hand_made_venv(host["venv_path"], [("torch", "2.9.1+cu128")])
    code, result, _ = run_tool("backup", {**host, "keep": 2})
    assert code == 0 and result["written"]
    snapshot = json.loads(Path(host["state_dir"], "backups", result["written"]).read_text())
    assert snapshot["packages"]["torch"] == "2.9.1+cu128"
    assert snapshot["venv_path"] == host["venv_path"] and snapshot["python"] and snapshot["timestamp"]
    assert run_tool("backup", {**host, "keep": 2})[1]["written"] is None  # unchanged env: no new snapshot
    backups = Path(host["state_dir"], "backups")
    for stamp in ("20200101T000000Z", "20200102T000000Z"):
        (backups / f"{stamp}.json").write_text("{}")
    code, result, _ = run_tool("backup", {**host, "keep": 2})
    assert result["pruned"] == ["20200101T000000Z.json"]
    assert len(list(backups.glob("*.json"))) == 2


@needs_uv
def test_activate_adopts_a_hand_made_venv_without_breaking_it(host, tmp_path):
    hand_made_venv(host["venv_path"], [("torch", "2.9.1+cu128")])
    new = Path(host["releases_dir"], "r-000000000001")
    subprocess.run([UV, "venv", "-q", "--python", HOST_PYTHON, str(new / "venv")], check=True)
    (new / "release.json").write_text(json.dumps({"status": "ok"}))
    code, result, err = run_tool("activate", {**host, "release": "r-000000000001", "by": "deploy",
                                              "adopt_as": "adopted-20260101T000000Z"})
    assert code == 0, err
    assert result == {"adopted": "adopted-20260101T000000Z", "previous": "adopted-20260101T000000Z",
                      "switched": True}
    assert os.readlink(host["venv_path"]) == str(new / "venv")
    adopted = Path(host["releases_dir"], "adopted-20260101T000000Z")
    record = json.loads((adopted / "release.json").read_text())
    assert record["adopted"] and record["packages"]["torch"] == "2.9.1+cu128"
    history = json.loads(Path(host["state_dir"], "releases.json").read_text())["activations"]
    assert [(h["release"], h["previous"], h["by"]) for h in history] == [
        ("adopted-20260101T000000Z", None, "adopt"),
        ("r-000000000001", "adopted-20260101T000000Z", "deploy")]
    # rolling back to the adopted venv: its python and packages work again through venv_path
    code, result, err = run_tool("activate", {**host, "release": "adopted-20260101T000000Z", "by": "rollback",
                                              "adopt_as": "adopted-x"})
    assert code == 0 and result["switched"], err
    out = subprocess.run([f"{host['venv_path']}/bin/python", "-c",
                          "import torch, sys; print(torch.__version__, sys.prefix)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2.9.1+cu128", host["venv_path"]]
    again = run_tool("activate", {**host, "release": "adopted-20260101T000000Z", "by": "rollback", "adopt_as": "x"})
    assert again[1] == {"adopted": None, "switched": False}


def test_activate_refuses_an_unchecked_release_and_changes_nothing(host):
    Path(host["releases_dir"], "r-000000000002", "venv").mkdir(parents=True)
    Path(host["releases_dir"], "r-000000000002", "release.json").write_text(json.dumps({"status": "failed"}))
    code, _, err = run_tool("activate", {**host, "release": "r-000000000002", "by": "deploy", "adopt_as": "a"})
    assert code == 1 and "servestack: release r-000000000002 is not a complete, checked release" in err
    assert not os.path.lexists(host["venv_path"])


def test_prune_never_removes_the_active_release(host):
    for name in ("r-00000000000a", "r-00000000000b"):
        Path(host["releases_dir"], name, "venv").mkdir(parents=True)
    os.symlink(os.path.join(host["releases_dir"], "r-00000000000a", "venv"), host["venv_path"])
    code, result, _ = run_tool("prune", {**host, "remove": ["r-00000000000a", "r-00000000000b"], "protect": []})
    assert code == 0 and result["removed"] == ["r-00000000000b"]
    assert os.path.isdir(os.path.join(host["releases_dir"], "r-00000000000a"))


# --- building against a loopback index --------------------------------------------------------

@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    venv_index.build_index(root)
    server, base = venv_index.serve(root)
    yield venv_index.StackIndex(root, base)
    server.shutdown()


def build_params(host, index, tmp_path, **data):
    settings = settings_from_data("local", {**index.host_data(), **data})
    python_version = subprocess.run([HOST_PYTHON, "-c", "import platform; print(platform.python_version())"],
                                    capture_output=True, text=True).stdout.strip()
    plan = release_plan(settings, "x86_64", python_version)
    plan = dataclasses.replace(plan, dir=f"{host['releases_dir']}/{plan.id}")
    return plan, {**host, "id": plan.id, "release_dir": plan.dir, "inputs": plan.inputs, "files": plan.files,
                  "steps": plan.steps, "bound": plan.bound, "expect": plan.expect,
                  "uv_version": load_manifest().uv["version"], "uv_index_url": "http://127.0.0.1:9/none",
                  "cache_dir": str(tmp_path / "uv-cache"), "python": HOST_PYTHON,
                  "unit_env": dict(service_environment(settings, plan, None, writable=plan.check_scratch))}


@needs_uv
def test_build_then_activate_turns_a_cu128_env_into_cu130(host, index, tmp_path):
    hand_made_venv(host["venv_path"], [("torch", "2.9.1+cu128"), ("torchvision", "0.24.1+cu128")])
    plan, params = build_params(host, index, tmp_path)
    code, result, err = run_tool("build", params)
    assert code == 0 and result == {"built": True}, err
    record = json.loads(Path(plan.dir, "release.json").read_text())
    assert record["status"] == "ok" and record["packages"]["torch"] == "2.9.1+cu130"
    assert record["packages"]["flashinfer-python"] == "0.6.4"  # the override beat sglang's 0.6.3 pin
    assert record["packages"]["nvidia-cudnn-cu13"] == "9.16.0.29"  # ... and torch's own 9.13.0.50 pin
    assert record["lock_sha256"] and Path(plan.dir, "lock.txt").exists()
    assert os.path.isdir(host["venv_path"]) and not os.path.islink(host["venv_path"])  # not switched yet
    assert run_tool("build", params)[1] == {"built": False, "reason": "already built"}
    code, result, err = run_tool("activate", {**params, "release": plan.id, "by": "deploy",
                                              "adopt_as": "adopted-20260101T000000Z"})
    assert code == 0, err
    out = subprocess.run([f"{host['venv_path']}/bin/python", "-c",
                          "import torch, flashinfer, sglang; "
                          "print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2.9.1+cu130", "13.0", "91600"]


@needs_uv
def test_a_mirror_serving_other_bytes_under_the_same_name_is_refused_by_the_stacks_fixed_hashes(host, index,
                                                                                               tmp_path):
    first, params = build_params(host, index, tmp_path)
    assert run_tool("build", params)[0] == 0
    code, lock, err = run_tool("lock", {"release_dir": first.dir})
    fixed = lock["packages"]
    assert code == 0 and fixed["torch"]["version"] == "2.9.1+cu130" and lock["problems"] == [], err
    root = tmp_path / "mirror"
    venv_index.build_index(root, other_torch_bytes=True)
    mirrored = next((root / "download.pytorch.org").rglob("torch-2.9.1+cu130-*.whl"))
    other = "sha256:" + hashlib.sha256(mirrored.read_bytes()).hexdigest()
    server, base = venv_index.serve(root)
    try:
        second, params = build_params(host, venv_index.StackIndex(root, base), tmp_path)
        refused = run_tool("build", {**params, "fixed": fixed, "fixed_path": "/srv/locks/sglang-0.5.9-py3.11.json"})
        installed = run_tool("build", params)   # what the mirror gets without the fixed hashes: its own bytes
    finally:
        server.shutdown()
    assert refused[0] == 1 and (
        "the resolution differs from the stack's hashes fixed in /srv/locks/sglang-0.5.9-py3.11.json (a mirror cannot "
        f"change what is installed): torch 2.9.1+cu130: the index lists a file it does not have ({other})"
    ) in refused[2]
    assert installed[0] == 0, installed[2]
    site = next(Path(second.dir, "venv", "lib").glob("python3*/site-packages"))
    assert (site / "torch" / "_served_by_a_mirror.py").exists()


@needs_uv
def test_a_broken_wheel_fails_the_build_and_leaves_the_old_env(host, tmp_path):
    root = tmp_path / "broken-index"
    venv_index.build_index(root, broken_torch="corrupt_zip")
    server, base = venv_index.serve(root)
    try:
        hand_made_venv(host["venv_path"], [("torch", "2.9.1+cu128")])
        plan, params = build_params(host, venv_index.StackIndex(root, base), tmp_path)
        code, _, err = run_tool("build", params)
    finally:
        server.shutdown()
    # The index serves no metadata beside its wheels, so uv opens the torch wheel while it resolves: the
    # build stops there, before any install step.
    resolving = "resolving the lock (uv pip compile) failed (exit 1): error: No solution found when resolving"
    assert code == 1 and f"servestack: release {plan.id} was not built and is not active" in err
    assert resolving in err and "install step" not in err, err
    log = Path(plan.dir, "build.log").read_text()
    assert "Because torch==2.9.1+cu130 has an invalid package format" in log, log
    assert "The structure of `torch` (v2.9.1+cu130) was invalid:\n  Failed to read from zip file" in log, log
    record = json.loads(Path(plan.dir, "release.json").read_text())
    assert record["status"] == "failed" and record["error"].startswith("resolving the lock (uv pip compile) failed")
    assert os.path.isdir(host["venv_path"]) and not os.path.islink(host["venv_path"])


@needs_uv
def test_a_failed_check_keeps_the_release_out(host, tmp_path):
    root = tmp_path / "lying-index"
    venv_index.build_index(root)
    torch_version = reference_stack().package("torch").version
    liar = WheelSpec("torch", torch_version, TORCH_TAG,
                     {"torch/__init__.py": f"__version__ = '{torch_version}'\nfrom torch import version\n",
                      "torch/version.py": "cuda = '12.8'\n"}, (), "a cu128 build labelled cu130")
    torch_dir = next(root.rglob("torch/index.html")).parent
    for old in torch_dir.glob("*.whl"):
        old.unlink()
    from sandbox.standins.index import write_simple_index
    write_simple_index(torch_dir.parent, [build_wheel(liar, tmp_path / "liar")])
    server, base = venv_index.serve(root)
    try:
        plan, params = build_params(host, venv_index.StackIndex(root, base), tmp_path)
        code, _, err = run_tool("build", params)
    finally:
        server.shutdown()
    assert code == 1 and "checks failed: torch.version.cuda is '12.8', expected '13.0'" in err
    assert json.loads(Path(plan.dir, "release.json").read_text())["status"] == "failed"
    assert not os.path.lexists(host["venv_path"])


def test_check_script_records_every_problem(tmp_path):
    expect = {"packages": {"pytest": "0.0.1", "no-such-package-xyz": "1"}, "torch_cuda": "13.0",
              "imports": ["no_such_module_xyz"]}
    record = tmp_path / "check.json"
    result = subprocess.run([sys.executable, str(CHECK), json.dumps(expect), str(record)], capture_output=True,
                            text=True)
    assert result.returncode == 1 and result.stdout == ""
    checked = json.loads(record.read_text())
    problems = checked["problems"]
    assert not checked["ok"] and checked["expected"] == expect
    assert any("pytest is " in p and "expected 0.0.1" in p for p in problems)
    assert any("no-such-package-xyz is not installed" in p for p in problems)
    assert any("import no_such_module_xyz failed" in p for p in problems)


def test_the_release_check_imports_with_the_units_environment_not_the_tools(tmp_path, monkeypatch):
    """flashinfer loads CUDA_LIB_PATH/libcudart.so.12 at import where it is there (0.6.12 flashinfer/jit/__init__.py
    L102-106): the check must import with the unit's CUDA_LIB_PATH, CUDA_HOME, PATH..., not the SSH session's."""
    settings = settings_from_data("local", {})
    plan = dataclasses.replace(release_plan(settings, "x86_64", platform.python_version()), dir=str(tmp_path))
    unit = dict(service_environment(settings, plan, None, writable=plan.check_scratch))
    site = tmp_path / "site"   # a module that records, at import, the environment it was imported with
    site.mkdir()
    (site / "sees_env.py").write_text(
        "import json, os\njson.dump(dict(os.environ), open(os.path.join(os.environ['SEEN_AT'], 'seen.json'), 'w'))\n")
    monkeypatch.setenv("CUDA_LIB_PATH", "/usr/local/cuda/lib64")   # the session's: the unit's wins
    monkeypatch.setenv("SESSION_ONLY", "1")
    params = {"release_dir": str(tmp_path), "unit_env": {**unit, "PYTHONPATH": str(site), "SEEN_AT": str(tmp_path)},
              "expect": {"packages": {}, "torch_cuda": "13.0", "imports": ["sees_env"]}}
    with open(tmp_path / "build.log", "w") as log, pytest.raises(ml_env.Failure) as failure:
        ml_env.check_release(sys.executable, params, log)   # no torch here: that check fails, the import runs
    assert str(failure.value).startswith("checks failed: import torch failed: ")
    seen = json.loads((tmp_path / "seen.json").read_text())
    for name in ("CUDA_HOME", "CUDA_PATH", "PATH", "LD_LIBRARY_PATH", "CUDA_LIB_PATH", "SERVESTACK_RELEASE"):
        assert seen[name] == unit[name]
    assert seen["CUDA_LIB_PATH"] == f"{settings.cuda_install_path}/lib64" and "SESSION_ONLY" not in seen
    # what its imports write lands in the release's scratch, never the service's caches or HOME
    assert seen["HOME"] == f"{tmp_path}/check-scratch/home" and seen["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    assert json.loads((tmp_path / ml_env.CHECK_RECORD).read_text())["environment"] == seen


def test_record_adds_a_switch_made_elsewhere_to_the_history(host):
    """The service's health gate records its rollback with this command (one writer of the
    history): appended after what is there, in the activations' own format."""
    os.makedirs(host["state_dir"])
    earlier = {"release": "r-0123456789ab", "previous": None, "by": "deploy", "at": "20260101T000000Z"}
    Path(host["state_dir"], ml_env.HISTORY).write_text(json.dumps({"activations": [earlier]}))
    rc, output, stderr = run_tool("record", {"state_dir": host["state_dir"], "release": "r-0123456789ab",
                                             "previous": "r-ba9876543210", "by": "service-rollback"})
    assert rc == 0, stderr
    assert output == {"recorded": "r-0123456789ab"}
    history = json.loads(Path(host["state_dir"], ml_env.HISTORY).read_text())["activations"]
    assert history[0] == earlier
    assert {key: history[1][key] for key in ("release", "previous", "by")} == {
        "release": "r-0123456789ab", "previous": "r-ba9876543210", "by": "service-rollback"}
    assert re.fullmatch(r"\d{8}T\d{6}Z", history[1]["at"])


def test_record_only_where_kept_leaves_a_host_without_a_history_without_one(host):
    """The gate's rollback on a host whose venv servestack never activated: nothing to tell."""
    params = {"state_dir": host["state_dir"], "release": "r-0123456789ab", "previous": "r-ba9876543210",
              "by": "service-rollback", "only_where_kept": True}
    rc, output, stderr = run_tool("record", params)
    assert (rc, output) == (0, {"recorded": None}), stderr
    assert not Path(host["state_dir"], ml_env.HISTORY).exists()
    os.makedirs(host["state_dir"])
    Path(host["state_dir"], ml_env.HISTORY).write_text(json.dumps({"activations": []}))
    rc, output, stderr = run_tool("record", params)
    assert (rc, output) == (0, {"recorded": "r-0123456789ab"}), stderr
    assert len(json.loads(Path(host["state_dir"], ml_env.HISTORY).read_text())["activations"]) == 1


def test_activate_refuses_a_directory_that_is_not_a_venv(host):
    os.makedirs(os.path.join(host["venv_path"], "data"))
    Path(host["releases_dir"], "r-000000000003", "venv").mkdir(parents=True)
    Path(host["releases_dir"], "r-000000000003", "venv", "pyvenv.cfg").write_text("home = /usr/bin\n")
    Path(host["releases_dir"], "r-000000000003", "release.json").write_text(json.dumps({"status": "ok"}))
    code, _, err = run_tool("activate", {**host, "release": "r-000000000003", "by": "deploy", "adopt_as": "a"})
    assert code == 1 and "exists but is not a venv" in err
    assert os.path.isdir(os.path.join(host["venv_path"], "data"))


# --- the MlEnvState fact and the venv operations, the tool run here ------------------------------
# A pretend host under tmp_path: venv_path links to release ACTIVE, OTHER is kept beside it; the
# fact's real command runs with `sh -c`, and the operations run through pyinfra's @fake connector
# with the tool's commands run here.

ACTIVE, OTHER = "r-0123456789ab", "r-ba9876543210"


def kept_release(root: Path, name: str) -> None:
    directory = root / "releases" / name
    (directory / "venv").mkdir(parents=True)
    (directory / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (directory / "release.json").write_text(json.dumps({"id": name, "status": "ok"}))


class PretendHost:
    def __init__(self, root: Path):
        self.root = root
        self.venv_path = root / "opt" / "ml-env"
        self.releases_dir = root / "releases"
        self.state_dir = root / "state"
        self.uv = root / "uv" / "bin" / "uv"
        for name in (ACTIVE, OTHER):
            kept_release(root, name)
        self.venv_path.parent.mkdir()
        self.venv_path.symlink_to(self.releases_dir / ACTIVE / "venv")
        (self.state_dir / "backups").mkdir(parents=True)
        (self.state_dir / "backups" / "20260101T000000Z.json").write_text(json.dumps({"release": OTHER}))
        (self.state_dir / "releases.json").write_text(json.dumps({"activations": [
            {"release": ACTIVE, "previous": OTHER, "by": "deploy", "at": "20260101T000000Z"}]}))
        fake_uv(self.uv, "echo 'uv 0.13.9 (abc 2026-01-01)'")
        self.env = {**os.environ, "PATH": f"{Path(HOST_PYTHON).parent}:/usr/bin:/bin"}

    def sh(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=self.env)

    def data(self) -> dict:
        return {"venv_path": str(self.venv_path), "venv_releases_dir": str(self.releases_dir),
                "servestack_state_dir": str(self.state_dir), "uv_install_dir": str(self.uv.parent.parent),
                "venv_python": Path(HOST_PYTHON).name}

    def read(self, **overrides) -> dict | None:
        """The fact's value, as pyinfra reads it, with the arguments the operations pass."""
        arguments = {**mlenv_fact_arguments(settings_from_data("local", self.data())), **overrides}
        fact = MlEnvState()
        result = self.sh(fact.command(**arguments))
        assert result.returncode == 0, result.stderr
        return fact.process(result.stdout.splitlines())


@pytest.fixture
def pretend(tmp_path) -> PretendHost:
    return PretendHost(tmp_path)


def test_the_fact_reads_the_pretend_host(pretend):
    state = pretend.read()
    assert state["venv_path"]["release"] == ACTIVE and state["releases"].keys() == {ACTIVE, OTHER}
    assert state["backups"] == ["20260101T000000Z.json"] and state["history"][0]["previous"] == OTHER


def test_the_fact_is_none_on_a_host_without_the_python(pretend):
    assert pretend.read(python="no-such-python3") is None


def _add_release(host: PretendHost) -> None:
    kept_release(host.root, "r-aaaaaaaaaaaa")


def _remove_release(host: PretendHost) -> None:
    shutil.rmtree(host.releases_dir / OTHER)


def _rewrite_a_record(host: PretendHost) -> None:
    record = host.releases_dir / OTHER / "release.json"
    record.write_text(record.read_text().replace('"ok"', '"failed"'))


def _repoint_the_link(host: PretendHost) -> None:
    temporary = host.venv_path.with_name("ml-env.new")
    temporary.symlink_to(host.releases_dir / OTHER / "venv")
    os.replace(temporary, host.venv_path)


def _add_a_backup(host: PretendHost) -> None:
    (host.state_dir / "backups" / "20260102T000000Z.json").write_text(json.dumps({"release": ACTIVE}))


def _rewrite_the_history(host: PretendHost) -> None:
    (host.state_dir / "releases.json").write_text(json.dumps({"activations": []}))


def _remove_a_venv(host: PretendHost) -> None:
    (host.releases_dir / OTHER / "venv" / "pyvenv.cfg").unlink()


@pytest.mark.parametrize("change, seen", [
    (_add_release, lambda value: "r-aaaaaaaaaaaa" in value["releases"]),
    (_remove_release, lambda value: OTHER not in value["releases"]),
    (_rewrite_a_record, lambda value: value["releases"][OTHER]["status"] == "failed"),
    (_repoint_the_link, lambda value: value["venv_path"]["release"] == OTHER),
    (_add_a_backup, lambda value: value["backups"][-1] == "20260102T000000Z.json"),
    (_rewrite_the_history, lambda value: value["history"] == []),
    (_remove_a_venv, lambda value: value["releases"][OTHER]["has_venv"] is False),
])
def test_the_fact_sees_every_change_to_what_the_state_is_read_from(pretend, change, seen):
    pretend.read()
    change(pretend)
    assert seen(pretend.read())


@pytest.fixture
def run_on_pretend(monkeypatch, pretend):
    """The @fake connector, but the tool's commands (params: base64) really run on the pretend host."""
    run_here(monkeypatch, lambda command: "def command_packages(params)" in command or "ml-env-state.sh" in command,
             pretend.sh)


def fake_host_of(state):
    return state.inventory.get_host("@fake/gpu1")


def test_activating_the_active_release_changes_nothing_in_either_stage(pretend, run_on_pretend):
    dry = fake_state(pretend.data())
    add_op(dry, activate_release, release=ACTIVE)
    assert dry.get_meta_for_host(fake_host_of(dry)).ops_no_change == 1

    converged = fake_state(pretend.data())
    add_op(converged, activate_release, release=ACTIVE)
    run_ops(converged)
    assert converged.get_meta_for_host(fake_host_of(converged)).ops_change == 0
    assert os.readlink(pretend.venv_path) == str(pretend.releases_dir / ACTIVE / "venv")


def test_an_operation_reads_the_host_again_after_another_changed_it(pretend, run_on_pretend):
    state = fake_state(pretend.data(), check_for_changes=False)  # pyinfra -y: operations run at execute
    target = fake_host_of(state)
    first = add_op(state, activate_release, release=OTHER)[target]
    second = add_op(state, activate_release, release=OTHER)[target]  # reads the first one's switch
    run_ops(state)
    assert os.readlink(pretend.venv_path) == str(pretend.releases_dir / OTHER / "venv")
    assert (first.did_change(), second.did_change()) == (True, False)
    history = json.loads((pretend.state_dir / "releases.json").read_text())["activations"]
    assert [(entry["release"], entry["previous"]) for entry in history[1:]] == [(OTHER, ACTIVE)]


def test_host_reads_lists_what_the_operations_read_with_the_same_arguments(pretend, run_on_pretend, monkeypatch):
    keys = read_keys(monkeypatch)
    state = fake_state(pretend.data())  # converged: every operation decides from the listed read
    add_deploy(state, venv_step.backup, release_at(str(pretend.releases_dir), ACTIVE))
    add_deploy(state, venv_step.activate, release_at(str(pretend.releases_dir), ACTIVE))
    target = fake_host_of(state)
    listed = {request.key for request in venv_step.host_reads(host_settings(target))}
    assert keys and set(keys) == listed


def test_rollback_target_refuses_a_host_with_nothing_to_roll_back_to_naming_what_is_kept(
        pretend, run_on_pretend, caplog):
    (pretend.state_dir / "releases.json").write_text(json.dumps({"activations": []}))
    state = fake_state({**pretend.data()})
    state.inventory.get_host("@fake/gpu1")
    with pytest.raises(PyinfraError, match="No hosts remaining"), ctx_state.use(state), \
            ctx_host.use(fake_host_of(state)):
        venv_step.rollback_target()
    assert fake_host_of(state) in state.failed_hosts
    assert f"refused: nothing to roll back to: no release was active before the last deploy (active: {ACTIVE}; " \
           f"kept releases: {ACTIVE}, {OTHER})" in caplog.text


def test_rollback_target_is_the_release_before_the_last_deploy(pretend, run_on_pretend):
    state = fake_state(pretend.data())
    with ctx_state.use(state), ctx_host.use(fake_host_of(state)):
        assert venv_step.rollback_target() == release_at(str(pretend.releases_dir), OTHER)
        planned = venv_step.plan()
        assert venv_step.active_release(host_settings(fake_host_of(state))).id == ACTIVE
    assert planned.python.startswith(str(pretend.releases_dir) + "/r-") and planned.inputs["arch"] == platform.machine()


def test_a_release_directory_is_built_by_one_process_at_a_time(host, tmp_path):
    """While one build holds the release's guard (here: a process holding its flock), a second
    build of the same release fails naming the holder, and writes nothing into the directory."""
    plan, params = build_params(host, venv_index.StackIndex(tmp_path / "unused", "http://127.0.0.1:9"), tmp_path)
    guard = Path(plan.dir).parent / ".build-guard"
    guard.parent.mkdir(parents=True)
    guard.write_text("release r-other, pid 4242, since 20261201T000000Z\n")
    with flock_held(guard):
        code, _, err = run_tool("build", params)
    assert code == 1
    assert (f"servestack: release {plan.id} cannot be built now: another build holds {guard} "
            "(release r-other, pid 4242, since 20261201T000000Z)") in err
    assert not os.path.exists(plan.dir)


def test_a_build_goes_on_when_the_run_that_started_it_is_gone():
    """The run's connection closed (its controller was killed): progress lines and the result go
    nowhere, and the build is not stopped by a broken pipe (files/scripts/busy.sh keeps it running)."""
    code = ("import importlib.util, signal, sys\n"
            "signal.signal(signal.SIGPIPE, signal.SIG_IGN)\n"
            f"spec = importlib.util.spec_from_file_location('ml_env', {str(TOOL)!r})\n"
            "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
            "for n in range(3): tool.progress('step %d' % n)\n"
            "tool.write_out('{}\\n')\n"
            "print('went on', file=sys.stderr)\n")
    read, write = os.pipe()
    os.close(read)  # nobody reads what the build prints any more
    try:
        result = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert result.returncode == 0 and result.stderr.strip() == "went on", result.stderr
