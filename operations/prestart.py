"""SGLang's own pre-start check of a release (files/scripts/sglang-prestart.py), before it serves.

deploy.py calls `prestart.prestart(release)` after the patches and before the activation: when the
service is about to run something new (its unit and secrets would differ from what its last healthy
start ran), the release's own python runs SGLang's argument parser, ServerArgs with the model's
config and check_server_args on the host's command line and environment. A configuration SGLang
would refuse at start-up (a flag or choice it does not know, cuDNN < 9.15 for a multimodal model on
torch 2.9.1, a model type its transformers does not know, a tokenizer that is repository code
without --trust-remote-code) fails the host in SGLang's words, in seconds, before venv_path or the
unit changes: the running service keeps its release. What the host cannot show (no GPU, the model
not downloaded yet) is named as not checked.
"""

from __future__ import annotations

import json

from pyinfra import host
from pyinfra.api import deploy, operation

from facts.batch import FactRequest
from facts.service import ServiceRecord
from operations.patches import patchset_digest
from operations.service import (
    desired_unit, fingerprint, gpu_groups, secrets_content, sha256_text, speculation_enabled,
)
from operations.service import host_reads as service_reads
from servestack import reads
from servestack.hostrun import noop, plan, while_busy
from servestack.paths import service_record_path
from servestack.releases import Release
from servestack.scripts import python_script_command
from servestack.serving import launch_arguments, service_environment
from servestack.settings import Settings, host_settings

SCRIPT = "sglang-prestart.py"


def host_reads(settings: Settings, release: Release | None = None) -> list[FactRequest]:
    """What this step reads: what the service step reads to render the unit it would write and to
    know what the service last ran healthy (the same requests: read once)."""
    return service_reads(settings, release)


def due(settings: Settings, release: Release) -> str | None:
    """Why the service is about to run something new on `release` (None: it runs what it last ran healthy)."""
    secrets = secrets_content(host.name, settings.service_secret_env)
    wanted = fingerprint(desired_unit(settings, release, gpu_groups()), sha256_text(secrets) if secrets else None)
    record = reads.fact(host, ServiceRecord, path=service_record_path(settings))
    if not record:
        return "no healthy start is recorded"
    return None if record.get("fingerprint") == wanted else "what the service runs changes"


def check_parameters(settings: Settings, release: Release) -> dict:
    """The script's input: the command line and environment the unit gives the server."""
    return {"release": release.id, "profile": settings.service_profile,
            "argv": launch_arguments(settings, speculation_enabled(settings, release)),
            "env": dict(service_environment(settings, release, patchset_digest(release)))}


@operation()
def sglang_prestart(release: Release):
    """
    Run SGLang's own start-up checks of `release` with the host's command line, when the service is
    about to run something new.

    + release: the release the service will run (built and patched)
    """
    settings = host_settings(host)
    reason = due(settings, release)
    if reason is None:
        noop(host, f"{settings.service_name} runs release {release.id} as last verified healthy: no pre-start check")
        return
    plan(host, f"SGLang's pre-start check of release {release.id} ({reason})")
    command = python_script_command(release.python, SCRIPT, json.dumps(check_parameters(settings, release)))
    yield while_busy(host, settings.servestack_state_dir, f"SGLang pre-start check of {release.id}", command)


@deploy("SGLang pre-start check")
def prestart(release: Release):
    """SGLang's checks of `release` before venv_path and the service change."""
    sglang_prestart(name="SGLang pre-start check", release=release)
