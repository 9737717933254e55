"""Preflight: every check judged from constructed facts, disk budgets per filesystem, the host lock
(its shell run here in a temporary directory), and the doctor's report."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pyinfra import host
from pyinfra.api.deploy import add_deploy, deploy
from pyinfra.context import ctx_host, ctx_state

from facts.batch import FactRequest
from facts.gpu import Gpu, GpuReport
from facts.host import (
    Disk,
    LockState,
    disk_command,
    lock_read_command,
    parse_df_line,
    parse_disks,
    parse_lock,
    release_lock_command,
    take_lock_command,
)
from facts.preflight import PreflightFacts
from facts.toolkit import (CudaToolkits, Digest, FileStat, LinkChain, NvccVersion, ToolkitState, Tree,
                           toolkit_fact_arguments, toolkits_command)
from operations.preflight import CHECKS, disk_needs, evaluate, host_reads, problems_of, read_preflight
from operations.toolkit import runfile_toolkit
from sandbox.standins.toolkit import write_toolkit_tree
from servestack.doctor import render_json, report_for
from servestack.paths import kept_paths, runfile_candidates
from servestack.settings import host_settings, settings_from_data
from tests.unit.fake_host import fake_state, run_here
from tests.unit.flock_holder import flock_held
from tests.unit.test_toolkit_decisions import host_lab  # noqa: F401  (a fixture)
from tests.unit.test_toolkit_scripts import installer_tmp_log_in_tmp_path  # noqa: F401  (an autouse fixture)

FIXTURE_DF = Path(__file__).resolve().parents[1] / "fixtures" / "h200-ubuntu2404" / "df.txt"
GB = 10**9


def settings(**data):
    return settings_from_data("h1", data)


def blackwell(count=8, cap="12.0", driver="580.82.07") -> GpuReport:
    gpus = tuple(Gpu(i, "NVIDIA RTX PRO 6000 Blackwell Server Edition", cap, driver, 97887, f"GPU-{i}",
                     f"00000000:{i:02X}:00.0") for i in range(count))
    return GpuReport(gpus, driver)


def facts(gpu=None, arch="x86_64", avail=100 * GB, lock=None, install=None, files=None, link=None,
          mounts=None, digest=None) -> PreflightFacts:
    mounts = mounts or {}
    disks = {path: Disk(path, mounts.get(path, "/"), avail, 200 * GB)
             for path in ("/var/cache/servestack", "/var/tmp", "/usr/local/cuda-13.0")}
    toolkit = ToolkitState(
        install=install or Tree("/usr/local/cuda-13.0"), arch=arch,
        kept={"/usr/local/cuda-12.8": True},
        link=link or LinkChain("/usr/local/cuda", (("/usr/local/cuda", "cuda-12.8"),), "/usr/local/cuda-12.8", "link"),
        files=files or {})
    return PreflightFacts(gpu=gpu or blackwell(), disks=disks, lock=lock or LockState(), toolkit=toolkit,
                          runfile_digest=digest)


def by_name(checks):
    return {check.name: check for check in checks}


def test_a_ready_host_passes_every_check():
    checks = evaluate(settings(), facts(), "run-1")
    assert [check.name for check in checks] == list(CHECKS)
    assert problems_of(checks) == []
    assert by_name(checks)["link"].detail == "/usr/local/cuda stays -> cuda-12.8"


def test_unread_toolkits_refuse_the_host_and_skip_what_judges_them():
    read = facts()
    unread = PreflightFacts(gpu=read.gpu, disks=read.disks, lock=read.lock, toolkit=None)
    checks = by_name(evaluate(settings(), unread, "run-1"))
    assert list(checks) == list(CHECKS)
    assert checks["install_path"].status == "fail"
    assert "cannot read the CUDA toolkits on the host (/usr/local/cuda-13.0" in checks["install_path"].detail
    assert {name: checks[name].status for name in ("runfile", "disk", "link", "kept_toolkits")} == {
        "runfile": "skip", "disk": "skip", "link": "skip", "kept_toolkits": "skip"}
    assert checks["lock"].status == "ok"


def test_problems_are_one_line_each():
    checks = evaluate(settings(), facts(gpu=blackwell(cap="9.0", driver="570.86.10"), avail=GB), "run-1")
    problems = problems_of(checks)
    assert len(problems) == 4
    assert problems[0].startswith("NVIDIA driver 570.86.10 is older than 580.82.07")
    assert problems[1].startswith("8 of 8 GPUs are not compute capability 12.0")
    assert problems[2].startswith("8 of 8 GPUs cannot serve nvidia/Kimi-K2.5-NVFP4")
    assert problems[3].startswith("not enough disk on /: 1.0 GB free, 20.3 GB needed (runfile 4.3 GB in "
                                  "/var/cache/servestack, extraction 8.0 GB in /var/tmp, toolkit 8.0 GB in "
                                  "/usr/local/cuda-13.0)")
    assert all("\n" not in problem for problem in problems)


def test_a_model_the_stacks_sglang_cannot_load_on_these_gpus_is_refused_before_any_change():
    """Kimi-K2.5-NVFP4 is modelopt_fp4, which sglang 0.5.9 loads only from compute capability 10.0 (its
    loader refuses at model load, after the restart); 0.5.14 loads it from 8.0 (files/stack.toml)."""
    hopper = blackwell(cap="9.0")
    kimi = {check.name: check for check in evaluate(settings(gpu_compute_capability="9.0"), facts(gpu=hopper))}
    assert kimi["serving"].status == "fail"
    assert kimi["serving"].problems == (
        "8 of 8 GPUs cannot serve nvidia/Kimi-K2.5-NVFP4 (profile 'kimi-k2.5-eagle3'): sglang 0.5.9 "
        "(sglang-0.5.9) loads modelopt_fp4 only on compute capability 10.0 or newer, and GPU 0 (NVIDIA RTX PRO "
        "6000 Blackwell Server Edition, 00000000:00:00.0) is 9.0; serve it with a profile on a stack that loads it "
        "on these GPUs (service_profile / service_stack)",)
    glm = {check.name: check for check in evaluate(settings(gpu_compute_capability="9.0", service_profile="glm-5-mtp"),
                                                   facts(gpu=hopper))}
    assert glm["serving"].status == "ok" and "sglang 0.5.14 loads modelopt_fp4" in glm["serving"].detail
    unquantized = settings(gpu_compute_capability="9.0", service_model_path="/models/local-copy")
    assert {check.name: check.status for check in evaluate(unquantized, facts(gpu=hopper))}["serving"] == "ok"
    on_blackwell = {check.name: check for check in evaluate(settings(), facts(gpu=blackwell()))}
    assert on_blackwell["serving"].status == "ok"


def test_arch_without_runfile_is_refused(tmp_path):
    manifest = tmp_path / "stack.toml"
    text = open(settings().manifest.path).read()
    start = text.index("[cuda.runfile.aarch64]")
    manifest.write_text(text[:start] + text[text.index("[gpu]"):])
    checks = by_name(evaluate(settings(servestack_manifest=str(manifest)), facts(arch="aarch64")))
    assert checks["arch"].status == "fail"
    assert checks["arch"].detail == "CPU architecture aarch64 has no runfile in stack.toml (it has x86_64)"
    assert checks["disk"].status == "skip"


def test_aarch64_uses_the_sbsa_runfile():
    assert by_name(evaluate(settings(), facts(arch="aarch64")))["arch"].detail.endswith("linux_sbsa.run")


def test_disk_budget_is_summed_per_filesystem():
    separate = {"/var/cache/servestack": "/var", "/var/tmp": "/var", "/usr/local/cuda-13.0": "/"}
    checks = by_name(evaluate(settings(), facts(avail=10 * GB, mounts=separate)))
    # /var needs 4.3 + 8 GB > 10 GB free; / needs 8 GB < 10 GB.
    assert checks["disk"].problems == ("not enough disk on /var: 10.0 GB free, 12.3 GB needed (runfile 4.3 GB "
                                       "in /var/cache/servestack, extraction 8.0 GB in /var/tmp)",)


def test_disk_counts_what_is_already_downloaded():
    s = settings()
    part = "/var/cache/servestack/cuda_13.0.1_580.82.07_linux.run.part"
    needs = disk_needs(s, facts(files={part: FileStat(part, 4 * GB, 0, 0)}))
    assert needs[0] == ("/var/cache/servestack", 302469087, "runfile")
    assert disk_needs(settings(cuda_runfile_path="/srv/x.run"), facts())[0][2] == "extraction"


def test_converged_host_needs_no_disk_and_no_runfile():
    installed = Tree("/usr/local/cuda-13.0", exists=True, nvcc=NvccVersion("13.0", "13.0.88"),
                     version_json={"cuda": {"version": "13.0.1"}, "cuda_nvcc": {"version": "13.0.88"}})
    checks = by_name(evaluate(settings(), facts(install=installed, avail=0)))
    assert checks["disk"].status == "ok" and checks["disk"].detail == "nothing to install"
    assert checks["runfile"].detail == "not needed"


def test_package_installed_toolkit_refuses_the_host():
    package = Tree("/usr/local/cuda-13.0", exists=True, nvcc=NvccVersion("13.0", "13.0.88"),
                   dpkg_owner="cuda-nvcc-13-0")
    check = by_name(evaluate(settings(), facts(install=package)))["install_path"]
    assert check.status == "fail" and "cuda-nvcc-13-0" in check.detail


def test_missing_prestaged_runfile_is_refused():
    check = by_name(evaluate(settings(cuda_runfile_path="/srv/x.run"), facts()))["runfile"]
    assert check.status == "fail" and check.detail == "cuda_runfile_path /srv/x.run: no such file on the host"


RUNFILE = settings().runfile("x86_64")
CACHED = "/var/cache/servestack/cuda_13.0.1_580.82.07_linux.run"


def digest_of(path, size=RUNFILE.size, md5=RUNFILE.md5, sha256=RUNFILE.sha256) -> Digest:
    return Digest(path, True, FileStat(path, size, 1, 2), md5, sha256)


@pytest.mark.parametrize("size, md5, differs", [
    (1000, RUNFILE.md5, f"size 1000 bytes, expected {RUNFILE.size}"),
    (RUNFILE.size, "0" * 32, f"md5 {'0' * 32}, expected {RUNFILE.md5}"),
])
def test_a_prestaged_runfile_that_fails_verification_refuses_the_host_in_one_line(size, md5, differs):
    files = {"/srv/x.run": FileStat("/srv/x.run", size, 1, 2)}
    checks = evaluate(settings(cuda_runfile_path="/srv/x.run"),
                      facts(files=files, digest=digest_of("/srv/x.run", size=size, md5=md5)))
    assert problems_of(checks) == [f"cuda_runfile_path /srv/x.run fails verification ({differs}): not used"]


def test_a_prestaged_runfile_that_verifies_passes():
    files = {"/srv/x.run": FileStat("/srv/x.run", RUNFILE.size, 1, 2)}
    verified = facts(files=files, digest=digest_of("/srv/x.run"))
    check = by_name(evaluate(settings(cuda_runfile_path="/srv/x.run"), verified))["runfile"]
    assert (check.status, check.detail) == ("ok", "pre-staged at /srv/x.run: verified (size, md5, sha256)")
    unread = by_name(evaluate(settings(cuda_runfile_path="/srv/x.run"), facts(files=files)))["runfile"]
    assert (unread.status, unread.detail) == ("ok", "pre-staged at /srv/x.run (verified before use)")


def test_a_cached_runfile_that_fails_verification_is_reported_not_refused():
    files = {CACHED: FileStat(CACHED, RUNFILE.size, 1, 2)}
    check = by_name(evaluate(settings(), facts(files=files, digest=digest_of(CACHED, sha256="c" * 64))))["runfile"]
    assert check.status == "warn"
    assert check.detail == (f"cached runfile {CACHED} fails verification (sha256 {'c' * 64}, expected "
                            f"{RUNFILE.sha256}): moved aside and downloaded again")
    good = by_name(evaluate(settings(), facts(files=files, digest=digest_of(CACHED))))["runfile"]
    assert good.detail == f"cached at {CACHED}: verified (size, md5, sha256)"


def test_link_policy_new_refuses_a_directory():
    directory = LinkChain("/usr/local/cuda", (), "/usr/local/cuda", "directory")
    assert by_name(evaluate(settings(cuda_link_policy="new"), facts(link=directory)))["link"].status == "fail"
    assert by_name(evaluate(settings(), facts(link=directory)))["link"].status == "ok"


def test_lock_held_stale_and_ours():
    info = {"run_id": "other", "controller": "laptop:42", "started": "20261130T010000Z"}
    held = by_name(evaluate(settings(), facts(lock=LockState(True, True, info)), "run-1"))["lock"]
    assert held.status == "fail"
    assert "another servestack run holds /var/lib/servestack/lock: run other from laptop:42" in held.detail
    stale = by_name(evaluate(settings(), facts(lock=LockState(True, False, info)), "run-1"))["lock"]
    assert stale.status == "warn" and "stale" in stale.detail
    ours = by_name(evaluate(settings(), facts(lock=LockState(True, True, {**info, "run_id": "run-1"})), "run-1"))
    assert ours["lock"].status == "ok"


def test_df_line_of_the_real_host():
    lines = open(FIXTURE_DF).read().splitlines()[2:-1]
    assert parse_df_line(lines[0]) == ("/", 68702244864, 270553174016)


def sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True)


def test_lock_take_is_exclusive_and_stale_locks_are_replaced(tmp_path):
    state = str(tmp_path / "state")
    assert parse_lock(sh(lock_read_command(state)).stdout.splitlines()) == LockState()
    assert sh(take_lock_command(state, "run-A", "ctl:1", "T")).stdout == "taken\n"
    assert (tmp_path / "state").is_dir()  # the take makes servestack's state directory
    assert sh(take_lock_command(state, "run-A", "ctl:1", "T")).stdout == "ours\n"
    # No sshd above this shell: the owner is unknown, so the lock holds until reboot.
    held = sh(take_lock_command(state, "run-B", "ctl:2", "T"))
    assert held.returncode == 3 and held.stdout.startswith("@@servestack begin held\n")
    lock = parse_lock(sh(lock_read_command(state)).stdout.splitlines())
    assert lock.present and lock.alive and lock.run_id == "run-A"
    # A lock whose owner process is gone (here: a pid that does not exist) is stale.
    path = tmp_path / "state" / "lock"
    path.write_text(path.read_text().replace('"pid": null', '"pid": 4194304'))
    assert not parse_lock(sh(lock_read_command(state)).stdout.splitlines()).alive
    taken = sh(take_lock_command(state, "run-B", "ctl:2", "T"))
    assert taken.stdout.startswith("@@servestack begin stale\n") and taken.stdout.endswith("\ntaken\n")
    assert json.loads(path.read_text())["run_id"] == "run-B"
    assert sh(release_lock_command(state, "run-A")).stdout == "not-ours\n"
    assert sh(release_lock_command(state, "run-B")).stdout == "released\n"
    assert not path.exists()
    assert sh(take_lock_command(state, "run-C", "ctl:3", "T")).stdout == "taken\n"


def test_a_lock_another_run_took_meanwhile_is_named_by_its_run_not_its_json(tmp_path, monkeypatch):
    """Two runs that both found the lock free at prepare: the one that loses the take says whose it is."""
    from operations import preflight

    state_dir = tmp_path / "state"
    sh(take_lock_command(str(state_dir), "run-A", "ctl:1", "2026-12-01T10:00:00Z"))
    run_here(monkeypatch, lambda command: str(state_dir) in command, sh)
    state = fake_state({})
    with ctx_state.use(state), ctx_host.use(state.inventory.get_host("@fake/gpu1")):
        taken, text = preflight._take_lock(settings(servestack_state_dir=str(state_dir)))
    assert not taken
    assert text == (f"another servestack run holds {state_dir}/lock: run run-A from ctl:1, "
                    "started 2026-12-01T10:00:00Z")


def test_lock_of_a_rebooted_host_is_stale(tmp_path):
    state = tmp_path / "state"
    sh(take_lock_command(str(state), "run-A", "ctl:1", "T"))
    lock = state / "lock"
    lock.write_text(lock.read_text().replace('"boot_id": "', '"boot_id": "before-reboot-'))
    assert not parse_lock(sh(lock_read_command(str(state))).stdout.splitlines()).alive


def test_doctor_report_json_has_stable_names():
    report = report_for("h1", settings(), facts(gpu=blackwell(cap="9.0")), None)
    data = json.loads(render_json({"h1": report}))
    assert data["ok"] is False
    assert list(data["hosts"]["h1"]["checks"]) == ["settings", "connect", *CHECKS]
    assert data["hosts"]["h1"]["checks"]["compute_capability"]["status"] == "fail"


def test_lock_of_a_dead_connection_is_alive_while_its_installer_runs(tmp_path):
    state = tmp_path / "state"
    sh(take_lock_command(str(state), "run-A", "ctl:1", "T"))
    lock = state / "lock"
    lock.write_text(lock.read_text().replace('"pid": null', '"pid": 4194304'))
    with flock_held(Path(f"{lock}.busy")):
        found = parse_lock(sh(lock_read_command(str(state))).stdout.splitlines())
        assert found.alive and found.why == "busy"
        assert "still running on the host" in found.why_alive()
        assert sh(take_lock_command(str(state), "run-B", "ctl:2", "T")).returncode == 3
    assert not parse_lock(sh(lock_read_command(str(state))).stdout.splitlines()).alive


# --- what preflight reads, and how -------------------------------------------------------------


def _df_counting_path(tmp_path: Path, fail_batches: bool = False) -> dict:
    """PATH with a `df` wrapper that logs each call (and, with fail_batches, fails for 2+ paths)."""
    real_df = subprocess.run(["sh", "-c", "command -v df"], capture_output=True, text=True).stdout.strip()
    wrapper = tmp_path / "bin" / "df"
    wrapper.parent.mkdir()
    batch = '[ "$#" -gt 3 ] && exit 1\n' if fail_batches else ""
    wrapper.write_text(f"#!/bin/sh\necho called >> {tmp_path}/df.log\n{batch}exec {real_df} \"$@\"\n")
    wrapper.chmod(0o755)
    return {**os.environ, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}


def test_free_space_of_every_path_is_one_df_call(tmp_path):
    paths = (str(tmp_path / "missing" / "deeper"), str(tmp_path), "/")
    env = _df_counting_path(tmp_path)
    out = subprocess.run(["sh", "-c", disk_command(paths)], capture_output=True, text=True, env=env).stdout
    disks = parse_disks(out.splitlines())
    assert (tmp_path / "df.log").read_text().count("called") == 1
    assert set(disks) == set(paths) and all(disk is not None and disk.size > 0 for disk in disks.values())
    assert disks[paths[0]].mount == disks[paths[1]].mount  # a missing path counts as its nearest parent


def test_free_space_falls_back_to_one_df_per_path_when_the_single_call_fails(tmp_path):
    paths = (str(tmp_path / "missing"), "/")
    env = _df_counting_path(tmp_path, fail_batches=True)
    out = subprocess.run(["sh", "-c", disk_command(paths)], capture_output=True, text=True, env=env).stdout
    disks = parse_disks(out.splitlines())
    assert (tmp_path / "df.log").read_text().count("called") == 3
    assert set(disks) == set(paths) and all(disk is not None for disk in disks.values())
    assert parse_disks(["diskpath /a", "diskpath /b", "dfall", "Mounted on Avail 1B-blocks", "/ 1 2"]) == {
        "/a": Disk("/a", "/", 1, 2), "/b": None}


def test_preflight_reads_the_toolkits_as_the_toolkit_steps_own_fact():
    s = settings()
    requests = host_reads(s)
    assert FactRequest.of(CudaToolkits, **toolkit_fact_arguments(s)) in requests
    toolkit_section = toolkits_command(s.cuda_install_path, kept_paths(s), "/usr/local/cuda", s.servestack_state_dir,
                                       tuple(runfile_candidates(s)))
    assert [request.cls for request in requests if toolkit_section in request.command()] == [CudaToolkits]


def test_the_lock_names_its_sshd_session_and_takes_and_releases_without_helper_programs(tmp_path):
    """The owner is the nearest ancestor named sshd (here a copy of sh named so), with its start
    time from /proc; on a converged host (state dir there, no lock) taking and releasing the lock
    start no program but flock and mv (each program costs every host CPU on every converge)."""
    state = tmp_path / "state"
    state.mkdir()
    bin_dir, log = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    for name in ("sed", "cut", "cat", "head", "tr", "mkdir", "date", "flock", "mv", "rm"):
        real = shutil.which(name)
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {log}\nexec {real} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    fake_sshd = tmp_path / "sshd"
    shutil.copy(os.path.realpath(shutil.which("sh")), fake_sshd)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    # the fake sshd runs the take in a child shell (a second command keeps it from exec'ing it)
    run = subprocess.run([str(fake_sshd), "-c", 'sh -c "$1"; echo "sshd $$"', "sshd",
                          take_lock_command(str(state), "run-A", "ctl:1", "T")],
                         capture_output=True, text=True, env=env)
    assert run.stdout.startswith("taken\n"), run.stderr
    sshd_pid = int(run.stdout.split("sshd ")[1])
    lock = json.loads((state / "lock").read_text())
    assert lock["pid"] == sshd_pid and lock["owner_start"].isdigit()
    assert lock["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    released = subprocess.run(["sh", "-c", release_lock_command(str(state), "run-A")],
                              capture_output=True, text=True, env=env)
    assert released.stdout == "released\n"
    assert sorted(log.read_text().split()) == ["flock", "flock", "mv", "rm"]


# --- the runfile's digest: read by preflight only when an install is due, reused by the toolkit step ---


def _digest_commands(state) -> list[str]:
    return [c for c in state.inventory.get_host("@fake/gpu1").connector.executed_commands if "md5sum" in c]


def _read_then_toolkit(seen: dict):
    @deploy("preflight's read, then the toolkit step")
    def read_then_toolkit():
        seen["facts"] = read_preflight(host, host_settings(host))
        runfile_toolkit(name="toolkit")
    return read_then_toolkit


def test_preflight_reads_the_runfile_digest_and_the_toolkit_step_reuses_that_read(host_lab):  # noqa: F811 (a fixture)
    root, data = host_lab
    staged = root / "srv" / "x.run"
    staged.parent.mkdir()
    staged.write_bytes((root / "served.run").read_bytes())
    seen: dict = {}
    state = fake_state({**data, "cuda_runfile_path": str(staged)})
    add_deploy(state, _read_then_toolkit(seen))
    digest = seen["facts"].runfile_digest
    assert (digest.path, digest.md5) == (str(staged), hashlib.md5(staged.read_bytes()).hexdigest())
    assert len(_digest_commands(state)) == 1                  # preflight's read, reused by the step
    assert by_name(evaluate(host_settings_of(state), seen["facts"]))["runfile"].detail == (
        f"pre-staged at {staged}: verified (size, md5, sha256)")


def test_preflight_reads_no_digest_without_a_file_to_check_or_an_install_to_make(host_lab):  # noqa: F811 (a fixture)
    root, data = host_lab
    seen: dict = {}
    fresh = fake_state(data)                                  # nothing cached yet: a download is planned
    add_deploy(fresh, _read_then_toolkit(seen))
    assert seen["facts"].runfile_digest is None and not _digest_commands(fresh)
    write_toolkit_tree(root / "cuda-13.0", "13.0.1", "13.0.88")   # installed: no runfile needed at all
    (root / "cache").mkdir()
    (root / "cache" / "cuda_13.0.1_580.82.07_linux.run").write_bytes((root / "served.run").read_bytes())
    converged = fake_state(data)
    add_deploy(converged, _read_then_toolkit(seen))
    assert seen["facts"].runfile_digest is None and not _digest_commands(converged)


def host_settings_of(state):
    return host_settings(state.inventory.get_host("@fake/gpu1"))


def test_a_service_user_that_cannot_be_created_is_refused_before_any_change():
    """pyinfra's server.user stops with "useradd is not installed" in the service step, after the toolkit and
    the venv changed; preflight names it first, with the other problems."""
    def service_check(account: dict, useradd: bool):
        read = facts()
        with_service = PreflightFacts(gpu=read.gpu, disks=read.disks, lock=read.lock, toolkit=read.toolkit,
                                      service=(True, {"SystemdRunning": "yes"}, account, useradd))
        return by_name(evaluate(settings(), with_service, "run-1"))["service"]

    missing = service_check({}, useradd=False)
    assert missing.status == "fail" and missing.problems == (
        "'service_user': sglang does not exist and cannot be created: useradd (the passwd package) is not on the "
        "host; install it, or create the user as a system user beforehand",)
    existing = {"sglang": {"uid": 998, "home": "/var/lib/sglang", "shell": "/usr/sbin/nologin"}}
    assert service_check(existing, useradd=False).status == "ok"
    assert service_check({}, useradd=True).status == "ok"
