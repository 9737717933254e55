"""Step `preflight`: refuse a host before anything changes on it, then hold its lock for the run.

Checks (stable names, shared with `servestack doctor`): driver, gpus, compute_capability, arch,
install_path, runfile, disk, lock, link, kept_toolkits. They are read from one fact
(facts.preflight.HostPreflight) and judged by `evaluate`. Any failed check refuses the host, one
line per problem naming the host:

- `preflight()` runs the checks while pyinfra prepares the deploy (with or without -y, and so in
  `--dry`): a refused host is marked failed before any operation runs on it, not even `base`;
  other hosts go on (pyinfra's --fail-percent applies; a refused host makes the exit status 1);
- in the execute stage `host_ready` runs the checks again, then takes the lock atomically. The
  execute stage starts from what prepare read (servestack/probe.py); when the lock's generation
  shows that another run took the lock since, every read is dropped and the checks run again.

The lock (`<servestack_state_dir>/lock`, see facts/host.py) is run bookkeeping, not host state:
taking and releasing it is not reported as a change, so a converged host still shows zero
changes. `release_lock()` runs last in deploy.py; a host that fails midway has its lock released
by a state callback at once; if the control machine itself dies, its SSH connection closes, the
lock's owner process on the host exits with it, and the next run finds the lock stale and
replaces it (saying so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from packaging.version import InvalidVersion, Version
from pyinfra import host
from pyinfra.api import deploy, operation

from facts.gpu import GpuReport
from facts.host import lock_path, parse_generation, release_lock_command, take_lock_command
from facts.preflight import HostPreflight, PreflightFacts
from facts.probe import FactRequest
from facts.toolkit import CudaToolkits, parse_toolkits
from operations.toolkit import (
    assess_install,
    human_bytes,
    kept_paths,
    link_line,
    runfile_candidates,
    runfile_source,
    toolkit_fact_arguments,
)
from servestack import probe
from servestack.hostrun import (
    controller_id,
    is_executing,
    kept_with_release,
    noop,
    refusal,
    refuse_now,
    release_lock_on_failure,
    report_kept,
    run_id,
    run_remote,
    run_started,
)
from servestack.settings import Settings, host_settings

CHECKS = ("driver", "gpus", "compute_capability", "arch", "install_path", "runfile", "disk", "lock",
          "link", "kept_toolkits")


@dataclass(frozen=True)
class Check:
    """One check's result: status is "ok", "warn" (reported, not refused), "fail" or "skip"."""

    name: str
    status: str
    detail: str
    problems: tuple[str, ...] = ()


def _ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def _fail(name: str, *problems: str) -> Check:
    return Check(name, "fail", "; ".join(problems), tuple(problems))


def preflight_fact_arguments(settings: Settings, toolkit: bool = False) -> dict:
    """HostPreflight's arguments; the deploy reads the toolkits as the toolkit step's own fact
    (`preflight_requests`), `servestack doctor` asks for them here (`toolkit=True`)."""
    return {
        "state_dir": settings.servestack_state_dir,
        "install_path": settings.cuda_install_path,
        "keep_paths": kept_paths(settings),
        "link_path": settings.manifest.cuda["link_path"],
        "files": runfile_candidates(settings),
        "disk_paths": (settings.cuda_cache_dir, settings.cuda_tmpdir, settings.cuda_install_path),
        "toolkit": toolkit,
    }


def preflight_requests(settings: Settings) -> list[FactRequest]:
    """What preflight reads: HostPreflight without its toolkit section, and the toolkit step's fact
    (read once in the run: the execute stage starts from it until a step changes the toolkits)."""
    return [FactRequest.of(HostPreflight, **preflight_fact_arguments(settings)),
            FactRequest.of(CudaToolkits, **toolkit_fact_arguments(settings))]


@probe.expects
def _expected_facts(host_) -> list[FactRequest]:
    return preflight_requests(host_settings(host_))


probe.decides(HostPreflight, CudaToolkits)  # preflight() returns whether the host may go on


