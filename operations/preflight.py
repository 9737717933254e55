"""Step `preflight`: refuse a host before anything changes on it, then hold its lock for the run.

Checks (stable names, shared with `servestack doctor`): driver, gpus, compute_capability, serving
(the served model's quantization loads on these GPUs), arch, install_path, runfile, disk, lock, link,
kept_toolkits, service, judged by `evaluate` from what
`read_preflight` reads (the GPUs, free disk, the lock and the toolkits; when an install is due, the
digest of the runfile it would use). Any failed check refuses the host, one line per problem naming
it: a pre-staged runfile (`cuda_runfile_path`) that fails its size or checksums is refused here,
before any step changes anything.

- `preflight(reads, decides)` runs the checks while pyinfra prepares the deploy (with or without
  -y, and so in `--dry`): a refused host is marked failed before any operation runs on it; other
  hosts go on (pyinfra's --fail-percent applies; a refused host makes the exit status 1). What the
  steps will read (`reads`, deploy.py's `host_reads`) is read here in the same remote command;
  under -y only what the deploy functions decide from (`decides`): pyinfra runs no operation then.
- `lock(reads)`: in the execute stage, takes the host's lock (files/scripts/lock.sh; it creates
  servestack's state directory if missing), then reads `reads` in one remote command, under the
  lock, and runs the checks again on what it read. The steps read from there
  (servestack/reads.py), and again once something changed.

The lock is run bookkeeping, not host state: taking and releasing it is not reported as a change,
so a converged host still shows zero changes. `release_lock()` runs last in deploy.py; a host that
fails midway has its lock released by a state callback at once; if the control machine itself
dies, its SSH connection closes and the next run finds the lock stale and replaces it (saying so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from packaging.version import InvalidVersion, Version
from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Which

from facts.batch import FactRequest
from facts.gpu import GpuReport, NvidiaGpus
from facts.framing import split
from facts.host import DiskSpace, HostLock, LockState, found_lock, release_lock_command, take_lock_command
from facts.preflight import PreflightFacts
from facts.toolkit import CudaToolkits, RunfileDigest, ToolkitState, toolkit_fact_arguments
from operations import service
from operations.toolkit import (
    assess_install,
    digest_problem,
    human_bytes,
    link_line,
    prestaged_problem,
    read_runfile_digest,
    runfile_to_verify,
)
from servestack import reads
from servestack.checks.gpus import GpuExpectation
from servestack.hostrun import (
    REFUSED,
    controller_id,
    fail_host,
    is_executing,
    lock_released,
    noop,
    refuse,
    release_lock_on_failure,
    run_id,
    run_remote,
    run_started,
)
from servestack.paths import kept_paths, lock_path, runfile_source
from servestack.releases import Release
from servestack.settings import Settings, host_settings

CHECKS = ("driver", "gpus", "compute_capability", "serving", "arch", "install_path", "runfile", "disk",
          "lock", "link", "kept_toolkits", "service")


@dataclass(frozen=True)
class CheckResult:
    """One check's result: status is "ok", "warn" (reported, not refused), "fail" or "skip"."""

    name: str
    status: str
    detail: str
    problems: tuple[str, ...] = ()


def _ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "ok", detail)


def _fail(name: str, *problems: str) -> CheckResult:
    return CheckResult(name, "fail", "; ".join(problems), tuple(problems))


def host_reads(settings: Settings, release=None) -> list[FactRequest]:
    """What preflight reads: the GPUs, free disk where the install writes, the toolkits (the toolkit
    step's own fact, with its arguments) and the lock; not the lock with `release` (the read under
    the lock, which this run has just taken)."""
    return _checked_reads(settings) + ([] if release is not None else [_lock_read(settings)])


def _checked_reads(settings: Settings) -> list[FactRequest]:
    return [FactRequest.of(NvidiaGpus),
            FactRequest.of(DiskSpace,
                           paths=(settings.cuda_cache_dir, settings.cuda_tmpdir, settings.cuda_install_path)),
            FactRequest.of(CudaToolkits, **toolkit_fact_arguments(settings)),
            *service.service_host_reads(settings),
            FactRequest.of(Which, command="useradd")]


def _lock_read(settings: Settings) -> FactRequest:
    return FactRequest.of(HostLock, state_dir=settings.servestack_state_dir)


