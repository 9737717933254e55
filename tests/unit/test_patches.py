"""SGLang source patches: the patch files against the real wheels, the engine's states, the
behavioural checks, and the fact/operation pipeline run against throwaway venvs.

The sglang 0.5.9 and 0.5.10 wheels are downloaded once into the sandbox cache
(SERVESTACK_SANDBOX_CACHE, default /var/cache/servestack/sandbox) under wheels/. Only the
patched modules and the dist-info are extracted. Hosts are stood in for by temp venvs
(`python -m venv --without-pip`) holding those files: importlib.metadata in the venv's python
sees sglang at that version, exactly as on a host. Nothing outside tmp_path is modified.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, State, StringCommand
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.deploy import add_deploy
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.connectors.util import make_unix_command

from facts.framing import Section, printed, split
from facts.patches import SCRIPT, SUMS_HOLD, PatchStates, engine_source, remote_command, set_digests
from operations.patches import patches as patches_deploy
from operations.patches import sglang_patches
from sandbox.rootfs import cache_dir
from servestack import patchlib
from servestack.patchsets import PATCH_ROOT, load_patch_sets
from servestack.scripts import script_command
from tests.unit.fake_host import fake_state, run_here

ROOT = Path(__file__).resolve().parents[2]
SET = load_patch_sets("sglang")["0.5.9"]
PATCHES = [tuple(p) for p in SET["patches"]]
CHECKS = patchlib.load_checks(SET["checks"], "sglang_0_5_9_checks")
SM120, KIMI = (name for name, _ in PATCHES)
TARGETS = sorted({s.path for _, text in PATCHES for s in patchlib.parse_patch(text)})
ALL_REDUCE_UTILS = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
TORCH_SYMM_MEM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
KIMI_K25 = "sglang/srt/models/kimi_k25.py"


# --- fixtures ------------------------------------------------------------------------


def sglang_wheel(version: str) -> Path:
    """The real sglang wheel, downloaded once into the sandbox cache."""
    wheels = cache_dir() / "wheels"
    wheel = wheels / f"sglang-{version}-py3-none-any.whl"
    if not wheel.is_file():
        # servestack.sh puts pip in .tools/ (it installs uv with it); else the system's pip.
        tools_pip = ROOT / ".tools" / "bin" / "pip"
        pip = str(tools_pip) if tools_pip.is_file() else shutil.which("pip3") or shutil.which("pip")
        assert pip, f"no pip to download {wheel.name}; put it in {wheels}"
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([pip, "download", "--no-deps", f"sglang=={version}", "-d", str(wheels)],
                       check=True, capture_output=True)
    return wheel


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """version -> a directory holding the wheel's patched modules and its dist-info."""
    trees = {}

    def get(version: str) -> Path:
        if version not in trees:
            tree = tmp_path_factory.mktemp(f"sglang-{version}")
            dist_info = f"sglang-{version}.dist-info/"
            with zipfile.ZipFile(sglang_wheel(version)) as wheel:
                for name in TARGETS + [dist_info + "METADATA", dist_info + "RECORD"]:
                    wheel.extract(name, tree)
            trees[version] = tree
        return trees[version]

    return get


class Env:
    """A throwaway venv standing in for a host's release environment."""

    def __init__(self, root: Path):
        self.root = root
        self.python = str(root / "bin" / "python")
        self.site_packages = Path(
            subprocess.check_output([self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    text=True).strip()
        )
        self.record = root / patchlib.RECORD_NAME

    def file(self, path: str) -> Path:
        return self.site_packages / path

    def snapshot(self) -> dict:
        return {p: p.read_bytes() for p in sorted(self.root.rglob("*")) if p.is_file()}


@pytest.fixture
def make_env(tmp_path, pristine):
    """make_env(version or None) -> Env with that sglang (None: no sglang installed)."""
    counter = itertools.count()

    def make(version: str | None) -> Env:
        root = tmp_path / f"env{next(counter)}"
        venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
        env = Env(root)
        if version:
            shutil.copytree(pristine(version), env.site_packages, dirs_exist_ok=True)
        return env

    return make


def sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True)


