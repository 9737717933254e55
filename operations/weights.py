"""Step `weights`: the model and draft the unit serves, staged on the host before the service step.

deploy.py calls `weights.weights(release)` after the venv build and the patches and before the
service step, so the health gate times a load, not a download. Each model the profile names by
repository id is pinned to a commit (servestack/weights.py: host data, else the manifest) and
staged into its own directory, `<service_models_dir>/<org>--<name>/<revision>`, which the unit's
--model-path / --speculative-draft-model-path name (servestack/serving.py).

Decided from small facts in the converge's batched read (`ServiceRecord`, one per model: the records this step
writes beside each directory; deploy.py lists it in what the deploy functions decide from). A model
whose record names its revision is current: nothing else is read, nothing runs, and the Hub is not
asked. Otherwise the Hub's file list is compared with the directory (`WeightsPlan`, read only then).
While pyinfra prepares the run, before any step changes the host, the deploy function refuses it
(`refusals`) for a model pinned nowhere, a token variable not set on the control machine, the Hub's
refusal of the revision or the repository (a gated one without a token), or too little disk for what
is missing; the dry run says per model what would be downloaded (files, bytes) or that the weights
are current. The download runs in the release's python with its real huggingface_hub
(files/scripts/stage-weights.py `fetch`: `snapshot_download`, which resumes a cut download), under
files/scripts/busy.sh like the other long steps, then checks every file against the Hub's sizes and
hashes (fetching a differing one again) and writes the record atomically. A token
(service_hub_token_env) travels as the service's secrets file does, into a root-only file the Hub
client reads (HF_TOKEN_PATH), removed when the download ends.

`prune()` runs after the service step (deploy.py): it removes the staged revisions past the newest
`service_models_keep` of each repository (`StagedRevisions`, in the same batched read), never what
this run serves, a pre-staged copy, or, checked on the host at that moment, a revision the active,
the known-good or a gate's unfinished unit serves.
"""

from __future__ import annotations

import json
import os
import shlex
from io import StringIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, deploy, operation

from facts.batch import FactRequest
from facts.service import ServiceRecord
from facts.weights import SCRIPT, StagedRevisions, WeightsPlan
from servestack import reads
from servestack.hostrun import REFUSED, fail_host, noop, plan, refuse, while_busy
from servestack.paths import SECRETS_DIR, candidate_unit_path, good_unit_path, secrets_staging_path, unit_path
from servestack.releases import Release
from servestack.scripts import atomic_copy_command, python_script_command, script
from servestack.settings import Settings, host_settings
from servestack.weights import (ROLES, StagedModel, is_current, pin_problems, pinned_models, revisions_to_prune,
                                served_path, token_problems)

STEP = "model weights download"
# The Hub token, for the download only: written like the service's secrets file (files/scripts/secrets-file.sh:
# root, 0600, its text by SFTP, never on a command line) and removed when the download ends.
TOKEN_FILE = f"{SECRETS_DIR}/hub-token"
SECRETS_SCRIPT = "secrets-file.sh"
# Room left beside what is missing: huggingface_hub keeps a partial file beside the one it replaces.
DISK_MARGIN = 0.05
DISK_MARGIN_MIN_BYTES = 1_000_000_000