def check_driver(settings: Settings, gpu: GpuReport) -> Check:
    minimum = settings.manifest.cuda["min_driver"]
    if gpu.driver_version is None:
        return _fail("driver", f"no NVIDIA driver answers ({gpu.error or 'unknown'}); CUDA "
                               f"{settings.cuda_version} needs driver >= {minimum}")
    try:
        too_old = Version(gpu.driver_version) < Version(minimum)
    except InvalidVersion:
        return _fail("driver", f"cannot read the driver version {gpu.driver_version!r}")
    if too_old:
        return _fail("driver", f"NVIDIA driver {gpu.driver_version} is older than {minimum}, the minimum for "
                               f"CUDA {settings.cuda_version}: upgrade the driver first (servestack never "
                               "installs drivers)")
    return _ok("driver", f"{gpu.driver_version} >= {minimum}")


def check_gpus(settings: Settings, gpu: GpuReport) -> Check:
    if gpu.error:
        return _fail("gpus", gpu.error)
    if not gpu.gpus:
        return _fail("gpus", "no GPU visible")
    if len(gpu.gpus) != settings.gpu_count:
        return _fail("gpus", f"{len(gpu.gpus)} GPUs visible, expected {settings.gpu_count} (gpu_count)")
    names = sorted({g.name for g in gpu.gpus})
    return _ok("gpus", f"{len(gpu.gpus)} x {', '.join(names)}")


def _capability(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.strip().split("."))
    except ValueError:
        return None


def check_compute_capability(settings: Settings, gpu: GpuReport) -> Check:
    want = settings.gpu_compute_capability
    if not gpu.gpus:
        return Check("compute_capability", "skip", "no GPU to check")
    differ = [g for g in gpu.gpus if _capability(g.compute_cap) != _capability(want)]
    if differ:
        listed = ", ".join(f"{g.describe()} is {g.compute_cap}" for g in differ)
        return _fail("compute_capability",
                     f"{len(differ)} of {len(gpu.gpus)} GPUs are not compute capability {want} "
                     f"(gpu_compute_capability): {listed}")
    return _ok("compute_capability", f"all {len(gpu.gpus)} GPUs are {want}")


def check_arch(settings: Settings, facts: PreflightFacts) -> Check:
    runfiles = settings.manifest.runfiles
    if facts.arch not in runfiles:
        return _fail("arch", f"CPU architecture {facts.arch or 'unknown'} has no runfile in "
                             f"{settings.manifest.path.name} (it has {', '.join(sorted(runfiles))})")
    return _ok("arch", f"{facts.arch}: {runfiles[facts.arch].file}")


def disk_needs(settings: Settings, facts: PreflightFacts) -> list[tuple[str, int, str]]:
    """(path, bytes, what) this install needs; nothing when the toolkit is already there."""
    toolkit = facts.toolkit
    if not assess_install(settings, toolkit.install, toolkit.marker).install_needed:
        return []
    cuda = settings.manifest.cuda
    needs = [(settings.cuda_tmpdir, cuda["extract_bytes"], "extraction"),
             (settings.cuda_install_path, cuda["install_bytes"], "toolkit")]
    source = runfile_source(settings, facts.arch)
    if source is not None and source.mode != "prestaged":
        cached, part = toolkit.files.get(source.cached), toolkit.files.get(source.part)
        have = cached.size if cached and cached.size == source.runfile.size else (part.size if part else 0)
        missing = max(source.runfile.size - have, 0)
        if missing:
            needs.insert(0, (settings.cuda_cache_dir, missing, "runfile"))
    return needs


def check_disk(settings: Settings, facts: PreflightFacts) -> Check:
    needs = disk_needs(settings, facts)
    if not needs:
        return _ok("disk", "nothing to install")
    per_mount: dict[str, list] = {}
    problems = []
    for path, size, what in needs:
        disk = facts.disks.get(path)
        if disk is None:
            problems.append(f"cannot measure free space for {path}")
            continue
        per_mount.setdefault(disk.mount, [disk.avail, []])[1].append((path, size, what))
    for mount, (avail, items) in sorted(per_mount.items()):
        total = sum(size for _, size, _ in items)
        if total > avail:
            parts = ", ".join(f"{what} {human_bytes(size)} in {path}" for path, size, what in items)
            problems.append(f"not enough disk on {mount}: {human_bytes(avail)} free, {human_bytes(total)} "
                            f"needed ({parts})")
    if problems:
        return _fail("disk", *problems)
    return _ok("disk", "; ".join(f"{mount}: {human_bytes(avail)} free, {human_bytes(sum(s for _, s, _ in items))} "
                                 f"needed" for mount, (avail, items) in sorted(per_mount.items())))