def read_preflight(host_, settings: Settings, also: Sequence[FactRequest] = (), digest: bool = True,
                   lock: LockState | None = None) -> PreflightFacts:
    """Everything the checks judge, read with `also` in one remote command; then, with `digest`, the
    runfile's md5 and sha256 when an install is due and a full-size runfile is there to check (a
    command of its own; the toolkit step reuses that read in this stage). `lock`: the lock as the
    caller has just taken it (not read)."""
    own = _checked_reads(settings) + ([] if lock else [_lock_read(settings)])
    values = reads.read(host_, [*own, *also])[:len(own)]
    toolkit = values[2]
    runfile_digest = read_runfile_digest(host_, settings, toolkit) if digest and toolkit else None
    return preflight_facts(values, lock, runfile_digest)


def preflight_facts(values: Sequence, lock: LockState | None = None, runfile_digest=None) -> PreflightFacts:
    """The values of `host_reads` (in its order; the lock last, unless `lock` is the one just taken) as
    what the checks judge; `runfile_digest`: the value of `digest_read`, where there is one."""
    gpu, disks, toolkit, curl, unit_state, account, useradd, *read_lock = values
    return PreflightFacts(gpu=gpu, disks=disks, lock=lock or read_lock[0], toolkit=toolkit,
                          runfile_digest=runfile_digest,
                          service=(bool(curl), unit_state or {}, account or {}, bool(useradd)))


def digest_read(settings: Settings, toolkit: ToolkitState | None) -> FactRequest | None:
    """The runfile digest the checks need (an install is due and a full-size runfile is there), or None."""
    path = runfile_to_verify(settings, toolkit) if toolkit else None
    return FactRequest.of(RunfileDigest, path=path) if path else None


def check_driver(settings: Settings, gpu: GpuReport) -> CheckResult:
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


def check_gpus(settings: Settings, gpu: GpuReport) -> CheckResult:
    if gpu.error:
        return _fail("gpus", gpu.error)
    if not gpu.gpus:
        return _fail("gpus", "no GPU visible")
    if GpuExpectation.of(settings).count_differs(gpu):
        return _fail("gpus", f"{len(gpu.gpus)} GPUs visible, expected {settings.gpu_count} (gpu_count)")
    names = sorted({g.name for g in gpu.gpus})
    return _ok("gpus", f"{len(gpu.gpus)} x {', '.join(names)}")


def check_compute_capability(settings: Settings, gpu: GpuReport) -> CheckResult:
    want = settings.gpu_compute_capability
    if not gpu.gpus:
        return CheckResult("compute_capability", "skip", "no GPU to check")
    differ = GpuExpectation.of(settings).other_capability(gpu)
    if differ:
        listed = ", ".join(f"{g.describe()} is {g.compute_cap}" for g in differ)
        return _fail("compute_capability",
                     f"{len(differ)} of {len(gpu.gpus)} GPUs are not compute capability {want} "
                     f"(gpu_compute_capability): {listed}")
    return _ok("compute_capability", f"all {len(gpu.gpus)} GPUs are {want}")


def check_serving(settings: Settings, gpu: GpuReport) -> CheckResult:
    """The served model's quantization on these GPUs: the stack's sglang refuses it at model load, after
    the restart, on a GPU older than the method needs (the manifest's [stacks.<name>.min_capability])."""
    method = settings.served_quantization
    needed = settings.stack.min_capability_of(method) if method else None
    if not gpu.gpus:
        return CheckResult("serving", "skip", "no GPU to check")
    if needed is None:
        return _ok("serving", f"{settings.service_model_path} needs no newer GPU ({method or 'not quantized'})")
    older = [g for g in gpu.gpus if g.capability is not None and g.capability < needed]
    if older:
        version = settings.package("sglang").version
        return _fail("serving", f"{len(older)} of {len(gpu.gpus)} GPUs cannot serve {settings.service_model_path} "
                                f"(profile {settings.service_profile!r}): sglang {version} ({settings.service_stack}) "
                                f"loads {method} only on compute capability {needed // 10}.{needed % 10} or newer, "
                                f"and {older[0].describe()} is {older[0].compute_cap}; serve it with a profile on a "
                                "stack that loads it on these GPUs (service_profile / service_stack)")
    return _ok("serving", f"sglang {settings.package('sglang').version} loads {method} on all {len(gpu.gpus)} GPUs")


