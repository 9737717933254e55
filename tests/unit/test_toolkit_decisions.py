"""Toolkit step decisions: what the install path holds, how the runfile is had, the records, the
post-install checks, and the inputs the host-side scripts get (the scripts themselves run in
test_toolkit_scripts.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, State
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops

from facts.batch import FactRequest
from facts.toolkit import (
    CudaToolkits,
    Digest,
    FileStat,
    Fingerprint,
    LinkChain,
    NvccVersion,
    ToolkitState,
    Tree,
    toolkit_fact_arguments,
)
from operations.toolkit import (
    after_install_problems,
    assess_install,
    completed,
    download_command,
    file_to_hash,
    host_reads,
    human_bytes,
    install_command,
    kept_link_to_restore,
    link_line,
    new_record,
    paths_to_complete,
    paths_to_record,
    plan_runfile,
    record_target,
    restore_line,
    cuda_toolkit,
)
from sandbox.standins.toolkit import write_toolkit_tree
from servestack.checks.outcome import Fail
from servestack.checks.toolkit import cuda_link
from servestack.manifest import Runfile
from servestack.paths import kept_paths, runfile_source
from servestack.settings import settings_from_data
from tests.unit.fake_host import fake_state, run_here
from tests.unit.test_toolkit_scripts import installer_tmp_log_in_tmp_path  # noqa: F401  (an autouse fixture)
from tests.unit.test_toolkit_scripts import fake_runfile, lab_data, lab_manifest

INSTALL = "/usr/local/cuda-13.0"


def settings(**data):
    return settings_from_data("h1", data)


def version_json(cuda="13.0.1", nvcc="13.0.88"):
    return {"cuda": {"name": "CUDA SDK", "version": cuda}, "cuda_nvcc": {"name": "CUDA NVCC", "version": nvcc}}


def tree(nvcc="13.0.88", vj=None, dpkg=None, **values) -> Tree:
    release = ".".join(nvcc.split(".")[:2]) if nvcc else None
    return Tree(INSTALL, exists=True, nvcc=NvccVersion(release, nvcc) if nvcc else None,
                version_json=vj, dpkg_owner=dpkg, **values)


# What the install path holds

def test_absent_and_empty_need_an_install():
    assert assess_install(settings(), Tree(INSTALL)).kind == "absent"
    assert assess_install(settings(), Tree(INSTALL, exists=True, empty=True)).kind == "empty"
    assert assess_install(settings(), Tree(INSTALL)).install_needed


def test_runfile_install_of_the_manifest_version_is_installed():
    verdict = assess_install(settings(), tree(vj=version_json()))
    assert verdict.kind == "installed" and not verdict.install_needed


def test_date_stamped_version_json_is_accepted_on_major_minor():
    assert assess_install(settings(), tree(vj=version_json(cuda="13.0.20250820"))).kind == "installed"
    assert assess_install(settings(), tree(vj=version_json(cuda="13.1.20251101"))).kind == "foreign"


def test_another_13_0_update_is_not_ours():
    verdict = assess_install(settings(), tree(vj=version_json(cuda="13.0.2")))
    assert verdict.kind == "foreign" and "version.json says CUDA 13.0.2" in verdict.detail


def test_package_installed_toolkit_is_refused_unless_accepted():
    package = tree(dpkg="cuda-nvcc-13-0")
    refused = assess_install(settings(), package)
    assert refused.refused and "cuda-nvcc-13-0" in refused.detail and "cuda_existing_toolkit" in refused.detail
    accepted = assess_install(settings(cuda_existing_toolkit="accept"), package)
    assert accepted.kind == "accepted" and not accepted.install_needed


def test_no_version_json_is_refused_unless_accepted():
    assert assess_install(settings(), tree()).refused
    assert assess_install(settings(cuda_existing_toolkit="accept"), tree()).kind == "accepted"


def test_accept_never_covers_another_nvcc():
    verdict = assess_install(settings(cuda_existing_toolkit="accept"),
                             tree(nvcc="12.8.93", vj=version_json("12.8.1", "12.8.93")))
    assert verdict.refused and "12.8" in verdict.detail


def test_broken_tree_is_refused_unless_our_install_was_interrupted():
    broken = tree(nvcc=None, nvcc_error="bin/nvcc --version failed (exit 2): Syntax error")
    verdict = assess_install(settings(), broken)
    assert verdict.refused and "no working toolkit" in verdict.detail
    interrupted = assess_install(settings(), broken, {"path": INSTALL, "run_id": "r1"})
    assert interrupted.kind == "interrupted" and interrupted.install_needed
    other_path = assess_install(settings(), broken, {"path": "/opt/cuda-13.0", "run_id": "r1"})
    assert other_path.refused


def test_dangling_symlink_at_install_path_is_refused():
    assert assess_install(settings(), Tree(INSTALL, symlink_to="/nowhere")).refused


# The runfile

RUNFILE = Runfile("x.run", "http://mirror/x.run", 4302469087, "a" * 32, "b" * 64)


def source(mode="host", **data):
    s = settings(**data)
    base = runfile_source(s, "x86_64")
    return base.__class__(RUNFILE, base.mode if mode != "controller" else "controller", base.cached, base.part)


def stat(path, size):
    return FileStat(path, size, 1, 2)


def digest(path, size=RUNFILE.size, md5=RUNFILE.md5, sha256=RUNFILE.sha256):
    return Digest(path, True, stat(path, size), md5, sha256)


def test_fresh_host_downloads():
    src = source()
    plan = plan_runfile(src, {}, None)
    assert plan.fetch == "download" and plan.use == src.part
    assert plan.lines == ("download 4.3 GB from http://mirror/x.run",)


def test_cached_and_verified_is_used_without_fetching():
    src = source()
    stats = {src.cached: stat(src.cached, RUNFILE.size)}
    assert file_to_hash(src, stats) == src.cached
    plan = plan_runfile(src, stats, digest(src.cached))
    assert plan.use == src.cached and plan.fetch is None and not plan.rejects
    assert "cached and verified" in plan.lines[0]


def test_cached_with_a_bad_checksum_is_rejected_then_downloaded():
    src = source()
    stats = {src.cached: stat(src.cached, RUNFILE.size)}
    plan = plan_runfile(src, stats, digest(src.cached, sha256="c" * 64))
    assert plan.rejects == ((src.cached, f"sha256 {'c' * 64}, expected {'b' * 64}"),)
    assert plan.fetch == "download" and plan.use == src.part


def test_cached_with_a_wrong_size_is_rejected_without_hashing():
    src = source()
    stats = {src.cached: stat(src.cached, 10)}
    assert file_to_hash(src, stats) is None
    plan = plan_runfile(src, stats, None)
    assert plan.rejects[0][1] == f"size 10 bytes, expected {RUNFILE.size}"


def test_partial_download_resumes():
    src = source()
    plan = plan_runfile(src, {src.part: stat(src.part, 1_200_000_000)}, None)
    assert plan.fetch == "download" and plan.resume_from == 1_200_000_000
    assert plan.lines == ("resume download from http://mirror/x.run at 1.2 GB of 4.3 GB",)


def test_complete_partial_download_is_verified_not_fetched_again():
    src = source()
    plan = plan_runfile(src, {src.part: stat(src.part, RUNFILE.size)}, None)
    assert plan.fetch is None and plan.use == src.part


def test_oversized_partial_download_is_moved_aside():
    src = source()
    plan = plan_runfile(src, {src.part: stat(src.part, RUNFILE.size + 1)}, None)
    assert plan.rejects[0][0] == src.part and plan.resume_from == 0


def test_controller_mode_uploads_only_what_is_missing():
    src = source("controller")
    assert plan_runfile(src, {}, None).fetch == "upload"
    cached = {src.cached: stat(src.cached, RUNFILE.size)}
    assert plan_runfile(src, cached, digest(src.cached)).fetch is None


def test_prestaged_runfile_is_verified_and_never_moved():
    s = settings(cuda_runfile_path="/srv/x.run")
    src = runfile_source(s, "x86_64")
    src = src.__class__(RUNFILE, src.mode, src.cached, src.part)
    assert plan_runfile(src, {}, None).problem.endswith("no such file on the host")
    stats = {src.cached: stat(src.cached, 5)}
    assert file_to_hash(src, stats) == src.cached
    bad = plan_runfile(src, stats, digest(src.cached, size=5))
    assert "fails verification" in bad.problem and not bad.rejects
    good = plan_runfile(src, {src.cached: stat(src.cached, RUNFILE.size)}, digest(src.cached))
    assert good.use == "/srv/x.run" and good.problem is None


def test_sources_follow_host_data():
    s = settings(cuda_mirror="https://mirror.internal/cuda/")
    src = runfile_source(s, "aarch64")
    assert src.runfile.url == "https://mirror.internal/cuda/cuda_13.0.1_580.82.07_linux_sbsa.run"
    assert src.cached == "/var/cache/servestack/cuda_13.0.1_580.82.07_linux_sbsa.run"
    assert runfile_source(s, "ppc64le") is None
    assert human_bytes(4302469087) == "4.3 GB"


# Records and checks

def state(record=None, link=None, install=None, kept=None) -> ToolkitState:
    return ToolkitState(install=install or Tree(INSTALL), kept=kept or {},
                        link=link or LinkChain("/usr/local/cuda", (("/usr/local/cuda", "cuda-12.8"),),
                                               "/usr/local/cuda-12.8", "link"),
                        record=record)


FP = Fingerprint("/usr/local/cuda-12.8", True, "12.8.93", "nvcc text", {"cuda": {}}, 31, "f" * 64)


def test_record_once_per_target():
    s = settings()
    assert paths_to_record(s, state()) == kept_paths(s) == ("/usr/local/cuda-12.8",)
    record = new_record(s, state(), {FP.path: FP}, "run-1")
    assert record["target"] == record_target(s)
    assert record["link"]["hops"] == [["/usr/local/cuda", "cuda-12.8"]]
    assert record["toolkits"][FP.path]["files_sha256"] == "f" * 64
    assert paths_to_record(s, state(record=record)) == ()
    other_target = dict(record, target={**record["target"], "version": "13.0.0"})
    assert paths_to_record(s, state(record=other_target)) == kept_paths(s)


def test_a_fingerprint_recorded_without_times_is_completed_once_where_the_tree_still_matches():
    s = settings()
    timed = replace(FP, mtimes_sha256="a" * 64)
    record = new_record(s, state(), {FP.path: timed}, "run-1")
    assert paths_to_complete(s, state(record=record)) == ()
    old = json.loads(json.dumps(record))
    del old["toolkits"][FP.path]["mtimes_sha256"]                   # as servestack recorded it before
    assert paths_to_complete(s, state(record=old)) == (FP.path,)
    assert completed(state(record=old), {FP.path: timed}) == {FP.path: timed}
    resized = replace(timed, files=30, files_sha256="e" * 64)
    assert completed(state(record=old), {FP.path: resized}) == {}    # changed since: its record stays
    absent = json.loads(json.dumps(old))
    absent["toolkits"][FP.path] = {"present": False}
    assert paths_to_complete(s, state(record=absent)) == ()
    other_target = dict(old, target={**old["target"], "version": "13.0.0"})
    assert paths_to_complete(s, state(record=other_target)) == ()    # recorded afresh instead


def test_link_lines():
    chain = state().link
    assert link_line(settings(), chain) == ("/usr/local/cuda stays -> cuda-12.8", False)
    line, change = link_line(settings(cuda_link_policy="new"), chain)
    assert change and line.startswith(f"/usr/local/cuda -> {INSTALL} (was /usr/local/cuda -> cuda-12.8)")
    done = LinkChain("/usr/local/cuda", (("/usr/local/cuda", INSTALL),), INSTALL, "link")
    assert link_line(settings(cuda_link_policy="new"), done)[1] is False


def test_after_install_checks_every_promise():
    s = settings()
    record = new_record(s, state(), {FP.path: FP}, "run-1")
    good = state(record=record, install=tree(vj=version_json()))
    assert after_install_problems(s, good, {FP.path: FP}, good.link) == []
    changed = Fingerprint(FP.path, True, "12.8.93", "nvcc text", {"cuda": {}}, 30, "e" * 64)
    moved = LinkChain("/usr/local/cuda", (("/usr/local/cuda", INSTALL),), INSTALL, "link")
    bad = state(record=record, install=tree(nvcc=None, nvcc_error="no bin/nvcc"), link=moved)
    problems = after_install_problems(s, bad, {FP.path: changed}, good.link)
    assert any(p.startswith("after the install") for p in problems)
    assert any("kept toolkit /usr/local/cuda-12.8 changed" in p for p in problems)
    assert any(p.startswith(f"/usr/local/cuda is /usr/local/cuda -> {INSTALL}") for p in problems)


# What the scripts are given

def test_rendered_commands_are_valid_shell():
    s = settings()
    src = runfile_source(s, "x86_64")
    for command in (install_command(s, src, src.part, state().link, "run-1"),
                    install_command(s, src, src.cached, None, "run-1"),
                    download_command(src)):
        result = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_install_command_uses_the_reference_flags():
    s = settings(cuda_tmpdir="/scratch/tmp")
    src = runfile_source(s, "x86_64")
    words = shlex.split(install_command(s, src, src.cached, None, "run-1"))
    install = words[words.index("cuda-toolkit.sh") + 1:]
    assert install == ["install", "--silent", "--toolkit", "--no-opengl-libs", "--no-drm", "--no-man-page"]
    assert "SS_RUNFILE=/var/cache/servestack/cuda_13.0.1_580.82.07_linux.run" in words
    assert "SS_INSTALL_PATH=/usr/local/cuda-13.0" in words and "SS_TMP_DIR=/scratch/tmp" in words
    assert not [word for word in words if "--driver" in word]


def test_the_override_key_adds_override_to_the_installer_flags():
    def flags(**data):
        s = settings(**data)
        words = shlex.split(install_command(s, runfile_source(s, "x86_64"), "/x.run", None, "run-1"))
        return words[words.index("cuda-toolkit.sh") + 2:]
    assert "--override" not in flags()
    assert flags(cuda_installer_override=True)[-1] == "--override"
    assert settings().cuda_installer_override is False


def test_the_compiler_hint_names_the_key():
    assert "set cuda_installer_override = True in this host's data to pass --override" in " ".join(
        shlex.split(install_command(settings(), runfile_source(settings(), "x86_64"), "/x.run", None, "r")))
    assert "cuda_installer_override = True already passes --override" in install_command(
        settings(cuda_installer_override=True), runfile_source(settings(), "x86_64"), "/x.run", None, "r")


def test_a_prestaged_runfile_that_fails_names_its_key():
    src = source(cuda_runfile_path="/srv/x.run")
    src = src.__class__(RUNFILE, "prestaged", "/srv/x.run", None)
    stats = {src.cached: stat(src.cached, 5)}
    assert plan_runfile(src, stats, digest(src.cached, size=5)).problem == (
        f"cuda_runfile_path /srv/x.run fails verification (size 5 bytes, expected {RUNFILE.size}): not used")


def test_the_step_lists_the_read_its_operation_makes():
    s = settings()
    assert host_reads(s) == [FactRequest.of(CudaToolkits, **toolkit_fact_arguments(s))]
    assert host_reads(s, release=object()) == host_reads(s)


@pytest.mark.parametrize("policy", ["keep", "new"])
def test_policy_is_a_known_choice(policy):
    assert settings(cuda_link_policy=policy).cuda_link_policy == policy


# The operation through pyinfra's @fake connector, every command it sends run here in a temporary directory

def run_commands_here(monkeypatch) -> None:
    run_here(monkeypatch, lambda command: True,
             lambda command: subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60))


def fake_host(state: State):
    return state.inventory.get_host("@fake/gpu1")


@pytest.fixture
def host_lab(tmp_path, monkeypatch):
    """A host whose /usr/local/cuda -> cuda-12.8 (a stand-in toolkit), every path in tmp_path, and
    the manifest's runfile (a fake installer) served at a file:// URL."""
    runfile = fake_runfile(tmp_path, "normal")
    (tmp_path / "served.run").write_bytes(runfile)
    data = {**lab_data(tmp_path, lab_manifest(tmp_path, runfile)), "cuda_runfile_url": f"file://{tmp_path}/served.run"}
    write_toolkit_tree(tmp_path / "cuda-12.8")
    (tmp_path / "cuda").symlink_to("cuda-12.8")
    run_commands_here(monkeypatch)
    return tmp_path, data


def listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.skipif(not shutil.which("curl") or not shutil.which("flock"), reason="needs curl and flock")
def test_the_operation_installs_then_a_converged_host_costs_one_read(host_lab, caplog):
    root, data = host_lab
    caplog.set_level(logging.INFO, logger="pyinfra")
    before = listing(root)
    state = fake_state(data, Config(DIFF=True))
    add_deploy(state, cuda_toolkit)
    assert state.get_meta_for_host(fake_host(state)).ops_change == 1
    assert listing(root) == before                                       # prepare changes nothing
    assert re.search(r"download [\d.]+ kB from file://", caplog.text) and "install 13.0.1 into" in caplog.text
    run_ops(state)
    assert not state.failed_hosts
    assert (root / "cuda-13.0" / "version.json").exists() and os.readlink(root / "cuda") == "cuda-12.8"
    record = json.loads((root / "state" / "toolkits.json").read_text())
    assert record["installed"]["version"] == "13.0.1" and str(root / "cuda-12.8") in record["toolkits"]
    assert not (root / "state" / "toolkit-install.json").exists()
    assert (root / "cache" / "cuda_13.0.1_580.82.07_linux.run").exists()
    assert "checked: nvcc reports 13.0.88, kept toolkits unchanged" in caplog.text

    again = fake_state(data)
    add_deploy(again, cuda_toolkit)
    host = fake_host(again)
    assert (again.get_meta_for_host(host).ops_change, len(host.connector.executed_commands)) == (0, 1)
    run_ops(again)
    assert len(host.connector.executed_commands) == 2                     # one read per stage, nothing else


