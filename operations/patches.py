"""SGLang source patches: servestack's fixes for the installed sglang, keyed by version.

deploy.py calls `patches.patches(release)` with the release `venv.plan()` chose, after the build and
before the activation. The one fact read is PatchStates (facts/patches.py; `host_reads` lists it
with the arguments the operation passes).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import deploy, operation
from pyinfra.api.output import format_text
from pyinfra.facts.files import Sha256File

from facts.batch import FactRequest
from facts.patches import PatchStates, remote_command, sums_write_command
from facts.service import PatchsetDigest, combine_digests
from servestack import patchlib, reads
from servestack.hostrun import noop, refuse, write_record
from servestack.patchsets import PATCH_ROOT, load_patch_sets
from servestack.paths import PATCH_RECORDS, patch_record_path
from servestack.releases import Release
from servestack.settings import host_settings

PACKAGE = "sglang"
# SERVESTACK_PATCHSET in a dry run's unit for a release not built yet: the digest is of a record
# written from the built release's files.
PATCHSET_PENDING = "the digest of the record the patches step writes once the release is built"


def patch_fact_arguments(python: str, record_path: str | None = None, patch_root: str = str(PATCH_ROOT)) -> dict:
    return {"python": python, "package": PACKAGE, "record_path": record_path, "patch_root": patch_root}


def host_reads(settings, release: Release | None = None) -> list[FactRequest]:
    """What this step reads of a host: the patch state of the release (nothing without one)."""
    if release is None:
        return []
    return [FactRequest.of(PatchStates, **patch_fact_arguments(release.python, patch_record_path(release)))]


def patchset_digest(release: Release) -> str | None:
    """The release's patch set as its service knows it (SERVESTACK_PATCHSET): the digest of its
    patch-set records (facts/service.py PatchsetDigest) as this step leaves them; None: no record.

    At execute this step has run before any reader: the records' own digest. At prepare (what
    --dry predicts), where this step will (re)write the record, the digest of what it writes (its
    check computes that record); for a release not built yet, PATCHSET_PENDING (None when the
    manifest's sglang has no patch set)."""
    current = reads.fact(host, PatchsetDigest, release_dir=release.dir)
    if host.state.is_executing:
        return current
    status = reads.fact(host, PatchStates, **patch_fact_arguments(release.python, patch_record_path(release)))
    if not status:   # no patch state (pyinfra's @fake connector without one): the records as they are
        return current
    if not status["installed"]:
        version = host_settings(host).package(PACKAGE).version
        return PATCHSET_PENDING if load_patch_sets(PACKAGE).get(version) else current
    if status["patch_set"] is None or status["record"] == "current" or not status.get("record_sha256"):
        return current
    other = reads.fact(host, Sha256File, path=f"{release.dir}/{PATCH_RECORDS[1]}")   # a rare second record
    return combine_digests([status["record_sha256"], *([other] if other else [])])


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
    status = reads.fact(host, PatchStates, **patch_fact_arguments(python, record_path, patch_root))
    if not status["installed"]:
        what = f"no python at {python}" if status.get("python_missing") else f"{PACKAGE} is not installed in {python}"
        if host.state.is_executing:
            yield from refuse(host, [f"{PACKAGE} patches: {what}"])
            return
        yield from _predict_for_unbuilt_release(python, record_path, patch_root, what)
        return

    version = status["version"]
    if status["patch_set"] is None:
        noop(host, f"{PACKAGE} patches: no patch set for {PACKAGE} {version}, nothing to apply")
        return

    patches = status["patches"]
    problem = patchlib.refusal(patches)
    if problem:
        yield from refuse(host, [f"{PACKAGE} {version} patches refused, no file changed: {problem}"])
        return

    pending = [p for p in patches if p["state"] == "applicable"]
    if not pending and status["record"] == "current":
        _keep_sums(status)
        noop(host, f"{PACKAGE} {version} patches: all in place ({_summary(patches)})")
        return

    if host.state.config.DIFF:
        _log_diffs(pending, status)
    yield remote_command(python, "apply", PACKAGE, record_path, patch_root)


def _predict_for_unbuilt_release(python: str, record_path, patch_root: str, what: str):
    """Prepare-time plan for a release an earlier step builds: it gets the manifest's sglang, pristine.

    The patch files are the diffs that will be applied; when the deploy runs, this operation
    reads the built release and decides again (applied / applicable / upstream / conflict).
    """
    version = host_settings(host).package(PACKAGE).version
    patch_set = load_patch_sets(PACKAGE, patch_root).get(version)
    if patch_set is None:
        noop(host, f"{PACKAGE} patches: no patch set for {PACKAGE} {version}, nothing to apply")
        return
    names = ", ".join(name for name, _ in patch_set["patches"])
    host.log(f"{PACKAGE} patches: {what} yet (built by an earlier step): will apply {names} "
             f"for {PACKAGE} {version}", logger.info)
    if host.state.config.DIFF:
        _log_diffs([{"name": name, "diff": text} for name, text in patch_set["patches"]],
                   {"site_packages": f"the new release ({python})"})
    yield remote_command(python, "apply", PACKAGE, record_path, patch_root)


def _keep_sums(status: dict) -> None:
    """A set python found in place (its sums did not hold, or there were none, e.g. a release
    patched by an older servestack): keep its sums for the next check. Bookkeeping, not a change;
    never in a dry run."""
    if status.get("sums") and status.get("record_path") and host.state.is_executing:
        write_record(host, sums_write_command(status["record_path"], status["sums"]),
                     f"the patch sums beside {status['record_path']}")


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


@deploy("SGLang patches")
def patches(release: Release):
    """Apply the SGLang source patches to `release`'s environment (``venv.plan()``)."""
    sglang_patches(name="Apply SGLang source patches", python=release.python, record_path=patch_record_path(release))