def check_arch(settings: Settings, facts: PreflightFacts) -> CheckResult:
    runfiles = settings.manifest.runfiles
    if facts.arch not in runfiles:
        return _fail("arch", f"CPU architecture {facts.arch or 'unknown'} has no runfile in "
                             f"{settings.manifest.path.name} (it has {', '.join(sorted(runfiles))})")
    return _ok("arch", f"{facts.arch}: {runfiles[facts.arch].file}")


def disk_needs(settings: Settings, facts: PreflightFacts) -> list[tuple[str, int, str]]:
    """(path, bytes, what) this install needs; nothing when the toolkit is already there."""
    toolkit = _toolkit(facts)
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


def check_disk(settings: Settings, facts: PreflightFacts) -> CheckResult:
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


def check_runfile(settings: Settings, facts: PreflightFacts) -> CheckResult:
    """The runfile the install would use: a pre-staged one must verify (size, md5, sha256) or the host
    is refused; a cached one that fails is reported (the toolkit step moves it aside and fetches again).
    Without a digest (not read: no full-size file, or preflight at execute) the install verifies it."""
    toolkit, digest = _toolkit(facts), facts.runfile_digest
    if not assess_install(settings, toolkit.install, toolkit.marker).install_needed:
        return _ok("runfile", "not needed")
    source = runfile_source(settings, facts.arch)
    if source is None:
        return CheckResult("runfile", "skip", "no runfile for this architecture")
    if source.mode == "prestaged":
        if digest is None and toolkit.files.get(source.cached) is not None:
            return _ok("runfile", f"pre-staged at {source.cached} (verified before use)")
        problem = prestaged_problem(source, toolkit.files, digest)
        if problem:
            return _fail("runfile", problem)
        return _ok("runfile", f"pre-staged at {source.cached}: verified (size, md5, sha256)")
    cached = toolkit.files.get(source.cached)
    if cached is not None and cached.size == source.runfile.size:
        if digest is None:
            return _ok("runfile", f"cached at {source.cached} (verified before use)")
        problem = digest_problem(source.runfile, digest)
        if problem:
            fetch = "uploaded" if source.mode == "controller" else "downloaded"
            return CheckResult("runfile", "warn", f"cached runfile {source.cached} fails verification ({problem}): "
                                                  f"moved aside and {fetch} again")
        return _ok("runfile", f"cached at {source.cached}: verified (size, md5, sha256)")
    if source.mode == "controller":
        return _ok("runfile", f"uploaded from the control machine (downloaded there from {source.runfile.url})")
    return _ok("runfile", f"downloaded from {source.runfile.url}")


def check_lock(settings: Settings, facts: PreflightFacts, run: str | None) -> CheckResult:
    lock, path = facts.lock, lock_path(settings.servestack_state_dir)
    if not lock.present:
        return _ok("lock", "free")
    if run and lock.run_id == run:
        return _ok("lock", "held by this run")
    if lock.alive:
        return _fail("lock", f"another servestack run holds {path}: {lock.describe()}; {lock.why_alive()}. "
                             "Wait for it to finish (remove the file only if you are sure it is gone)")
    interrupted = f", interrupted during {lock.doing()}" if lock.doing() else ""
    gone = ("the host rebooted since: that run and every step it started are gone" if lock.rebooted
            else "its connection is gone")
    return CheckResult("lock", "warn", f"the previous run did not finish on this host: stale lock in {path} "
                                       f"({lock.describe()}{interrupted}; {gone}): replaced when this run takes "
                                       "the lock")


def check_link(settings: Settings, facts: PreflightFacts) -> CheckResult:
    chain = _toolkit(facts).link
    if settings.cuda_link_policy == "new" and chain.kind in ("directory", "file"):
        return _fail("link", f"cuda_link_policy = 'new' but {chain.path} is a {chain.kind}, not a symlink: "
                             "servestack will not replace it")
    return _ok("link", link_line(settings, chain)[0])


def check_kept(settings: Settings, facts: PreflightFacts) -> CheckResult:
    missing = [path for path in kept_paths(settings) if not _toolkit(facts).kept.get(path)]
    if missing:
        return CheckResult("kept_toolkits", "warn", f"not on the host (nothing to protect): {', '.join(missing)}")
    return _ok("kept_toolkits", ", ".join(kept_paths(settings)) or "none")