def check_runfile(settings: Settings, facts: PreflightFacts) -> Check:
    toolkit = facts.toolkit
    if not assess_install(settings, toolkit.install, toolkit.marker).install_needed:
        return _ok("runfile", "not needed")
    source = runfile_source(settings, facts.arch)
    if source is None:
        return Check("runfile", "skip", "no runfile for this architecture")
    if source.mode == "prestaged":
        if toolkit.files.get(source.cached) is None:
            return _fail("runfile", f"cuda_runfile_path {source.cached}: no such file on the host")
        return _ok("runfile", f"pre-staged at {source.cached} (verified before use)")
    if source.mode == "controller":
        return _ok("runfile", f"uploaded from the control machine (downloaded there from {source.runfile.url})")
    cached = toolkit.files.get(source.cached)
    if cached is not None and cached.size == source.runfile.size:
        return _ok("runfile", f"cached at {source.cached} (verified before use)")
    return _ok("runfile", f"downloaded from {source.runfile.url}")


def check_lock(settings: Settings, facts: PreflightFacts, run: str | None) -> Check:
    lock, path = facts.lock, lock_path(settings.servestack_state_dir)
    if not lock.present:
        return _ok("lock", "free")
    if run and lock.run_id == run:
        return _ok("lock", "held by this run")
    if lock.alive:
        return _fail("lock", f"another servestack run holds {path}: {lock.describe()}; {lock.why_alive()}. "
                             "Wait for it to finish (remove the file only if you are sure it is gone)")
    return Check("lock", "warn", f"stale lock in {path} ({lock.describe()}; its connection is gone): "
                                 "replaced when a run starts")


def check_link(settings: Settings, facts: PreflightFacts) -> Check:
    chain = facts.toolkit.link
    if settings.cuda_link_policy == "new" and chain.kind in ("directory", "file"):
        return _fail("link", f"cuda_link_policy = 'new' but {chain.path} is a {chain.kind}, not a symlink: "
                             "servestack will not replace it")
    return _ok("link", link_line(settings, chain)[0])


def check_kept(settings: Settings, facts: PreflightFacts) -> Check:
    missing = [path for path in kept_paths(settings) if not facts.toolkit.kept.get(path)]
    if missing:
        return Check("kept_toolkits", "warn", f"not on the host (nothing to protect): {', '.join(missing)}")
    return _ok("kept_toolkits", ", ".join(kept_paths(settings)) or "none")


def check_install_path(settings: Settings, facts: PreflightFacts) -> Check:
    verdict = assess_install(settings, facts.toolkit.install, facts.toolkit.marker)
    if verdict.refused:
        return _fail("install_path", verdict.detail)
    if verdict.install_needed:
        return _ok("install_path", f"{verdict.detail}: install {settings.cuda_version} there")
    return _ok("install_path", verdict.detail)


def evaluate(settings: Settings, facts: PreflightFacts, run: str | None = None) -> list[Check]:
    """Every check, in CHECKS order. Checks that need a known architecture are skipped without one."""
    checks = [check_driver(settings, facts.gpu), check_gpus(settings, facts.gpu),
              check_compute_capability(settings, facts.gpu), check_arch(settings, facts)]
    arch_known = checks[-1].status == "ok"
    checks.append(check_install_path(settings, facts))
    if arch_known:
        checks += [check_runfile(settings, facts), check_disk(settings, facts)]
    else:
        checks += [Check("runfile", "skip", "unknown architecture"), Check("disk", "skip", "unknown architecture")]
    checks += [check_lock(settings, facts, run), check_link(settings, facts), check_kept(settings, facts)]
    return checks


def problems_of(checks: list[Check]) -> list[str]:
    return [problem for check in checks if check.status == "fail" for problem in check.problems]


@dataclass(frozen=True)
class LockTake:
    taken: bool
    what: str               # what happened, for the log or the refusal
    generation: int = 0     # lock.generation once taken
    ours: bool = False      # this run held it already