def human_bytes(size: int) -> str:
    """590000000000 -> '590.0 GB' (decimal units, as the Hub's pages print them)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def record_paths(settings: Settings) -> tuple[str, ...]:
    return tuple(model.record(settings) for model in pinned_models(settings))


def host_reads(settings: Settings, release: Release | None = None) -> list[FactRequest]:
    """What this step reads before it decides: the records of the models the host serves (the Hub's
    file list only when one is not current), and every revision staged (what the prune decides from)."""
    return [*(FactRequest.of(ServiceRecord, path=path) for path in record_paths(settings)),
            FactRequest.of(StagedRevisions, models_dir=settings.service_models_dir)]


def due_models(settings: Settings) -> list[StagedModel]:
    """The pinned models whose staged copy is not recorded as verified."""
    return [model for model in pinned_models(settings)
            if not is_current(reads.fact(host, ServiceRecord, path=model.record(settings)), model, settings)]


def script_params(settings: Settings, models: list[StagedModel]) -> str:
    return json.dumps({"endpoint": settings.service_hub_endpoint, "models_dir": settings.service_models_dir,
                       "models": [{"repo": model.repo, "revision": model.revision, "dir": model.directory(settings),
                                   "record": model.record(settings), "prestaged": model.local_copy is not None}
                                  for model in models]}, sort_keys=True)


def disk_needed(missing: int) -> int:
    return missing + max(int(missing * DISK_MARGIN), DISK_MARGIN_MIN_BYTES)


def plan_problems(settings: Settings, wanted: dict | None) -> list[str]:
    """Why the download cannot start: the Hub's refusal of a model, or too little disk for what is missing."""
    if wanted is None:
        return [f"'{settings.venv_python}' (venv_python) is not on the host's PATH: the Hub's file list cannot be read"]
    tokened = settings.service_hub_token_env is not None   # the download sends it; the plan does not
    problems = [f"model weights {entry['repo']}@{entry['revision']}: {entry['problem']}"
                for entry in wanted["models"] if entry.get("problem") and not (tokened and entry.get("needs_token"))]
    problems += [f"the pre-staged copy {entry['dir']} of {entry['repo']}@{entry['revision'][:12]} differs from the "
                 f"Hub's file list (it is left as it is): "
                 + "; ".join(f"{name} ({why})" for name, why in entry["differs"].items())
                 for entry in wanted["models"] if entry.get("prestaged") and entry.get("differs")]
    missing = sum(entry.get("missing_bytes", 0) for entry in wanted["models"] if not entry.get("prestaged"))
    if not problems and disk_needed(missing) > wanted["free_bytes"]:
        names = ", ".join(entry["repo"] for entry in wanted["models"] if entry.get("missing_bytes"))
        problems.append(f"model weights: {settings.service_models_dir} (service_models_dir) has {wanted['free_bytes']} "
                        f"bytes free, {names} need {disk_needed(missing)} ({missing} missing + margin): short by "
                        f"{disk_needed(missing) - wanted['free_bytes']} bytes")
    return problems


def plan_lines(settings: Settings, wanted: dict) -> list[str]:
    return [f"check the pre-staged copy {entry['dir']} of {entry['repo']}@{entry['revision'][:12]} ({entry['files']} "
            f"files, {human_bytes(entry['bytes'])}) against the Hub's sizes and hashes, and serve it as it is"
            if entry.get("prestaged") and "files" in entry else
            f"download {len(entry['missing_files'])} of {entry['files']} files ({human_bytes(entry['missing_bytes'])} "
            f"of {human_bytes(entry['bytes'])}) of {entry['repo']}@{entry['revision'][:12]} into "
            f"{settings.service_models_dir}, then verify them against the Hub's sizes and hashes"
            if "files" in entry else
            f"download {entry['repo']}@{entry['revision'][:12]} with the token of service_hub_token_env (the Hub "
            f"lists its files only with it) into {settings.service_models_dir}, then verify them"
            for entry in wanted["models"]]


def token_upload(variable: str):
    """The commands that put the token of the control machine's `variable` (service_hub_token_env) in
    TOKEN_FILE (its text never on a command line), for the download."""
    upload_dir = host.get_temp_filename(f"servestack-hub-token-{TOKEN_FILE}")
    yield script(SECRETS_SCRIPT, "stage", TOKEN_FILE)
    yield StringCommand("rm", "-rf", QuoteString(upload_dir), "&&", "mkdir", "-m", "700", QuoteString(upload_dir),
                        _sudo=False)
    yield FileUploadCommand(StringIO(os.environ[variable] + "\n"),
                            secrets_staging_path(TOKEN_FILE), remote_temp_filename=f"{upload_dir}/token")
    yield script(SECRETS_SCRIPT, "place", TOKEN_FILE, upload_dir)


def fetch_command(settings: Settings, release: Release, models: list[StagedModel]) -> str:
    """The download in the release's python; then each record it verified (`<record>.staged`) put in place
    atomically, however it ended; with a token, through TOKEN_FILE, removed however it ended."""
    token = {"HF_TOKEN_PATH": TOKEN_FILE} if settings.service_hub_token_env is not None else None
    lines = [python_script_command(release.python, SCRIPT, "fetch", script_params(settings, models), env=token),
             "status=$?"]
    for model in models:
        record = model.record(settings)
        staged = record + ".staged"
        lines.append(f"if [ -f {shlex.quote(staged)} ]; then {atomic_copy_command(staged, record)} && "
                     f"rm -f -- {shlex.quote(staged)} || status=1; fi")
    if token:
        lines.append(f"rm -f -- {shlex.quote(TOKEN_FILE)}")
    return "\n".join([*lines, "exit $status"])