def strip_times(record_file: Path) -> dict:
    """toolkits.json as servestack wrote it before fingerprints had the files' modification times."""
    record = json.loads(record_file.read_text())
    for fingerprint in record["toolkits"].values():
        fingerprint.pop("mtimes_sha256")
    record_file.write_text(json.dumps(record))
    return record


@pytest.mark.skipif(not shutil.which("curl") or not shutil.which("flock"), reason="needs curl and flock")
def test_a_converged_host_with_a_record_without_times_gets_them_once(host_lab, caplog):
    root, data = host_lab
    caplog.set_level(logging.INFO, logger="pyinfra")
    first = fake_state(data)
    add_deploy(first, cuda_toolkit)
    run_ops(first)
    record_file, kept = root / "state" / "toolkits.json", str(root / "cuda-12.8")
    timed = json.loads(record_file.read_text())["toolkits"][kept]["mtimes_sha256"]
    assert timed
    old = strip_times(record_file)

    completing = fake_state(data, Config(DIFF=True))
    add_deploy(completing, cuda_toolkit)
    assert completing.get_meta_for_host(fake_host(completing)).ops_change == 1
    assert f"add the files' modification times to the fingerprint of {kept}" in caplog.text
    run_ops(completing)
    record = json.loads(record_file.read_text())
    assert record["toolkits"][kept] == {**old["toolkits"][kept], "mtimes_sha256": timed}
    assert record["installed"] == old["installed"]

    again = fake_state(data)
    add_deploy(again, cuda_toolkit)
    assert again.get_meta_for_host(fake_host(again)).ops_change == 0


