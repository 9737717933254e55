"""The ML environment (`venv_path`, default /opt/ml-env): backed up, rebuilt beside, switched, kept.

What deploy.py calls, in this order (with other steps between):

    release = venv.plan()     the release this run leaves active (read at prepare; later steps get it)
    venv.backup(release)      snapshot the active environment, only when this run is about to change it
    venv.build(release)       build the release beside the active one and check it; activates nothing
    venv.activate(release)    adopt a hand-made venv (first run), switch venv_path atomically, prune

and rollback.py: `release = venv.rollback_target()` (None: the host was refused, nothing to roll
back to), then `venv.rollback(release)`. Every operation reads the one MlEnvState fact
(`host_reads` lists it with the arguments they pass; a shell script, no Python on the host) and,
only when a change is due, the active environment's packages (ActivePackages) as well.

Building: one resolution, then an ordered install. `uv pip compile` resolves the stack once into
`lock.txt` (hashes for every file; see servestack/releases.py for the index/overrides design);
the lock is then installed in the documented order (torch, torchvision, torchaudio -> sglang ->
sgl-kernel -> flashinfer), each step its packages plus the dependencies they bring, with
`--no-deps --require-hashes` from the one index the lock names for them. Resolving once makes the
set coherent and hash-checked (a step-by-step resolution lets a later step re-resolve an earlier
one's choice, e.g. flashinfer back to 0.6.3, and cannot be hashed ahead); installing in order keeps
the documented sequence, and a failure names the step it stopped at. The release's own python
then checks it (torch version and local label, `torch.version.cuda`, every pin and every locked
version, `import flashinfer` with its own version check, `import sglang`) before it can become
active. A failed build leaves venv_path and the service untouched and keeps the release directory,
marked "failed" in its release.json, for inspection. uv is installed on the host at the
manifest's version from `uv_index_url`, and its cache sits beside the releases so a rebuild
hard-links files instead of downloading them again.
"""

from __future__ import annotations


from pyinfra import host, logger
from pyinfra.api import FunctionCommand, deploy, operation

from facts.batch import FactRequest
from facts.venv import ActivePackages, MlEnvState, tool_command, tool_result
from servestack import hostrun, reads, stack_hashes
from servestack.errors import ConfigError
from servestack.hostrun import FAILED, REFUSED, fail_host, note, noop, refuse, utc_stamp, while_busy
from servestack.paths import uv_binary, uv_cache_dir
from servestack.releases import (
    NoRollbackTarget, Release, ReleasePlan, canonical_name, format_diff, package_diff, release_at,
    release_plan, releases_to_prune,
)
from servestack.releases import rollback_target as choose_rollback_target
from servestack.serving import service_environment
from servestack.settings import host_settings


# --- reading the host ---------------------------------------------------------------------------

def mlenv_fact_arguments(settings) -> dict:
    return {"venv_path": settings.venv_path, "releases_dir": settings.venv_releases_dir,
            "state_dir": settings.servestack_state_dir, "python": settings.venv_python}


def host_reads(settings, release=None) -> list[FactRequest]:
    """What this step reads of a host before it decides: the MlEnvState fact (the active
    environment's packages, ActivePackages, are read only when a change is due)."""
    return [FactRequest.of(MlEnvState, **mlenv_fact_arguments(settings))]


def _no_python(settings) -> str:
    return (f"'{settings.venv_python}' (venv_python) is not on the host's PATH; servestack needs it to "
            "build the ML environment")


def env_state(settings) -> dict | None:
    """The MlEnvState fact (None: the host lacks venv_python)."""
    return reads.fact(host, MlEnvState, **mlenv_fact_arguments(settings))


def active_packages(settings) -> dict:
    """The ActivePackages fact: the active environment's python and packages ({} when none)."""
    return reads.fact(host, ActivePackages, venv_path=settings.venv_path, releases_dir=settings.venv_releases_dir,
                      python=settings.venv_python) or {}