def check_install_path(settings: Settings, facts: PreflightFacts) -> CheckResult:
    toolkit = _toolkit(facts)
    verdict = assess_install(settings, toolkit.install, toolkit.marker)
    if verdict.refused:
        return _fail("install_path", verdict.detail)
    if verdict.install_needed:
        return _ok("install_path", f"{verdict.detail}: install {settings.cuda_version} there")
    return _ok("install_path", verdict.detail)


def check_service(settings: Settings, facts: PreflightFacts) -> CheckResult:
    """What would stop the service step after the toolkit and the venv changed: no systemd, no curl for
    the health gate, a service user that is someone's login or that cannot be created."""
    if not facts.service:
        return CheckResult("service", "skip", "not read")
    curl, unit_state, account, useradd = facts.service
    problems = service.unit_host_problems(settings, curl, unit_state)
    login = service.login_user_problem(settings, account)
    uncreatable = user_creation_problem(settings, account, useradd)
    problems += [problem for problem in (login, uncreatable) if problem]
    if problems:
        return _fail("service", *problems)
    return _ok("service", f"systemd runs the host, curl is there, {settings.service_user} can be its user")


def user_creation_problem(settings: Settings, account: dict, useradd: bool) -> str | None:
    """The service step creates its user with pyinfra's server.user, which runs useradd on Linux and stops
    with "useradd is not installed" where there is none: after the toolkit and the venv changed."""
    if account.get(settings.service_user) or useradd:
        return None
    return (f"'service_user': {settings.service_user} does not exist and cannot be created: useradd (the "
            "passwd package) is not on the host; install it, or create the user as a system user beforehand")


def _toolkit(facts: PreflightFacts) -> ToolkitState:
    if facts.toolkit is None:
        raise ValueError("the toolkit checks need the toolkits read: evaluate refuses a host without them")
    return facts.toolkit


def evaluate(settings: Settings, facts: PreflightFacts, run: str | None = None) -> list[CheckResult]:
    """Every check, in CHECKS order. Checks that need a known architecture are skipped without one;
    without the toolkits read, install_path fails and the checks that judge them are skipped."""
    checks = [check_driver(settings, facts.gpu), check_gpus(settings, facts.gpu),
              check_compute_capability(settings, facts.gpu), check_serving(settings, facts.gpu),
              check_arch(settings, facts)]
    if facts.toolkit is None:
        unread = "the toolkits were not read"
        return checks + [_fail("install_path", f"cannot read the CUDA toolkits on the host "
                                               f"({settings.cuda_install_path}, its link and the runfile): "
                                               "run again; if it persists, run servestack doctor"),
                         *(CheckResult(name, "skip", unread) for name in ("runfile", "disk")),
                         check_lock(settings, facts, run),
                         *(CheckResult(name, "skip", unread) for name in ("link", "kept_toolkits")),
                         check_service(settings, facts)]
    arch_known = checks[-1].status == "ok"
    checks.append(check_install_path(settings, facts))
    if arch_known:
        checks += [check_runfile(settings, facts), check_disk(settings, facts)]
    else:
        checks += [CheckResult(name, "skip", "unknown architecture") for name in ("runfile", "disk")]
    checks += [check_lock(settings, facts, run), check_link(settings, facts), check_kept(settings, facts),
               check_service(settings, facts)]
    return checks


def problems_of(checks: list[CheckResult]) -> list[str]:
    return [problem for check in checks if check.status == "fail" for problem in check.problems]


def _take_lock(settings: Settings) -> tuple[bool, str]:
    """Take the host lock for this run now: (taken, what happened, for the log or the refusal)."""
    state = host.state
    command = take_lock_command(settings.servestack_state_dir, run_id(state), controller_id(), run_started(state))
    ok, stdout, stderr = run_remote(host, command)
    path = lock_path(settings.servestack_state_dir)
    found = split(stdout)
    if "held" in found:
        return False, f"another servestack run holds {path}: {found_lock(found['held']).describe()}"
    if not ok:
        return False, f"cannot take {path}: {' '.join(stderr) or 'unknown error'}"
    if "stale" not in found:
        return True, f"lock {path} held by run {run_id(state)}"
    stale = found_lock(found["stale"], found.get("activity"))
    during = f"; it was interrupted during {stale.doing()}" if stale.doing() else ""
    return True, f"lock {path} held by run {run_id(state)} (replaced a stale lock: {stale.describe()}{during})"