def _take_lock(settings: Settings) -> LockTake:
    """Take the host lock for this run now; the same remote command reads the host for the steps
    (probe.run_and_read_ahead), under the lock."""
    state = host.state
    command = take_lock_command(settings.servestack_state_dir, run_id(state), controller_id(), run_started(state))
    ok, stdout, stderr = probe.run_and_read_ahead(host, command)
    path = lock_path(settings.servestack_state_dir)
    held = [line[5:] for line in stdout if line.startswith("held ")]
    if held:
        return LockTake(False, f"another servestack run holds {path}: {held[0]}")
    if not ok:
        return LockTake(False, f"cannot take {path}: {' '.join(stderr) or 'unknown error'}")
    stale = [line[6:] for line in stdout if line.startswith("stale ")]
    note = f" (replaced a stale lock: {stale[0]})" if stale else ""
    generation = [parse_generation(line[11:]) for line in stdout if line.startswith("generation ")]
    return LockTake(True, f"lock {path} held by run {run_id(state)}{note}", (generation or [0])[0], "ours" in stdout)


def _read_before_another_run(take: LockTake, facts: PreflightFacts) -> bool:
    """Another run took the lock after `facts` were read (maybe in the prepare stage): what this run
    read of the host before now may be out of date."""
    return not take.ours and take.generation != facts.lock.generation + 1


def _read_facts(settings: Settings) -> PreflightFacts | None:
    facts, toolkits = probe.facts(host, preflight_requests(settings))
    if facts is None:
        return None
    return replace(facts, toolkit=toolkits or parse_toolkits(settings.cuda_install_path,
                                                             settings.manifest.cuda["link_path"], []))


@operation()
def host_ready():
    """
    Refuse this host if any preflight check fails; in the execute stage, take its lock.

    Reads the host data of servestack.settings; takes no arguments. Never reports a change.
    """
    settings = host_settings(host)
    facts = _read_facts(settings)
    checks = evaluate(settings, facts, run_id(host.state))
    problems = problems_of(checks)
    if problems:
        if is_executing(host):
            yield refusal(problems)
        else:
            refuse_now(host, problems)
        return
    for check in checks:
        if check.status == "warn":
            host.log(f"preflight {check.name}: {check.detail}")
    if not is_executing(host):
        noop(host, "preflight passed (" + "; ".join(f"{c.name}: {c.detail}" for c in checks if c.status == "ok") + ")")
        return
    take = _take_lock(settings)
    if not take.taken:
        yield refusal([take.what])
        return
    release_lock_on_failure(host, settings.servestack_state_dir)
    if "stale" in take.what:
        host.log(take.what)
    if _read_before_another_run(take, facts):
        probe.changed(host)  # every step reads the host afresh
        host.log(f"another run took the lock since this run read the host (lock generation "
                 f"{facts.lock.generation} -> {take.generation}): reading it again")
        problems = problems_of(evaluate(settings, _read_facts(settings), run_id(host.state)))
        if problems:
            yield refusal(problems)
            return
    noop(host, f"preflight passed; {take.what}")


@operation()
def lock_released():
    """
    Release this run's host lock (taken by `host_ready`). Never reports a change.
    """
    settings = host_settings(host)
    if not is_executing(host):
        noop(host, "the lock is released at the end of the run")
        return
    command, kept = kept_with_release(host, release_lock_command(settings.servestack_state_dir, run_id(host.state)))
    ok, stdout, stderr = run_remote(host, command)
    report_kept(host, stdout, stderr, kept)
    if not ok:
        host.log(f"could not release {lock_path(settings.servestack_state_dir)}: {' '.join(stderr)}")
    noop(host, "lock released" if "released" in stdout else "lock was not held by this run")
    yield from ()


@deploy("Preflight")
def preflight() -> bool:
    """Check the host, refusing it on any problem, and take its lock. Returns False for a refused host.

    The checks run here, while pyinfra prepares the deploy (also with -y, which skips change
    detection), so a refused host runs no operation at all, not even the ones before this.
    deploy.py skips the remaining steps of a refused host: `if preflight.preflight(): ...`.
    """
    settings = host_settings(host)
    problems = problems_of(evaluate(settings, _read_facts(settings), run_id(host.state)))
    if problems:
        refuse_now(host, problems)
        return False
    host_ready(name="preflight checks and host lock")
    return True


@deploy("Release lock")
def release_lock():
    """Release the host lock; call last in deploy.py."""
    lock_released(name="release the host lock")