def active_release(settings) -> Release | None:
    """The release venv_path points at now (None: missing, hand-made or foreign)."""
    release = ((env_state(settings) or {}).get("venv_path") or {}).get("release")
    return release_at(settings.venv_releases_dir, release) if release else None


def _plan(settings, state: dict) -> ReleasePlan:
    return release_plan(settings, state["machine"], state["python"]["version"])


def _params(settings, **extra) -> dict:
    return {"venv_path": settings.venv_path, "releases_dir": settings.venv_releases_dir,
            "state_dir": settings.servestack_state_dir, **extra}


def _environment(changes_it: bool = False) -> tuple:
    """(settings, the MlEnvState read, what keeps an operation from working on it: `env_problems`)."""
    settings = host_settings(host)
    state = env_state(settings)
    return settings, state, env_problems(settings, state, changes_it)


def env_problems(settings, state: dict | None, changes_it: bool = False) -> list[str]:
    """Why an operation cannot work on this host's environment: no python to run the tool, or
    (for an operation that changes venv_path) something at venv_path that is not a venv or link."""
    if state is None:
        return [_no_python(settings)]
    if changes_it and state["venv_path"]["kind"] == "other":
        return [_not_a_venv(settings)]
    return []


def _not_a_venv(settings) -> str:
    return (f"{settings.venv_path} (venv_path) exists but is not a venv (no pyvenv.cfg); servestack "
            "will not move or replace it: move it away and re-run")


def _environment_changes(state: dict, target: str) -> bool:
    where = state["venv_path"]
    return where["kind"] in ("venv", "link") and where["release"] != target


def _same_as_latest_backup(state: dict, active: dict) -> bool:
    latest, where = state.get("latest_backup"), state["venv_path"]
    if not latest:
        return False
    return latest.get("realpath") == where["realpath"] \
        and latest.get("packages") == active.get("packages") and latest.get("python") == active.get("python")


# --- operations ---------------------------------------------------------------------------------

@operation()
def backup_env(target: str, reason: str = "before change"):
    """
    Snapshot the environment at venv_path before this run changes it, keep the newest N.

    + target: the release this run will make active; no backup when it already is
    + reason: recorded in the snapshot

    The snapshot (`<servestack_state_dir>/backups/<UTC ts>.json`) holds every package with its exact
    version and local label, the Python version, the venv path and where it resolves. A converged
    host, a host without an environment, or an environment the newest snapshot already records
    writes nothing.
    """
    settings, state, problems = _environment()
    if problems:
        yield from refuse(host, problems)
        return
    where = state["venv_path"]
    if not _environment_changes(state, target):
        noop(host, f"{settings.venv_path} is "
             f"{'already ' + target if where['release'] == target else where['kind']}: nothing to back up")
        return
    if _same_as_latest_backup(state, active_packages(settings)):
        noop(host, f"backup {state['backups'][-1]} already records {settings.venv_path}")
        return
    yield tool_command(settings.venv_python, "backup",
                       _params(settings, keep=settings.venv_keep_backups, reason=reason))