def answer(stdout: str) -> dict:
    """What the patch engine printed: its section patchlib.RESULT."""
    return json.loads(split(stdout.splitlines())[patchlib.RESULT].text)


def fact_output(env: Env) -> dict:
    """Run the fact's command against env and process its output, as pyinfra would."""
    fact = PatchStates()
    result = sh(fact.command(python=env.python))
    assert result.returncode == 0, result.stderr
    return fact.process(result.stdout.splitlines())


def states(results) -> dict:
    return {r.name: r.state for r in results}


def patched_sources(version_tree: Path) -> dict:
    """path -> text of every target after applying the whole set in memory."""
    results = patchlib.evaluate_set(version_tree, PATCHES, CHECKS)
    return {f.path: f.after for r in results for f in r.files}


# --- the patch files against the real wheels -----------------------------------------


@pytest.mark.parametrize("name", [name for name, _ in PATCHES])
def test_each_patch_applies_cleanly_to_sglang_0_5_9_and_compiles(name, make_env):
    text = dict(PATCHES)[name]
    assert text.startswith("From ") and "\nSubject: [PATCH" in text
    env = make_env("0.5.9")

    [result] = patchlib.evaluate_set(env.site_packages, [(name, text)], CHECKS)
    assert (result.state, result.check) == ("applicable", "ok")
    if shutil.which("patch"):  # second opinion only; the engine is the authority
        dry = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(env.site_packages)], input=text,
                             capture_output=True, text=True)
        assert dry.returncode == 0 and "fuzz" not in dry.stdout and "offset" not in dry.stdout, dry.stdout

    patchlib.apply_set(env.site_packages, [(name, text)], CHECKS, "sglang", "0.5.9", env.record)
    for f in result.files:
        cache = env.file(f.path).parent / "__pycache__"
        assert list(cache.glob(Path(f.path).stem + ".*.pyc"))


def test_record_hashes_match_the_wheel_and_the_patched_files(make_env):
    env = make_env("0.5.9")
    patchlib.apply_set(env.site_packages, PATCHES, CHECKS, "sglang", "0.5.9", env.record)

    wheel_record = (env.site_packages / "sglang-0.5.9.dist-info" / "RECORD").read_text().splitlines()
    wheel_sha = {line.split(",")[0]: line.split(",")[1].removeprefix("sha256=") for line in wheel_record}
    record = json.loads(env.record.read_text())
    assert (record["package"], record["version"]) == ("sglang", "0.5.9")
    for entry, (name, _) in zip(record["patches"], PATCHES):
        assert entry["name"] == name and entry["state"] == "applied"
        patch = PATCH_ROOT / "sglang/0.5.9" / f"{name}.patch"
        assert entry["sha256"] == hashlib.sha256(patch.read_bytes()).hexdigest()
        for f in entry["files"]:
            before = base64.urlsafe_b64encode(bytes.fromhex(f["sha256_before"])).rstrip(b"=").decode()
            assert before == wheel_sha[f["path"]]
            assert f["sha256"] == hashlib.sha256(env.file(f["path"]).read_bytes()).hexdigest()


# --- engine states -------------------------------------------------------------------


def test_pristine_is_applicable_then_applied_and_a_second_apply_changes_nothing(make_env):
    env = make_env("0.5.9")
    before = patchlib.evaluate_set(env.site_packages, PATCHES, CHECKS)
    assert states(before) == {SM120: "applicable", KIMI: "applicable"}
    assert "+    12: {" in before[0].diff() and "+    def set_embed_and_head" in before[1].diff()

    patchlib.apply_set(env.site_packages, PATCHES, CHECKS, "sglang", "0.5.9", env.record)
    after = patchlib.evaluate_set(env.site_packages, PATCHES, CHECKS)
    assert states(after) == {SM120: "applied", KIMI: "applied"}
    assert all(r.check == "ok" for r in after)
    expected = patchlib.make_record("sglang", "0.5.9", after)
    assert patchlib.record_status(env.record, expected) == "current"

    snapshot = env.snapshot()
    patchlib.apply_set(env.site_packages, PATCHES, CHECKS, "sglang", "0.5.9", env.record)
    assert {p: b for p, b in env.snapshot().items() if p.suffix != ".pyc"} == {
        p: b for p, b in snapshot.items() if p.suffix != ".pyc"
    }


