"""The model weights a host serves (pure): which repositories and revisions, where they are staged,
and why a host cannot have them.

A profile names its model and draft by Hugging Face repository id (or, in host data, by a directory
on the host, served as it is). Each repository is pinned to a commit: the host's
`service_model_revision` / `service_draft_model_revision`, else the manifest's [service.models] pin.
The weights step (operations/weights.py) stages each into `paths.model_dir` before the service step,
and the unit's --model-path / --speculative-draft-model-path name those directories
(`served_path`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from servestack.keys import is_local_path, manifest_models
from servestack.paths import model_dir, weights_record_path
from servestack.settings import Settings, secret_variable_problems

RECORD_SCHEMA = 1   # of the weights step's record (files/scripts/stage-weights.py SCHEMA)
# The unit's flag that names each role's directory (servestack/serving.py `launch_arguments`).
MODEL_FLAGS = {"model": "--model-path", "draft": "--speculative-draft-model-path"}
ROLES = {"model": ("service_model_path", "service_model_revision", "service_model_local_copy"),
         "draft": ("service_draft_model_path", "service_draft_model_revision", "service_draft_model_local_copy")}


@dataclass(frozen=True)
class StagedModel:
    """One repository a host serves from a staged copy."""

    role: str                   # "model" or "draft"
    repo: str
    revision: str | None        # None: pinned nowhere (the host is refused)
    revision_key: str           # the host-data key that pins it
    local_copy: str | None = None   # a pre-staged copy on the host, checked and served as it is, never modified

    def directory(self, settings: Settings) -> str:
        """Where the unit finds it: the pre-staged copy, or the weights step's directory."""
        assert self.revision is not None
        return self.local_copy or model_dir(settings, self.repo, self.revision)

    def record(self, settings: Settings) -> str:
        """The weights step's record of it: in the models directory, also for a pre-staged copy (never
        written into)."""
        assert self.revision is not None
        return weights_record_path(model_dir(settings, self.repo, self.revision))

    @property
    def label(self) -> str:
        return f"{self.repo}@{self.revision[:12] if self.revision else '?'}"


def is_current(record: dict | None, model: StagedModel, settings: Settings) -> bool:
    """Whether the weights step's record says `model`'s revision was staged and verified where the unit finds it."""
    return record is not None and (record.get("schema"), record.get("repo"), record.get("revision"),
                                   record.get("dir")) == (RECORD_SCHEMA, model.repo, model.revision,
                                                          model.directory(settings))


def _staged(settings: Settings, role: str) -> StagedModel | None:
    path_key, revision_key, copy_key = ROLES[role]
    repo = getattr(settings, path_key)
    if repo is None or is_local_path(repo):
        return None
    pinned = manifest_models(settings.manifest).get(repo, {}).get("revision")
    return StagedModel(role, repo, getattr(settings, revision_key) or pinned, revision_key,
                       getattr(settings, copy_key))


def staged_models(settings: Settings) -> tuple[StagedModel, ...]:
    """The repositories the host's unit serves from staged copies: its model, then its draft."""
    return tuple(model for role in ROLES if (model := _staged(settings, role)) is not None)


def pinned_models(settings: Settings) -> tuple[StagedModel, ...]:
    """The staged models whose revision is pinned (those the weights step can stage)."""
    return tuple(model for model in staged_models(settings) if model.revision is not None)


def pin_problems(settings: Settings) -> list[str]:
    """Why the host cannot be given its weights: a model whose revision is pinned nowhere. One line each,
    naming the profile, the model and the host-data key to set (the caller names the host)."""
    return [f"profile {settings.service_profile!r} serves {model.repo} ({model.role}), "
            f"whose revision is pinned neither by the manifest ([service.models.\"{model.repo}\"] revision: its "
            f"commit has not been checked) nor by host data: set '{model.revision_key}' to the 40-hex commit "
            "to serve (never a branch)"
            for model in staged_models(settings) if model.revision is None]


def token_problems(settings: Settings, environ) -> list[str]:
    """Why the Hub token the host's data names cannot be used: its control-machine variable is unset,
    empty or unfit for a file (never its value)."""
    if settings.service_hub_token_env is None or not pinned_models(settings):
        return []
    return [f"'service_hub_token_env': {problem}"
            for problem in secret_variable_problems([settings.service_hub_token_env], environ)]


def served_path(settings: Settings, role: str) -> str:
    """What the unit passes for the model of `role` (one the host has): its staged directory where it is
    pinned, else the host data's value as it is (a directory on the host, or a repository the deploy
    refuses)."""
    model = _staged(settings, role)
    if model is None or model.revision is None:
        return getattr(settings, ROLES[role][0])
    return model.directory(settings)


def _newest_first(staging: frozenset[str] | set[str]):
    def key(entry: dict) -> tuple:
        record = entry["record"] or {}
        return entry["dir"] in staging, entry["record"] is not None, str(record.get("verified_at", "")), entry["dir"]
    return key


def revisions_to_prune(staged: list[dict], keep: int, protect: set[str],
                       staging: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    """The staged revisions (facts/weights.py `StagedRevisions`) past the newest `keep` of each repository
    (newest: what this run stages, `staging`, counted before it is there; then by the time their record says
    they were verified; a directory without a record, a download never finished, after those), but those in
    `protect` (what this run serves) and pre-staged copies."""
    known = {entry["dir"] for entry in staged}
    arriving = [{"dir": path, "present": False, "record": None} for path in sorted(staging - known)]
    by_repository: dict[str, list[dict]] = {}
    for entry in staged + arriving:
        if not (entry["record"] or {}).get("prestaged"):   # its record only: the copy is someone else's
            by_repository.setdefault(posixpath.dirname(entry["dir"]), []).append(entry)
    return [entry for _folder, entries in sorted(by_repository.items())
            for entry in sorted(entries, key=_newest_first(staging), reverse=True)[keep:]
            if entry["dir"] not in protect | staging]