@operation()
def build_release(release: ReleasePlan):
    """
    Build a release beside the active one and check it; venv_path is not touched.

    + release: the release to build (``venv.plan()``)

    The release id comes from the release's inputs, so a built release is never rebuilt. uv at the
    manifest's version is installed first if the host lacks it.
    """
    settings, state, problems = _environment(changes_it=True)  # refuse before spending time on a build
    if problems:
        yield from refuse(host, problems)
        return
    record = state["releases"].get(release.id) or {}
    if record.get("status") == "ok" and record.get("has_venv"):
        noop(host, f"release {release.id} is built and checked")
        return
    if record:
        host.log(f"Rebuilding release {release.id} (it was left {record.get('status')}: "
                 f"{record.get('error', 'no error recorded')})", logger.warning)
    fixed_path = stack_hashes.hashes_path(settings.stack_locks_dir, release.inputs)
    try:
        fixed = stack_hashes.read_fixed(fixed_path)
    except ConfigError as error:
        yield from refuse(host, [str(error)])
        return
    uv = settings.manifest.uv
    params = _params(settings, id=release.id, release_dir=release.dir, inputs=release.inputs,
                     files=release.files, steps=release.steps, bound=release.bound, expect=release.expect,
                     uv=uv_binary(settings), uv_version=uv["version"],
                     uv_index_url=settings.uv_index_url, cache_dir=uv_cache_dir(settings),
                     python=state["python"]["executable"], fixed=fixed and fixed["packages"],
                     fixed_path=str(fixed_path),
                     unit_env=dict(service_environment(settings, release, None, writable=release.check_scratch)))
    hostrun.plan(host, f"Build release {release.id} in {release.dir}; " + (
        f"its wheels must have the hashes fixed in {fixed_path}" if fixed else
        f"its lock fixes the stack's wheel hashes in {fixed_path} (none are fixed yet)"))
    yield while_busy(host, settings.servestack_state_dir, f"venv build {release.id}",
                     tool_command(settings.venv_python, "build", params))
    if fixed is None:
        yield FunctionCommand(_fix_stack_hashes, (settings, release, fixed_path), {})


def _fix_stack_hashes(state, host, settings, release: ReleasePlan, path) -> bool:
    """After the first build of a stack (on the control machine): fix its hashes from the release's lock, or,
    where another host of this run fixed them first, check the release has the same."""
    fixed = stack_hashes.read_fixed(path)   # None, or fixed meanwhile by another host of this run
    params = {"release_dir": release.dir, "fixed": fixed and fixed["packages"]}
    ok, stdout, stderr = hostrun.run_remote(host, tool_command(settings.venv_python, "lock", params))
    lock = tool_result(stdout) if ok else None
    if lock is None:
        return fail_host(host, FAILED, [f"cannot read the lock of release {release.id}: {' '.join(stderr)}"])
    if fixed is None:
        stack_hashes.write_fixed(path, stack_hashes.fixed_document(release.inputs, lock["packages"],
                                                                   f"{host.name}, release {release.id}", utc_stamp()))
        host.log(f"fixed the stack's wheel hashes in {path} ({len(lock['packages'])} packages): commit it, every "
                 "later build of this stack must have them")
        return True
    if lock["problems"]:
        return fail_host(host, FAILED, [f"release {release.id} differs from the hashes {path} fixed "
                                        f"({fixed['fixed']}): {problem}" for problem in lock["problems"]])
    return True


@operation()
def activate_release(release: str, by: str = "deploy"):
    """
    Point venv_path at a release with one rename(2), adopting a hand-made venv first.

    + release: the release id to activate
    + by: "deploy" or "rollback", recorded in the activation history

    A real venv at venv_path (made by hand) is moved to `<releases_dir>/adopted-<UTC ts>/venv`
    and venv_path becomes a link to it in the same command; its scripts name venv_path, so they
    keep working whenever it is active, and rollback can return to it.
    """
    settings, state, problems = _environment(changes_it=True)
    if problems:
        yield from refuse(host, problems)
        return
    where = state["venv_path"]
    if where["release"] == release:
        noop(host, f"{settings.venv_path} already points at release {release}")
        return
    hostrun.plan(host, f"{settings.venv_path} -> release {release} (now: {where['release'] or where['kind']})")
    if host.state.config.DIFF:
        _log_package_diff(settings, state, active_packages(settings), release)
    yield tool_command(settings.venv_python, "activate",
                       _params(settings, release=release, by=by, adopt_as=f"adopted-{utc_stamp()}"))