def hub_plan(settings: Settings, due: list[StagedModel]) -> dict | None:
    """What the Hub lists for the `due` models and the host lacks (read only when a model is due)."""
    return reads.fact(host, WeightsPlan, python=settings.venv_python, params=script_params(settings, due))


def refusals(settings: Settings) -> list[str]:
    """Why the host cannot be given its weights, found before any step changes it: a model pinned nowhere, an
    unusable token, and, where a download is due, the Hub's refusal or too little disk for what is missing."""
    problems = pin_problems(settings) + token_problems(settings, os.environ)
    due = due_models(settings) if not problems else []
    return problems or (plan_problems(settings, hub_plan(settings, due)) if due else [])


@operation()
def stage_weights(release: Release):
    """
    Download the model weights the unit serves, pinned, into one directory per repository and revision.

    + release: the release whose python (and its huggingface_hub) downloads
    """
    settings = host_settings(host)
    due = due_models(settings)
    if not due:
        noop(host, "model weights current: " + (", ".join(model.label for model in pinned_models(settings))
                                                 or "the unit serves no model from the Hub"))
        return
    wanted = hub_plan(settings, due)
    problems = plan_problems(settings, wanted)
    if problems or wanted is None:
        yield from refuse(host, problems)
        return
    for line in plan_lines(settings, wanted):
        plan(host, line)
    if settings.service_hub_token_env is not None:
        yield from token_upload(settings.service_hub_token_env)
    yield while_busy(host, settings.servestack_state_dir, STEP, fetch_command(settings, release, due))


def served_dirs(settings: Settings) -> set[str]:
    """The directories this run's unit serves: the staged or pre-staged copies, or a local path as it is."""
    return {path for role in ROLES if (path := served_path(settings, role)) is not None}


def prune_choice(settings: Settings) -> list[dict]:
    """The staged revisions past the newest service_models_keep of their repository, but what this run serves.
    What this run's weights step downloads counts as the newest: the plan (and --dry) reads the host before it."""
    staged = reads.fact(host, StagedRevisions, models_dir=settings.service_models_dir) or []
    staging = {model.directory(settings) for model in due_models(settings) if model.local_copy is None}
    return revisions_to_prune(staged, settings.service_models_keep, served_dirs(settings), staging)


def prune_line(settings: Settings, entry: dict) -> str:
    record = entry["record"] or {}
    what = (f"{record.get('repo')}@{str(record.get('revision'))[:12]} ({human_bytes(int(record.get('bytes') or 0))})"
            if record else f"{entry['dir']} (a download that never finished)")
    return (f"prune the model weights {what} in {settings.service_models_dir}: past the newest "
            f"{settings.service_models_keep} of its repository (service_models_keep), unless the active or the "
            "known-good unit serves it once the service step is done")


@operation()
def prune_models():
    """
    Remove the staged model revisions past the newest ``service_models_keep`` of each repository.

    Run after the service step verified the unit (deploy.py): the host-side script reads the active unit,
    the known-good one and a gate's unfinished one as they are then, and keeps every revision one of them
    serves, whatever was chosen here. What this run serves and pre-staged copies are never chosen.
    """
    settings = host_settings(host)
    remove = prune_choice(settings)
    if not remove:
        noop(host, f"no model revision to prune (keeping {settings.service_models_keep} of each repository)")
        return
    for entry in remove:
        plan(host, prune_line(settings, entry))
    params = json.dumps({"remove": [entry["dir"] for entry in remove],
                         "units": [unit_path(settings), good_unit_path(settings), candidate_unit_path(settings)]})
    yield StringCommand(python_script_command(settings.venv_python, SCRIPT, "prune", params, site=False))


@deploy("Old model weights")
def prune():
    """The staged revisions no longer wanted, removed once the service step verified the unit that serves
    this run's (deploy.py runs it after the service and speculation steps; a host they failed never gets here)."""
    prune_models(name="Prune old model weights")


@deploy("Model weights")
def weights(release: Release):
    """The model and draft of the host's profile, staged before the service step; a host that cannot have them
    is refused while pyinfra prepares the run, before any step changes it."""
    problems = refusals(host_settings(host))
    if problems:
        fail_host(host, REFUSED, problems)
        return
    stage_weights(name="Stage model weights", release=release)
