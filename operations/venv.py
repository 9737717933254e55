"""The ML environment (`venv_path`, default /opt/ml-env): backed up, rebuilt beside, switched, kept.

Steps (deploy.py calls them in this order, with other steps between):

    venv.backup()     snapshot the active environment, only when this run is about to change it
    venv.build()      build the target release beside the active one and check it; activates nothing
    venv.activate()   adopt a hand-made venv (first run), switch venv_path atomically, prune old releases

and rollback.py calls `venv.rollback()`. `planned_release(host)` tells later steps (patches,
service) which release this run leaves active.

Building: one resolution, then an ordered install. `uv pip compile` resolves the stack once into
`lock.txt` (hashes for every file; see operations/releases.py for the index/overrides design);
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

import datetime
import os
import shlex
from weakref import WeakKeyDictionary

from pyinfra import host, logger
from pyinfra.api import deploy, operation
from pyinfra.api.exceptions import OperationError

from facts.probe import FactRequest
from facts.venv import MlEnvState, memo_write_command
from operations.releases import (
    CHECK, NoRollbackTarget, Release, ReleasePlan, canonical_name, format_diff, package_diff, release_at,
    release_plan, releases_to_prune, rollback_target, tool_command,
)
from servestack import probe
from servestack.hostrun import keep
from servestack.settings import host_settings, real_host

# The release each host's run leaves active, set while deploy.py / rollback.py are prepared.
_PLANNED: "WeakKeyDictionary[object, Release]" = WeakKeyDictionary()
# state -> names of the hosts where this run kept the state's memo or changed the environment
# (either way it keeps no other memo there; see `_keep_state_memo`).
_MEMO_SETTLED: "WeakKeyDictionary[object, set]" = WeakKeyDictionary()
# The memo rides in the lock's release, one `sh -c` argument (at most 128 KiB on Linux, with the
# other bookkeeping): a state with very many releases is read by python instead.
MEMO_MAX_CHARS = 48 * 1024


# --- reading the host ---------------------------------------------------------------------------

def uv_binary(settings) -> str:
    return f"{settings.uv_install_dir}/bin/uv"


def uv_cache_dir(settings) -> str:
    """uv's cache, beside the releases by default: same filesystem, so installs are hard links."""
    return settings.uv_cache_dir or os.path.dirname(settings.venv_releases_dir.rstrip("/")) + "/uv-cache"


def mlenv_fact_arguments(settings, packages: bool = False) -> dict:
    return {"venv_path": settings.venv_path, "releases_dir": settings.venv_releases_dir,
            "state_dir": settings.servestack_state_dir, "uv": uv_binary(settings),
            "python": settings.venv_python, "packages": packages}


@probe.expects
def _expected_facts(host_) -> list[FactRequest]:
    return [FactRequest.of(MlEnvState, **mlenv_fact_arguments(host_settings(host_)))]


probe.decides(MlEnvState)  # the deploy functions plan the release from it


def env_state(settings, packages: bool = False) -> dict:
    """The MlEnvState fact; `packages` also lists the active environment's packages."""
    state = probe.fact(host, MlEnvState, **mlenv_fact_arguments(settings, packages))
    if state is None:
        raise OperationError(f"host {host.name}: '{settings.venv_python}' (venv_python) is not on the "
                             "host's PATH; servestack needs it to build the ML environment")
    state.pop("memo", None)  # bookkeeping, not the environment (see `_keep_state_memo`)
    return state


def _keep_state_memo(settings) -> None:
    """Keep the state's memo on the host for later converges (facts/venv.py): bookkeeping like the
    lock, not a change; never in a dry run. Only an answer the host's python gave carries one: read
    at execute, or at prepare under `pyinfra -y` (execute starts from prepare's reads), so it is
    kept from the operation code execute runs. Once per run, and not once a venv operation changed
    this host in this run (what was read before may be gone); the write itself drops a memo whose
    paths changed after it was read (servestack/memo.py `write_command`)."""
    if not host.state.is_executing:
        return
    settled = _MEMO_SETTLED.setdefault(host.state, set())
    if host.name in settled:
        return
    text = (probe.cached(host, MlEnvState, **mlenv_fact_arguments(settings)) or {}).get("memo")
    if text and len(text) <= MEMO_MAX_CHARS:
        settled.add(host.name)
        keep(host, memo_write_command(settings.servestack_state_dir, text),
             f"the ML environment state's memo in {settings.servestack_state_dir}")