def held_by(state) -> LockState:
    """The lock as this run holds it once its take succeeded."""
    return LockState(present=True, alive=True, info={"run_id": run_id(state)})


@operation()
def host_locked(reads: tuple[FactRequest, ...] = ()):
    """
    Take this host's lock for the run, then read the host once and check it again. Never a change.

    + reads: what the steps will read (deploy.py's ``host_reads``), read right after the take
    """
    settings = host_settings(host)
    if not is_executing(host):
        read_preflight(host, settings, list(reads))
        noop(host, "the host's lock is taken when the run starts")
        return
    taken, what = _take_lock(settings)
    if not taken:
        yield from refuse(host, [what])
        return
    release_lock_on_failure(host, release_lock_command(settings.servestack_state_dir, run_id(host.state)))
    if "stale" in what:
        host.log(what)
    # no digest here: preflight verified the runfile at prepare, and the install verifies it before use
    facts = read_preflight(host, settings, list(reads), digest=False, lock=held_by(host.state))
    problems = problems_of(evaluate(settings, facts, run_id(host.state)))
    if problems:
        yield from refuse(host, problems)
        return
    noop(host, f"preflight passed; {what}")


@operation()
def lock_free():
    """
    Release this run's host lock (taken by ``host_locked``). Never reports a change.
    """
    settings = host_settings(host)
    if not is_executing(host):
        noop(host, "the lock is released at the end of the run")
        return
    ok, stdout, stderr = run_remote(host, release_lock_command(settings.servestack_state_dir, run_id(host.state)))
    lock_released(host)
    if not ok:
        host.log(f"could not release {lock_path(settings.servestack_state_dir)}: {' '.join(stderr)}")
    noop(host, "lock released" if "released" in stdout else "lock was not held by this run")
    yield from ()


@deploy("Preflight")
def preflight(reads: Sequence[FactRequest] = (), decides: Sequence[FactRequest] = ()) -> bool:
    """Check the host, refusing it on any problem. Returns False for a refused host.

    + reads: what the steps will read (deploy.py's ``host_reads``), read with preflight's own facts
      when pyinfra runs every operation while it prepares (to show its change: --dry, or no -y)
    + decides: what deploy.py's deploy functions decide from; all that is read with preflight's
      own facts under -y, where pyinfra runs no operation before the execute stage

    The checks run here, while pyinfra prepares the deploy (also with -y, which skips change
    detection), so a refused host runs no operation at all. ``locked_run`` skips the remaining steps
    of a refused host.
    """
    settings = host_settings(host)
    wanted = reads if host.state.should_check_for_changes() else decides
    checks = evaluate(settings, read_preflight(host, settings, list(wanted)), run_id(host.state))
    problems = problems_of(checks)
    if problems:
        return fail_host(host, REFUSED, problems)
    for check in checks:
        if check.status == "warn":
            host.log(f"preflight {check.name}: {check.detail}")
    return True


@deploy("Lock")
def lock(reads: Sequence[FactRequest] = ()):
    """Take the host's lock for the run and read the host once, under it (call after planning).

    + reads: what the steps will read (deploy.py's ``host_reads``, with the planned release)
    """
    host_locked(name="host lock and preflight checks", reads=tuple(reads))


@deploy("Release lock")
def release_lock():
    """Release the host lock; call last in deploy.py."""
    lock_free(name="release the host lock")


Chosen = TypeVar("Chosen", bound=Release)


def locked_run(reads: Callable[..., Sequence[FactRequest]], decides: Sequence[FactRequest],
               choose: Callable[[], Chosen | None], steps: Callable[[Chosen], object]) -> None:
    """The one skeleton of a run that changes hosts (deploy.py, rollback.py): preflight, the
    release chosen, the host's lock, the steps, the lock released.

    + reads: what the steps read of the host, ``reads()`` before the release is chosen and
      ``reads(release)`` under the lock (deploy.py's ``host_reads``)
    + decides: what ``choose`` decides from (``preflight``'s ``decides``)
    + choose: the release this run works towards; None when it refused the host (the run stops there)
    + steps: the run's steps, given the chosen release (what one step decides is the next one's argument)
    """
    if not preflight(reads=reads(), decides=decides):
        return
    release = choose()
    if release is None:
        return
    lock(reads=reads(release))
    steps(release)
    release_lock()