@pytest.mark.skipif(not shutil.which("curl") or not shutil.which("flock"), reason="needs curl and flock")
def test_a_kept_toolkit_changed_since_its_record_without_times_keeps_that_record(host_lab):
    root, data = host_lab
    first = fake_state(data)
    add_deploy(first, cuda_toolkit)
    run_ops(first)
    record_file = root / "state" / "toolkits.json"
    old = strip_times(record_file)
    (root / "cuda-12.8" / "added-after-the-install").write_text("x")
    changed = fake_state(data)
    add_deploy(changed, cuda_toolkit)
    assert changed.get_meta_for_host(fake_host(changed)).ops_change == 0
    run_ops(changed)
    assert json.loads(record_file.read_text()) == old


def test_a_toolkit_it_cannot_vouch_for_refuses_the_host_at_prepare(host_lab, caplog):
    root, data = host_lab
    write_toolkit_tree(root / "cuda-13.0", "13.0.2", "13.0.88")
    state = fake_state(data)
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        add_deploy(state, cuda_toolkit)
    assert fake_host(state) in state.failed_hosts
    assert "refused: " in caplog.text and "version.json says CUDA 13.0.2, expected 13.0.1" in caplog.text
    assert not (root / "state").exists() and not (root / "cache").exists()


@pytest.mark.skipif(not shutil.which("curl") or not shutil.which("flock"), reason="needs curl and flock")
def test_a_rejected_cached_runfile_replaces_the_older_rejected_copy_and_says_so(host_lab, caplog):
    root, data = host_lab
    caplog.set_level(logging.INFO, logger="pyinfra")
    cache = root / "cache"
    cache.mkdir()
    name = "cuda_13.0.1_580.82.07_linux.run"
    good = (root / "served.run").read_bytes()
    (cache / name).write_bytes(good.replace(b"hello", b"HELLO"))               # full size, wrong checksums
    older = cache / f"{name}.part.rejected-20250101T000000Z"
    older.write_text("an older rejected download")
    state = fake_state(data)
    add_deploy(state, cuda_toolkit)
    run_ops(state)
    assert not state.failed_hosts
    assert (f"removed the older rejected copy {older} (only the newest rejected runfile is kept)"
            in caplog.text)
    rejected = list(cache.glob("*.rejected-*"))
    assert len(rejected) == 1 and rejected[0].name.startswith(f"{name}.rejected-")
    assert (cache / name).read_bytes() == good


