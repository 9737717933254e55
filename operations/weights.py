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
from facts.weights import SCRIPT, WeightsPlan
from servestack import reads
from servestack.hostrun import REFUSED, fail_host, noop, plan, refuse, while_busy
from servestack.paths import SECRETS_DIR, secrets_staging_path
from servestack.releases import Release
from servestack.scripts import atomic_copy_command, python_script_command, script
from servestack.settings import Settings, host_settings
from servestack.weights import StagedModel, pin_problems, pinned_models, token_problems

RECORD_SCHEMA = 1
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
    file list only when one is not current)."""
    return [FactRequest.of(ServiceRecord, path=path) for path in record_paths(settings)]


def is_current(record: dict | None, model: StagedModel, settings: Settings) -> bool:
    """Whether the step's record says `model`'s revision was staged and verified where the unit finds it."""
    return record is not None and (record.get("schema"), record.get("repo"), record.get("revision"),
                                   record.get("dir")) == (RECORD_SCHEMA, model.repo, model.revision,
                                                          model.directory(settings))


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


@deploy("Model weights")
def weights(release: Release):
    """The model and draft of the host's profile, staged before the service step; a host that cannot have them
    is refused while pyinfra prepares the run, before any step changes it."""
    problems = refusals(host_settings(host))
    if problems:
        fail_host(host, REFUSED, problems)
        return
    stage_weights(name="Stage model weights", release=release)