def _changing() -> None:
    """Before an operation yields a change to the environment: no memo is kept on this host in this run."""
    if host.state.is_executing:
        _MEMO_SETTLED.setdefault(host.state, set()).add(host.name)


def _unchanged(settings, message: str) -> None:
    """An operation that leaves the environment as it is: pyinfra's noop, and the memo kept."""
    host.noop(message)
    _keep_state_memo(settings)


def plan(settings, state: dict) -> ReleasePlan:
    return release_plan(settings, state["machine"], state["python"]["version"])


def active_release(host_=None) -> Release | None:
    """The release venv_path points at now (None: missing, hand-made or foreign)."""
    target = host_ if host_ is not None else host
    settings = host_settings(target)
    state = probe.fact(target, MlEnvState, **mlenv_fact_arguments(settings, packages=False))
    release = ((state or {}).get("venv_path") or {}).get("release")
    return release_at(settings.venv_releases_dir, release) if release else None


def planned_only(host_=None) -> Release | None:
    """The release `venv.build()` / `venv.rollback()` planned in this run for the host, if any."""
    return _PLANNED.get(real_host(host_ if host_ is not None else host))


def planned_release(host_=None) -> Release:
    """The release this run leaves active: the deploy's target or the rollback's, else the active one.

    Set when `venv.build()` / `venv.rollback()` are prepared, so steps prepared after them (patches,
    service) can name the release's paths even in `--dry` before it exists.
    """
    target = real_host(host_ if host_ is not None else host)
    if target in _PLANNED:
        return _PLANNED[target]
    active = active_release(target)
    if active is None:
        raise OperationError(f"host {target.name}: no servestack release is active and none is planned")
    return active


def _params(settings, **extra) -> dict:
    return {"venv_path": settings.venv_path, "releases_dir": settings.venv_releases_dir,
            "state_dir": settings.servestack_state_dir, **extra}


def _utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _refusal(message: str) -> str:
    """A command that fails the host with `message` (pyinfra prints stderr of failed commands)."""
    return f"echo {shlex.quote('servestack: ' + message)} >&2; exit 1"


def _not_a_venv(settings) -> str:
    return (f"{settings.venv_path} (venv_path) exists but is not a venv (no pyvenv.cfg); servestack "
            "will not move or replace it: move it away and re-run")


def _environment_changes(state: dict, target: str) -> bool:
    where = state["venv_path"]
    return where["kind"] in ("venv", "link") and where["release"] != target


def _same_as_latest_backup(state: dict) -> bool:
    latest, active, where = state.get("latest_backup"), state.get("active") or {}, state["venv_path"]
    return bool(latest) and latest.get("realpath") == where["realpath"] \
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
    settings = host_settings(host)
    state = env_state(settings)
    where = state["venv_path"]
    if not _environment_changes(state, target):
        _unchanged(settings, f"{settings.venv_path} is "
                   f"{'already ' + target if where['release'] == target else where['kind']}: nothing to back up")
        return
    state = env_state(settings, packages=True)
    if _same_as_latest_backup(state):
        _unchanged(settings, f"backup {state['backups'][-1]} already records {settings.venv_path}")
        return
    _changing()
    yield tool_command(settings.venv_python, "backup",
                       _params(settings, keep=settings.venv_keep_backups, reason=reason))
    probe.changed(host, MlEnvState)