@operation()
def prune_releases(active: str):
    """
    Delete releases beyond the newest `venv_keep_releases`.

    + active: the release this run leaves active (kept, with the one before it)

    Never deletes the active release, the previous one, or an adopted hand-made venv.
    """
    settings, state, problems = _environment()
    if problems:
        yield from refuse(host, problems)
        return
    releases = dict(state["releases"])
    history = list(state["history"])
    current = state["venv_path"]["release"]
    if current != active:  # --dry / prepare: predict the state after activation
        releases.setdefault(active, {"created": utc_stamp(), "status": "ok", "has_venv": True})
        history.append({"release": active, "previous": current, "by": "deploy"})
    remove = releases_to_prune(releases, history, active, settings.venv_keep_releases)
    if not remove:
        noop(host, f"{len(state['releases'])} release(s) kept (venv_keep_releases={settings.venv_keep_releases})")
        return
    protect = [active] + [entry.get("previous") for entry in history[-1:] if entry.get("previous")]
    yield tool_command(settings.venv_python, "prune", _params(settings, remove=remove, protect=protect))


def _log_package_diff(settings, state: dict, active: dict, release: str) -> None:
    record = state["releases"].get(release) or {}
    before = active.get("packages") or {}
    partial = not record.get("packages")
    if partial:  # not built yet: the stack pins over the active env's other packages
        stack = _plan(settings, state).expect["packages"]
        after = {**_outside(before, stack), **stack}
    else:
        after = record["packages"]
    where = state["venv_path"]
    text = format_diff(package_diff(before, after), f"{settings.venv_path} ({where['release'] or where['kind']})",
                       f"{settings.venv_path} (release {release})", partial)
    logger.info(f"{host.print_prefix}package changes:\n{text}")


def _outside(packages: dict, stack: dict) -> dict:
    """The entries of `packages` that are not stack packages (names compared canonically)."""
    names = {canonical_name(name) for name in stack}
    return {name: version for name, version in packages.items() if canonical_name(name) not in names}


# --- what deploy.py and rollback.py call --------------------------------------------------------

def plan() -> ReleasePlan | None:
    """The release this run builds and leaves active on the host (decided at prepare, from the
    host's Python and architecture). None only after refusing a host that lacks venv_python."""
    settings = host_settings(host)
    state = env_state(settings)
    if state is None:
        fail_host(host, REFUSED, [_no_python(settings)])
        return None
    release = _plan(settings, state)
    note(host, "release", release.id)
    note(host, "was", state["venv_path"].get("release"))
    return release


@deploy("ML environment: backup")
def backup(release: Release):
    """Snapshot the active environment if this run will change it (to `release`)."""
    backup_env(name="Back up the ML environment", target=release.id)


@deploy("ML environment: build release")
def build(release: ReleasePlan):
    """Build and check `release` beside the active one (nothing is switched)."""
    build_release(name="Build release", release=release)   # one name for every host: ids differ


@deploy("ML environment: activate release")
def activate(release: Release):
    """Switch venv_path to `release` (after build and patches), prune old releases."""
    activate_release(name="Activate release", release=release.id, by="deploy")
    prune_releases(name="Prune old releases", active=release.id)


def rollback_target() -> Release | None:
    """The release rollback.py re-activates: the one active before the last deploy, or
    `venv_rollback_to`. None after refusing the host (at prepare) when there is none to return to."""
    settings = host_settings(host)
    state = env_state(settings)
    if state is None:
        fail_host(host, REFUSED, [_no_python(settings)])
        return None
    try:
        target = choose_rollback_target(state["history"], state["releases"], state["venv_path"]["release"],
                                        settings.venv_rollback_to)
    except NoRollbackTarget as reason:
        fail_host(host, REFUSED, [str(reason)])
        return None
    note(host, "release", target)
    note(host, "was", state["venv_path"].get("release"))
    return release_at(settings.venv_releases_dir, target)


@deploy("ML environment: rollback")
def rollback(release: Release):
    """Snapshot the active environment, then re-activate `release` (``rollback_target()``)."""
    backup_env(name="Back up the ML environment", target=release.id, reason="before rollback")
    activate_release(name="Roll back to release", release=release.id, by="rollback")