def test_sglang_0_5_10_has_the_kimi_change_upstream_but_still_needs_sm120(pristine):
    tree = pristine("0.5.10")
    results = patchlib.evaluate_set(tree, PATCHES, CHECKS)
    assert states(results) == {SM120: "applicable", KIMI: "upstream"}
    assert all(r.check == "ok" for r in results)  # 0.5.10's own Kimi methods pass the Kimi check

    if shutil.which("patch"):  # why the engine does not trust GNU patch: fuzz would add them twice
        dry = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(tree)], input=dict(PATCHES)[KIMI],
                             capture_output=True, text=True)
        assert dry.returncode == 0 and "fuzz" in dry.stdout


def test_a_changed_target_refuses_the_whole_set_and_modifies_nothing(make_env):
    env = make_env("0.5.9")
    target = env.file(TORCH_SYMM_MEM)
    target.write_text(target.read_text().replace("if self.device_capability < 9:", "if self.device_capability < 8:"))
    snapshot = env.snapshot()

    results = patchlib.evaluate_set(env.site_packages, PATCHES, CHECKS)
    assert states(results) == {SM120: "conflict", KIMI: "applicable"}
    conflict = results[0].conflict
    assert (conflict["path"], conflict["hunk"], conflict["header"]) == (
        TORCH_SYMM_MEM, 1, "@@ -71,7 +71,7 @@ class TorchSymmMemCommunicator:")
    assert "line 74" in conflict["reason"] and "< 8" in conflict["reason"]

    with pytest.raises(patchlib.PatchError, match=rf"{SM120}: conflict in {TORCH_SYMM_MEM} hunk #1 \(@@ -71,7"):
        patchlib.apply_set(env.site_packages, PATCHES, CHECKS, "sglang", "0.5.9", env.record)
    assert env.snapshot() == snapshot


def test_a_partially_applied_patch_is_a_conflict(make_env):
    env = make_env("0.5.9")
    [sm120] = patchlib.evaluate_set(env.site_packages, PATCHES[:1], CHECKS)
    symm = next(f for f in sm120.files if f.path == TORCH_SYMM_MEM)
    first_hunk_only = symm.before.replace("if self.device_capability < 9:",
                                          "if self.device_capability not in TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES:")
    env.file(TORCH_SYMM_MEM).write_text(first_hunk_only)

    [result] = patchlib.evaluate_set(env.site_packages, PATCHES[:1], CHECKS)
    assert result.state == "conflict"
    assert (result.conflict["path"], result.conflict["hunk"]) == (TORCH_SYMM_MEM, 2)
    assert "partially applied: hunk #1 is present, hunk #2 is not" in result.conflict["reason"]

    env.file(TORCH_SYMM_MEM).write_text(symm.after)  # this file patched, all_reduce_utils not
    [result] = patchlib.evaluate_set(env.site_packages, PATCHES[:1], CHECKS)
    assert (result.state, result.conflict["path"], result.conflict["hunk"]) == ("conflict", ALL_REDUCE_UTILS, 1)


def test_a_missing_target_is_a_conflict(make_env):
    env = make_env("0.5.9")
    env.file(KIMI_K25).unlink()
    results = patchlib.evaluate_set(env.site_packages, PATCHES, CHECKS)
    assert results[1].conflict == {"path": KIMI_K25, "hunk": None, "header": None, "reason": "file not found"}
    assert "conflict in sglang/srt/models/kimi_k25.py: file not found" in patchlib.refusal(
        [r.as_dict() for r in results])


