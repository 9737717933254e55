"""Toolkit step decisions: what the install path holds, how the runfile is had, the records, the
post-install checks, and the shell pieces that can run here safely (verify, link restore)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from facts.toolkit import Digest, FileStat, Fingerprint, LinkChain, NvccVersion, ToolkitState, Tree
from operations.toolkit import (
    after_install_problems,
    assess_install,
    download_command,
    file_to_hash,
    human_bytes,
    install_script,
    kept_paths,
    link_line,
    new_record,
    paths_to_record,
    plan_runfile,
    record_target,
    restore_link_script,
    runfile_source,
    verify_script,
)
from servestack.manifest import Runfile
from servestack.settings import settings_from_data

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
    verdict = assess_install(settings(cuda_existing_toolkit="accept"), tree(nvcc="12.8.93", vj=version_json("12.8.1", "12.8.93")))
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


# Shell pieces, run here on temporary files only

def sh(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", 'say() { echo "servestack: $*" >&2; }\nts=TS\n' + script],
                          capture_output=True, text=True, cwd=cwd)


def test_verify_script_accepts_the_right_bytes_and_moves_aside_the_wrong(tmp_path):
    data = b"runfile bytes"
    runfile = Runfile("x.run", "http://m/x.run", len(data), hashlib.md5(data).hexdigest(),
                      hashlib.sha256(data).hexdigest())
    path = tmp_path / "x.run"
    path.write_bytes(data)
    assert sh(verify_script(runfile, str(path), ours=True), tmp_path).returncode == 0
    path.write_bytes(b"runfile bytez")
    result = sh(verify_script(runfile, str(path), ours=True), tmp_path)
    assert result.returncode == 1 and "md5" in result.stderr and "never used" in result.stderr
    assert not path.exists() and (tmp_path / "x.run.rejected-TS").exists()


def test_verify_script_never_moves_a_prestaged_file(tmp_path):
    runfile = Runfile("x.run", "http://m/x.run", 3, "a" * 32, "b" * 64)
    path = tmp_path / "x.run"
    path.write_bytes(b"abc")
    result = sh(verify_script(runfile, str(path), ours=False), tmp_path)
    assert result.returncode == 1 and "pre-staged" in result.stderr and path.exists()


def test_restore_link_script_puts_back_only_changed_hops(tmp_path):
    link, alt = tmp_path / "cuda", tmp_path / "alternatives-cuda"
    (tmp_path / "cuda-12.8").mkdir()
    (tmp_path / "cuda-13.0").mkdir()
    alt.symlink_to(tmp_path / "cuda-12.8")
    link.symlink_to(alt)
    chain = LinkChain(str(link), ((str(link), str(alt)), (str(alt), str(tmp_path / "cuda-12.8"))), None, "link")
    assert sh(restore_link_script(chain), tmp_path).stderr == ""
    link.unlink()
    link.symlink_to(tmp_path / "cuda-13.0")           # what a re-pointing installer does
    result = sh(restore_link_script(chain), tmp_path)
    assert "restored" in result.stderr
    assert Path.readlink(link) == alt and Path.readlink(alt) == tmp_path / "cuda-12.8"


def test_restore_link_script_removes_a_link_that_did_not_exist(tmp_path):
    link = tmp_path / "cuda"
    link.symlink_to("cuda-13.0")
    sh(restore_link_script(LinkChain(str(link))), tmp_path)
    assert not link.is_symlink()


def test_generated_scripts_are_valid_shell():
    s = settings()
    src = runfile_source(s, "x86_64")
    for script in (install_script(s, src, src.part, state().link, "run-1"),
                   install_script(s, src, src.cached, None, "run-1"),
                   download_command(src)):
        result = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_install_script_uses_the_reference_flags():
    s = settings(cuda_tmpdir="/scratch/tmp")
    src = runfile_source(s, "x86_64")
    script = install_script(s, src, src.cached, None, "run-1")
    assert ("sh /var/cache/servestack/cuda_13.0.1_580.82.07_linux.run --silent --toolkit --no-opengl-libs "
            "--no-drm --no-man-page --installpath=/usr/local/cuda-13.0 --tmpdir=/scratch/tmp") in script
    assert "TMPDIR=/scratch/tmp" in script
    assert "--driver" not in script


@pytest.mark.parametrize("policy", ["keep", "new"])
def test_policy_is_a_known_choice(policy):
    assert settings(cuda_link_policy=policy).cuda_link_policy == policy