@operation()
def build_release():
    """
    Build the target release beside the active one and check it; venv_path is not touched.

    The release id comes from the release's inputs, so a built release is never rebuilt. uv at the
    manifest's version is installed first if the host lacks it.
    """
    settings = host_settings(host)
    state = env_state(settings)
    if state["venv_path"]["kind"] == "other":  # refuse before spending time on a build
        yield _refusal(_not_a_venv(settings))
        return
    release = plan(settings, state)
    record = state["releases"].get(release.id) or {}
    if record.get("status") == "ok" and record.get("has_venv"):
        _unchanged(settings, f"release {release.id} is built and checked")
        return
    if record:
        host.log(f"Rebuilding release {release.id} (it was left {record.get('status')}: "
                 f"{record.get('error', 'no error recorded')})", logger.warning)
    uv = settings.manifest.uv
    params = _params(settings, id=release.id, release_dir=release.dir, inputs=release.inputs,
                     files=release.files, steps=release.steps, expect=release.expect,
                     check_script=CHECK.read_text(), uv=uv_binary(settings), uv_version=uv["version"],
                     uv_index_url=settings.uv_index_url, cache_dir=uv_cache_dir(settings),
                     python=state["python"]["executable"])
    _changing()
    yield tool_command(settings.venv_python, "build", params)
    probe.changed(host)  # a new release directory: the releases, its python, its patch state


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
    settings = host_settings(host)
    state = env_state(settings)
    where = state["venv_path"]
    if where["kind"] == "other":
        yield _refusal(_not_a_venv(settings))
        return
    if where["release"] == release:
        _unchanged(settings, f"{settings.venv_path} already points at release {release}")
        return
    if host.state.config.DIFF:
        _log_package_diff(settings, env_state(settings, packages=True), release)
    _changing()
    yield tool_command(settings.venv_python, "activate",
                       _params(settings, release=release, by=by, adopt_as=f"adopted-{_utc_stamp()}"))
    probe.changed(host)  # the active release: every step's view of the host


@operation()
def prune_releases(active: str):
    """
    Delete releases beyond the newest `venv_keep_releases`.

    + active: the release this run leaves active (kept, with the one before it)

    Never deletes the active release, the previous one, or an adopted hand-made venv.
    """
    settings = host_settings(host)
    state = env_state(settings)
    releases = dict(state["releases"])
    history = list(state["history"])
    current = state["venv_path"]["release"]
    if current != active:  # --dry / prepare: predict the state after activation
        releases.setdefault(active, {"created": _utc_stamp(), "status": "ok", "has_venv": True})
        history.append({"release": active, "previous": current, "by": "deploy"})
    remove = releases_to_prune(releases, history, active, settings.venv_keep_releases)
    if not remove:
        _unchanged(settings, f"{len(state['releases'])} release(s) kept "
                   f"(venv_keep_releases={settings.venv_keep_releases})")
        return
    protect = [active] + [entry.get("previous") for entry in history[-1:] if entry.get("previous")]
    _changing()
    yield tool_command(settings.venv_python, "prune", _params(settings, remove=remove, protect=protect))
    probe.changed(host)  # release directories gone


@operation()
def refuse(message: str):
    """
    Fail this host with a clear message (nothing else runs on it).

    + message: why
    """
    yield _refusal(message)


def _log_package_diff(settings, state: dict, release: str) -> None:
    record = state["releases"].get(release) or {}
    before = (state.get("active") or {}).get("packages") or {}
    partial = not record.get("packages")
    if partial:  # not built yet: the stack pins over the active env's other packages
        stack = plan(settings, state).expect["packages"]
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


# --- the steps deploy.py and rollback.py call -----------------------------------------------------

def _plan_for_host() -> ReleasePlan:
    settings = host_settings(host)
    return plan(settings, env_state(settings))


@deploy("ML environment: backup")
def backup():
    """Snapshot the active environment if this run will change it."""
    backup_env(name="Back up the ML environment", target=_plan_for_host().id)


@deploy("ML environment: build release")
def build():
    """Build and check the target release beside the active one (nothing is switched)."""
    release = _plan_for_host()
    _PLANNED[real_host(host)] = Release(release.id, release.dir)
    build_release(name=f"Build release {release.id}")


@deploy("ML environment: activate release")
def activate():
    """Switch venv_path to the target release (after build and patches), prune old releases."""
    release = _plan_for_host()
    activate_release(name=f"Activate release {release.id}", release=release.id, by="deploy")
    prune_releases(name="Prune old releases", active=release.id)


@deploy("ML environment: rollback")
def rollback():
    """Re-activate the previous release (or `venv_rollback_to`); refuse clearly if there is none."""
    settings = host_settings(host)
    state = env_state(settings)
    current = state["venv_path"]["release"]
    try:
        target = rollback_target(state["history"], state["releases"], current, settings.venv_rollback_to)
    except NoRollbackTarget as reason:
        host.log(f"Cannot roll back: {reason}", logger.error)
        refuse(name="Roll back the ML environment", message=str(reason))
        return
    _PLANNED[real_host(host)] = release_at(settings.venv_releases_dir, target)
    backup_env(name="Back up the ML environment", target=target, reason="before rollback")
    activate_release(name=f"Roll back to release {target}", release=target, by="rollback")