@pytest.mark.parametrize("text, message", [
    ("no diff here\n", "no '--- '/'+++ ' file section"),
    ("--- /dev/null\n+++ b/x.py\n@@ -0,0 +1 @@\n+x\n", "creating or deleting files"),
    ("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "inside site-packages"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-a\n+b\n", "truncated"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n\\ No newline at end of file\n+b\n", "unsupported line"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1,0 +2 @@\n+b\n", "no context lines"),
])
def test_malformed_or_unsupported_patches_are_refused(text, message):
    with pytest.raises(patchlib.PatchFormatError, match=re.escape(message)):
        patchlib.parse_patch(text)


def test_a_failed_rename_restores_every_file(tmp_path, monkeypatch):
    files = {tmp_path / name: name.encode() for name in ("a", "b", "c")}
    for path, data in files.items():
        path.write_bytes(data)
    real_replace, calls = patchlib.os.replace, []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(patchlib.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk full"):
        patchlib.replace_all({path: b"new " + data for path, data in files.items()})
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == files  # restored, no temp left


# --- behavioural checks --------------------------------------------------------------


def test_sm120_check_passes_on_the_patched_sources_only(pristine):
    tree = pristine("0.5.9")
    patched = patched_sources(tree)
    CHECKS[SM120](patched)

    original = {path: (tree / path).read_text() for path in TARGETS}
    with pytest.raises(Exception, match="no entry for capability 12"):
        CHECKS[SM120](original)
    with pytest.raises(KeyError):  # the new table alone: an unknown capability still raises
        CHECKS[SM120]({**patched, TORCH_SYMM_MEM: original[TORCH_SYMM_MEM]})


def test_kimi_check_passes_on_the_patched_sources_and_on_0_5_10(pristine):
    CHECKS[KIMI](patched_sources(pristine("0.5.9")))
    CHECKS[KIMI]({KIMI_K25: (pristine("0.5.10") / KIMI_K25).read_text()})
    with pytest.raises(Exception, match="has no get_embed_and_head"):
        CHECKS[KIMI]({KIMI_K25: (pristine("0.5.9") / KIMI_K25).read_text()})


# --- the fact and the operation ------------------------------------------------------


def test_fact_reports_each_patch_and_the_record(make_env):
    env = make_env("0.5.9")
    status = fact_output(env)
    assert status["installed"] and status["version"] == status["patch_set"] == "0.5.9"
    assert Path(status["site_packages"]) == env.site_packages.resolve()
    assert [(p["name"], p["state"], p["check"]) for p in status["patches"]] == [
        (SM120, "applicable", "ok"), (KIMI, "applicable", "ok")]
    assert (status["record_path"], status["record"]) == (str(env.record), "missing")


def test_fact_without_sglang_or_without_python(make_env, tmp_path):
    env = make_env(None)
    assert fact_output(env) == {"python": env.python, "package": "sglang", "installed": False}

    fact = PatchStates()
    absent = sh(fact.command(python=str(tmp_path / "nowhere/bin/python")))
    assert absent.returncode == 0
    assert fact.process(absent.stdout.splitlines())["python_missing"] is True


def test_fact_command_survives_pyinfra_shell_wrapping(make_env):
    env = make_env("0.5.9")
    command = StringCommand(PatchStates().command(python=env.python))
    wrapped = make_unix_command(command, _shell_executable="sh").get_raw_value()  # as sent over SSH
    result = subprocess.run(["bash", "-c", wrapped], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [p["state"] for p in answer(result.stdout)["patches"]] == ["applicable", "applicable"]


def test_remote_command_stays_small():
    # sshd hands the command to the login shell as one argument: Linux caps that at 128 KiB.
    assert len(remote_command("/opt/ml-env/bin/python", "apply", "sglang", None, PATCH_ROOT)) < 64 * 1024


def make_state(data: dict, diff: bool = False) -> State:
    return fake_state(data, Config(DIFF=diff))


@pytest.fixture
def run_locally(monkeypatch, tmp_path):
    """The @fake connector, but servestack's patch commands aimed at tmp_path really run."""
    def ours(command: str) -> bool:
        patches = "# servestack patches:" in command or ".sha256" in command  # the check, apply, the sums
        return patches and str(tmp_path) in command

    run_here(monkeypatch, ours, sh)


def host_ops(state: State):
    host = state.inventory.get_host("@fake/gpu1")
    return host, state.get_meta_for_host(host)


def test_the_check_names_the_digest_of_the_record_the_apply_writes(make_env):
    """What the service step's unit carries (SERVESTACK_PATCHSET) before the patches step runs."""
    env = make_env("0.5.9")
    predicted = fact_output(env)["record_sha256"]
    assert sh(remote_command(env.python, "apply", "sglang", str(env.record), PATCH_ROOT)).returncode == 0
    assert hashlib.sha256(env.record.read_bytes()).hexdigest() == predicted
    env.record.unlink()   # deleted by hand: rewritten as it was
    again = fact_output(env)
    assert (again["record"], again["record_sha256"]) == ("missing", predicted)


def test_operation_applies_once_then_is_a_noop(make_env, run_locally, caplog):
    env = make_env("0.5.9")
    caplog.set_level(logging.DEBUG, logger="pyinfra")

    state = make_state({}, diff=True)
    add_op(state, sglang_patches, python=env.python, record_path=str(env.record))
    _, meta = host_ops(state)
    assert meta.ops_change == 1 and not env.record.exists()  # prepare changed nothing
    assert "+    12: {" in caplog.text and "+    def get_embed_and_head" in caplog.text

    run_ops(state)
    assert fact_output(env)["record"] == "current"
    assert [p["state"] for p in fact_output(env)["patches"]] == ["applied", "applied"]
    assert json.loads(env.record.read_text())["patches"][0]["name"] == SM120

    caplog.clear()
    again = make_state({})
    add_op(again, sglang_patches, python=env.python, record_path=str(env.record))
    _, meta = host_ops(again)
    assert (meta.ops_change, meta.ops_no_change) == (0, 1)
    assert f"noop: sglang 0.5.9 patches: all in place ({SM120} applied, {KIMI} applied)" in caplog.text


def test_operation_refuses_a_conflict_before_changing_anything(make_env, run_locally, caplog):
    env = make_env("0.5.9")
    target = env.file(KIMI_K25)
    target.write_text(target.read_text().replace("self.language_model.load_weights(language_weights)",
                                                 "self.language_model.load_weights(list(language_weights))"))
    snapshot = env.snapshot()
    state = make_state({})
    with pytest.raises(PyinfraError, match="No hosts remaining"):  # refused at prepare, the only host
        add_op(state, sglang_patches, python=env.python)
    assert host_ops(state)[0] in state.failed_hosts
    assert re.search(rf"refused, no file changed: {KIMI}: conflict in {KIMI_K25} hunk #1 ", caplog.text)
    assert env.snapshot() == snapshot


def test_operation_on_0_5_10_applies_sm120_and_reports_kimi_upstream(make_env, run_locally, caplog):
    env = make_env("0.5.10")
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state({})
    add_op(state, sglang_patches, python=env.python, record_path=str(env.record))
    assert host_ops(state)[1].ops_change == 1
    run_ops(state)
    assert [p["state"] for p in fact_output(env)["patches"]] == ["applied", "upstream"]

    caplog.clear()
    again = make_state({})
    add_op(again, sglang_patches, python=env.python, record_path=str(env.record))
    assert host_ops(again)[1].ops_change == 0
    assert f"sglang 0.5.10 patches: all in place ({SM120} applied, {KIMI} upstream)" in caplog.text


def test_operation_on_a_version_without_a_set_says_so(make_env, run_locally, caplog, tmp_path):
    env = make_env("0.5.10")
    only_0_5_9 = tmp_path / "patches"
    (only_0_5_9 / "sglang").mkdir(parents=True)
    shutil.copytree(PATCH_ROOT / "sglang" / "0.5.9", only_0_5_9 / "sglang" / "0.5.9")
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state({})
    add_op(state, sglang_patches, python=env.python, patch_root=str(only_0_5_9))
    assert host_ops(state)[1].ops_change == 0
    assert "no patch set for sglang 0.5.10, nothing to apply" in caplog.text


def test_dry_run_of_an_unbuilt_release_predicts_the_set_with_its_diffs_then_fails_if_still_absent(
        make_env, run_locally, caplog):
    env = make_env(None)
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state({}, diff=True)
    add_op(state, sglang_patches, python=env.python)
    assert host_ops(state)[1].ops_change == 1
    assert f"will apply {SM120}, {KIMI} for sglang 0.5.9" in caplog.text
    assert "+    12: {" in caplog.text and "+    def get_embed_and_head" in caplog.text
    with pytest.raises(PyinfraError, match="No hosts remaining"):  # refused at execute, the only host
        run_ops(state)
    assert f"refused: sglang patches: sglang is not installed in {env.python}" in caplog.text


def test_deploy_patches_the_release_the_venv_step_plans(make_env, run_locally):
    env = make_env("0.5.9")
    release = SimpleNamespace(id="r-0123456789ab", dir=str(env.root / "release"), python=env.python)
    state = make_state({})
    add_deploy(state, patches_deploy, release)
    host, meta = host_ops(state)
    assert meta.ops_change == 1
    assert f"PYTHON={env.python} " in host.connector.executed_commands[0]
    assert f"RECORD={env.root}/release/patches.json " in host.connector.executed_commands[0]


# --- the sums of a set in place ------------------------------------------------------------


def checked(env: Env, patch_root=PATCH_ROOT) -> dict:
    """The fact as the deploy reads it (with the release's record path): from the record when its sums
    hold (`verified: sums`), else from the environment's python (with the sums to keep, once in place)."""
    fact = PatchStates()
    result = sh(fact.command(python=env.python, record_path=str(env.record), patch_root=str(patch_root)))
    assert result.returncode == 0, result.stderr
    return fact.process(result.stdout.splitlines())


def sums_file(env: Env) -> Path:
    return Path(patchlib.sums_path(str(env.record)))


def applied(env: Env) -> dict:
    """Apply the set as the operation does (which writes its sums); the check's answer afterwards."""
    assert sh(remote_command(env.python, "apply", "sglang", str(env.record), PATCH_ROOT)).returncode == 0
    assert sums_file(env).is_file()
    return checked(env)


def test_applying_leaves_sums_that_answer_the_check_without_python(make_env):
    env = make_env("0.5.9")
    answer = applied(env)
    assert answer["verified"] == "sums" and "sums" not in answer
    assert [(p["name"], p["state"], p["check"]) for p in answer["patches"]] == [(SM120, "applied", "ok"),
                                                                                 (KIMI, "applied", "ok")]
    assert (answer["version"], answer["record"], answer["record_path"]) == ("0.5.9", "current", str(env.record))
    assert patchlib.refusal(answer["patches"]) is None
    full = checked_by_python(env)
    assert [(p["name"], p["state"]) for p in full["patches"]] == [(p["name"], p["state"]) for p in answer["patches"]]


def checked_by_python(env: Env) -> dict:
    command = remote_command(env.python, "check", "sglang", str(env.record), PATCH_ROOT, quick=False)
    return answer(sh(command).stdout)


def test_the_sums_name_every_file_the_check_read(make_env):
    env = make_env("0.5.9")
    applied(env)
    lines = sums_file(env).read_text().splitlines()
    digests = set_digests(load_patch_sets("sglang"), engine_source())
    assert lines[0] in {f"{patchlib.SUMS_HEADER} {digest}" for digest in digests.values()}
    named = {line.split("  ", 1)[1] for line in lines[1:]}
    entry = env.site_packages  # as sys.path names it, links not resolved
    assert named == {str(env.record), str(entry / "sglang-0.5.9.dist-info" / "METADATA")} | {
        str(entry / path) for path in TARGETS}
    assert sh(f"tail -n +2 {sums_file(env)} | sha256sum -c --strict --status").returncode == 0


def _revert_target(env: Env, pristine) -> None:
    shutil.copyfile(pristine("0.5.9") / KIMI_K25, env.file(KIMI_K25))


def _edit_target(env: Env, pristine) -> None:
    env.file(TORCH_SYMM_MEM).write_text(env.file(TORCH_SYMM_MEM).read_text() + "# a local edit\n")


def _rewrite_record(env: Env, pristine) -> None:
    env.record.write_text(env.record.read_text().replace('"applied"', '"upstream"', 1))


def _another_version(env: Env, pristine) -> None:
    metadata = env.site_packages / "sglang-0.5.9.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.9", "Version: 0.5.9.post1", 1))


