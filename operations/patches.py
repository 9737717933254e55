"""SGLang source patches: servestack's fixes for the installed sglang, keyed by version."""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import OperationError, deploy, operation
from pyinfra.api.output import format_text

from facts.patches import PATCH_ROOT, PatchStates, load_patch_sets, memo_write_command, remote_command
from facts.probe import FactRequest
from operations.venv import planned_only, planned_release
from servestack import patchlib, probe
from servestack.hostrun import keep
from servestack.settings import host_settings

PACKAGE = "sglang"
RECORD_FILE = "patches.json"


@operation()
def sglang_patches(python: str, record_path: str | None = None, patch_root: str = str(PATCH_ROOT)):
    """
    Apply servestack's patch set for the installed SGLang version, all patches or none.

    + python: the environment's interpreter, e.g. ``/opt/ml-env/bin/python``
    + record_path: JSON record of the set (package, version, each patch's sha256 and state,
      each file's sha256 before and after); default ``<sys.prefix>/servestack-patches.json``
    + patch_root: local directory of ``<package>/<version>/`` patch sets

    Every patch is checked before any file changes: one conflict (the file is not what
    the patch expects) refuses the set, naming the file and hunk. Applicable patches are
    written atomically, the patched modules byte-compiled, then the record written.
    Already applied and upstream patches change nothing. A version without a set gets none.

    **Example:**

    .. code:: python

        sglang_patches(
            name="Apply SGLang patches",
            python="/opt/servestack/releases/2026-01-01/bin/python",
            record_path="/opt/servestack/releases/2026-01-01/servestack-patches.json",
        )
    """
    status = probe.fact(host, PatchStates, python=python, package=PACKAGE, record_path=record_path,
                        patch_root=patch_root)
    if not status["installed"]:
        what = f"no python at {python}" if status.get("python_missing") else f"{PACKAGE} is not installed in {python}"
        if host.state.is_executing:
            raise OperationError(f"{PACKAGE} patches: {what}")
        yield from _predict_for_unbuilt_release(python, record_path, patch_root, what)
        return

    version = status["version"]
    if status["patch_set"] is None:
        host.noop(f"{PACKAGE} patches: no patch set for {PACKAGE} {version}, nothing to apply")
        return

    patches = status["patches"]
    problem = patchlib.refusal(patches)
    if problem:
        raise OperationError(f"{PACKAGE} {version} patches refused, no file changed: {problem}")

    pending = [p for p in patches if p["state"] == "applicable"]
    if not pending and status["record"] == "current":
        _keep_memo(record_path, status)
        host.noop(f"{PACKAGE} {version} patches: all in place ({_summary(patches)})")
        return

    if host.state.config.DIFF:
        _log_diffs(pending, status)
    yield remote_command(python, "apply", PACKAGE, record_path, patch_root)
    probe.changed(host)  # the release's sources and its patch record (named in the service's unit)


def _predict_for_unbuilt_release(python: str, record_path, patch_root: str, what: str):
    """Prepare-time plan for a release an earlier step builds: it gets the manifest's sglang, pristine.

    The patch files are the diffs that will be applied; when the deploy runs, this operation
    reads the built release and decides again (applied / applicable / upstream / conflict).
    """
    version = host_settings(host).manifest.package(PACKAGE).version
    patch_set = load_patch_sets(PACKAGE, patch_root).get(version)
    if patch_set is None:
        host.noop(f"{PACKAGE} patches: no patch set for {PACKAGE} {version}, nothing to apply")
        return
    names = ", ".join(name for name, _ in patch_set["patches"])
    host.log(f"{PACKAGE} patches: {what} yet (built by an earlier step): will apply {names} "
             f"for {PACKAGE} {version}", logger.info)
    if host.state.config.DIFF:
        _log_diffs([{"name": name, "diff": text} for name, text in patch_set["patches"]],
                   {"site_packages": f"the new release ({python})"})
    yield remote_command(python, "apply", PACKAGE, record_path, patch_root)
    probe.changed(host)


def _keep_memo(record_path: str | None, status: dict) -> None:
    """Keep the check's answer on the host for later converges (bookkeeping, like the lock: not a
    change; never in a dry run). Only an answer the host's python just gave carries a memo."""
    if record_path and status.get("memo") and host.state.is_executing:
        keep(host, memo_write_command(record_path, status["memo"]), f"the patch check's memo beside {record_path}")


def _summary(patches: list) -> str:
    return ", ".join(f"{p['name']} {p['state']}" for p in patches)


def _log_diffs(pending: list, status: dict) -> None:
    colours = {"+": "green", "-": "red", "@": "cyan"}
    for patch in pending:
        host.log(f"Will apply {format_text(patch['name'], bold=True)} in {status['site_packages']}", logger.info)
        for line in patch["diff"].splitlines():
            colour = colours.get(line[:1]) if not line.startswith(("+++", "---")) else None
            logger.info("  %s", format_text(line, colour) if colour else line)
        logger.info("")
    if not pending:
        host.log(f"Will rewrite the record {status['record_path']} ({status['record']})", logger.info)


def release_paths() -> tuple:
    """(python, record_path) of the release this run leaves active (built by the venv step)."""
    release = planned_release(host)
    return release.python, f"{release.dir}/{RECORD_FILE}"


@probe.expects
def _expected_facts(host_) -> list[FactRequest]:
    release = planned_only(host_)
    if release is None:
        return []
    return [FactRequest.of(PatchStates, python=release.python, package=PACKAGE,
                           record_path=f"{release.dir}/{RECORD_FILE}", patch_root=str(PATCH_ROOT))]


@deploy("SGLang patches")
def patches():
    """Apply the SGLang source patches to the release's environment."""
    python, record_path = release_paths()
    sglang_patches(name="Apply SGLang source patches", python=python, record_path=record_path)