# --- a link changed by hand after the install (issue 32 §5) -----------------------------------------

CUDA_LINK = LinkChain("/usr/local/cuda", (("/usr/local/cuda", "cuda-12.8"),), "/usr/local/cuda-12.8", "link")
ABSENT = LinkChain("/usr/local/cuda")
TO_13 = LinkChain("/usr/local/cuda", (("/usr/local/cuda", "/usr/local/cuda-13.0"),), "/usr/local/cuda-13.0", "link")


def _verify_fails(s, record_link: LinkChain, now: LinkChain) -> bool:
    readings = SimpleNamespace(link=lambda _settings: now, toolkits_record={"link": record_link.to_record()},
                               on="on h1", host=SimpleNamespace(toolkit_path=None))
    try:
        cuda_link(s, readings)
    except Fail:
        return True
    return False


@pytest.mark.parametrize(("recorded", "now"), [(CUDA_LINK, ABSENT), (CUDA_LINK, TO_13), (CUDA_LINK, CUDA_LINK),
                                               (ABSENT, TO_13), (ABSENT, ABSENT)])
def test_the_toolkit_step_repairs_the_link_exactly_when_verify_fails_it(recorded, now):
    s = settings()
    restore = kept_link_to_restore(s, state(record={"link": recorded.to_record()}, link=now))
    assert (restore is not None) == _verify_fails(s, recorded, now)
    assert restore in (None, recorded)


def test_the_repair_is_planned_only_under_keep_with_a_record():
    assert kept_link_to_restore(settings(cuda_link_policy="new"),
                                state(record={"link": CUDA_LINK.to_record()}, link=ABSENT)) is None
    assert kept_link_to_restore(settings(), state(record=None, link=ABSENT)) is None
    assert restore_line(ABSENT, CUDA_LINK) == ("restore /usr/local/cuda -> cuda-12.8 as toolkits.json recorded it "
                                               "before the install (now /usr/local/cuda (absent); "
                                               "cuda_link_policy = 'keep')")