def _remove_target(env: Env, pristine) -> None:
    env.file(KIMI_K25).unlink()


@pytest.mark.parametrize("change, expected", [
    (_revert_target, (["applied", "applicable"], "current")),
    (_edit_target, (["applied", "applied"], "stale")),
    (_rewrite_record, (["applied", "applied"], "stale")),
    (_another_version, ([], None)),
    (_remove_target, (["applied", "conflict"], "stale")),
])
def test_any_change_to_a_file_the_check_read_makes_python_check_again(make_env, pristine, change, expected):
    env = make_env("0.5.9")
    applied(env)
    change(env, pristine)
    again = checked(env)
    assert "verified" not in again  # python ran
    assert ([p["state"] for p in again["patches"]], again["record"]) == expected


def _touch_target(env: Env, pristine) -> None:
    env.file(TORCH_SYMM_MEM).write_bytes(env.file(TORCH_SYMM_MEM).read_bytes())  # same bytes, new ctime


def _add_a_pth_file(env: Env, pristine) -> None:
    (env.site_packages / "elsewhere.pth").write_text("/nonexistent\n")  # after site-packages on sys.path


def _reinstall_metadata(env: Env, pristine) -> None:
    metadata = env.site_packages / "sglang-0.5.9.dist-info" / "METADATA"
    text = metadata.read_text()
    metadata.unlink()
    metadata.write_text(text)


@pytest.mark.parametrize("change", [_touch_target, _add_a_pth_file, _reinstall_metadata])
def test_what_leaves_every_file_as_it_was_keeps_the_sums_holding(make_env, pristine, change):
    env = make_env("0.5.9")
    answer = applied(env)
    change(env, pristine)
    assert checked(env) == answer


def test_sums_of_other_patch_sets_or_engine_are_not_used(make_env, tmp_path):
    env = make_env("0.5.9")
    applied(env)
    other_root = tmp_path / "patches"
    shutil.copytree(PATCH_ROOT, other_root)
    checks_file = other_root / "sglang" / "0.5.9" / "checks.py"
    checks_file.write_text(checks_file.read_text() + "\n# another servestack version\n")
    again = checked(env, patch_root=other_root)
    assert "verified" not in again and again["record"] == "current" and again["sums"]


def test_verification_runs_the_full_check(make_env):
    env = make_env("0.5.9")
    applied(env)
    assert "verified" not in checked_by_python(env)


def test_a_set_in_place_without_sums_gets_them_from_the_operation_never_in_a_dry_run(make_env, run_locally):
    env = make_env("0.5.9")
    state = make_state({})
    add_op(state, sglang_patches, python=env.python, record_path=str(env.record))
    run_ops(state)
    sums_file(env).unlink()  # e.g. a release patched by an older servestack

    dry = make_state({})
    add_op(dry, sglang_patches, python=env.python, record_path=str(env.record))
    assert not sums_file(env).exists()  # prepare (and so --dry) writes nothing

    converged = make_state({})
    add_op(converged, sglang_patches, python=env.python, record_path=str(env.record))
    run_ops(converged)
    assert host_ops(converged)[1].ops_change == 0
    assert checked(env)["verified"] == "sums"


# --- files/scripts/patch-check.sh --------------------------------------------------------------


def patch_check(tmp_path: Path, sums: str | None, python: str | None = None, headers: str = "h 1") -> dict:
    """Run the script with bash against files under tmp_path; a stand-in python notes its start and
    prints its input, the engine's section."""
    if python is None:
        python = str(tmp_path / "python")
        Path(python).write_text(f"#!/bin/sh\necho started >> {tmp_path}/started\ncat\n")
        os.chmod(python, 0o755)
    record = tmp_path / "record.json"
    env = {"PYTHON": python, "ABSENT": '{"absent": true}', "RECORD": str(record),
           "SUMS": str(tmp_path / "record.json.sha256") if sums is not None else "", "HEADERS": headers}
    if sums is not None:
        (tmp_path / "record.json.sha256").write_text(sums)
    result = subprocess.run(["bash", "-c", script_command(SCRIPT, "SETS", "REQUEST", env=env)],
                            input="\n".join(printed(patchlib.RESULT, '{"from": "python"}')) + "\n",
                            capture_output=True, text=True)
    return {"rc": result.returncode, "out": split(result.stdout.splitlines()),
            "python": (tmp_path / "started").is_file()}


def sums_of(*paths: Path, header: str = "h 1") -> str:
    return "".join([f"{header}\n"] + [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p}\n" for p in paths])


@pytest.fixture
def files(tmp_path):
    (tmp_path / "record.json").write_text('{"package": "sglang"}\n')
    (tmp_path / "patched.py").write_text("x = 1\n")
    return tmp_path / "record.json", tmp_path / "patched.py"


def test_patch_check_answers_from_the_record_when_the_sums_hold(tmp_path, files):
    ran = patch_check(tmp_path, sums_of(*files), headers="h 0\nh 1")
    assert ran == {"rc": 0, "python": False,
                   "out": {SUMS_HOLD: Section(0, (str(tmp_path / "python"), str(files[0]), '{"package": "sglang"}'))}}


@pytest.mark.parametrize("sums", [
    lambda files: sums_of(*files, header="h 2"),                                  # another engine or set
    lambda files: sums_of(*files).replace("h 1\n", ""),                          # no header
    lambda files: "h 1\n",                                                      # nothing to confirm
    lambda files: sums_of(*files) + "not a sum line\n",
    lambda files: sums_of(*files).replace(str(files[1]), str(files[1]) + ".gone"),
    lambda files: sums_of(*files).replace(hashlib.sha256(files[1].read_bytes()).hexdigest(), "0" * 64),
])
def test_patch_check_runs_python_when_the_sums_do_not_hold(tmp_path, files, sums):
    ran = patch_check(tmp_path, sums(files))
    assert ran == {"rc": 0, "python": True, "out": {patchlib.RESULT: Section(0, ('{"from": "python"}',))}}


def test_patch_check_runs_python_when_a_file_changed_or_without_sums(tmp_path, files):
    sums = sums_of(*files)
    files[1].write_text("x = 2\n")
    assert patch_check(tmp_path, sums)["python"]
    assert patch_check(tmp_path, None)["python"]  # apply, or verification (quick=False)


def test_patch_check_prints_absent_without_an_executable_python(tmp_path, files):
    ran = patch_check(tmp_path, sums_of(*files), python=str(tmp_path / "nowhere" / "python"))
    assert ran == {"rc": 0, "python": False, "out": {patchlib.RESULT: Section(0, ('{"absent": true}',))}}


def test_the_installed_version_is_found_where_importlib_metadata_finds_it(make_env):
    env = make_env("0.5.9")
    code = ("import importlib.metadata as m, json, sys; sys.path.insert(0, sys.argv[1]); "
            "from servestack import patchlib; "
            "found = [patchlib.find_distribution(name) for name in ('sglang', 'SGLang', 'no-such-package')]; "
            "print(json.dumps([[f[0], str(f[1])] if f else None for f in found] + "
            "[[m.version('sglang'), str(m.distribution('sglang').locate_file('').resolve())]]))")
    result = subprocess.run([env.python, "-I", "-c", code, str(Path(patchlib.__file__).parents[1])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    sglang, capitalised, absent, by_importlib = json.loads(result.stdout)
    assert sglang == capitalised == by_importlib == ["0.5.9", str(env.site_packages.resolve())]
    assert absent is None


def test_finding_an_installed_package_imports_no_importlib_metadata(make_env):
    env = make_env("0.5.9")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from servestack import patchlib; "
            "assert patchlib.find_distribution('sglang')[0] == '0.5.9'; "
            "print('importlib.metadata' in sys.modules)")
    result = subprocess.run([env.python, "-I", "-c", code, str(Path(patchlib.__file__).parents[1])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
