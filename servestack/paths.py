"""Every path servestack keeps on a host, from the host's settings (pure: no host access).

docs/design.md "On the host" says what each file holds and which step writes it. The layout inside
a release (`<releases_dir>/<id>/venv`, its python) is the `Release` model's (servestack/releases.py).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from servestack.manifest import Runfile
from servestack.releases import Release
from servestack.settings import Settings

UNIT_DIR = "/etc/systemd/system"
RUNTIME_UNIT_DIR = "/run/systemd/system.control"   # overrides UNIT_DIR; tmpfs
SECRETS_DIR = "/etc/servestack"
VERIFICATION_RECORD = "verified.json"
SPECULATION_RECORD = "speculation.json"
# The patch records a release may hold: the patches step's (first), and its operation's default
# beside the venv (servestack/patchlib.py RECORD_NAME).
PATCH_RECORDS = ("patches.json", "venv/servestack-patches.json")


# -- servestack's state directory (servestack_state_dir) ------------------------------------------

def lock_path(state_dir: str) -> str:
    """The run lock (files/scripts/lock.sh)."""
    return f"{state_dir.rstrip('/')}/lock"


def busy_path(state_dir: str) -> str:
    """Held (flock) by a run's long remote commands while they run."""
    return lock_path(state_dir) + ".busy"


def toolkits_record_path(state_dir: str) -> str:
    """The kept toolkits' fingerprints and the /usr/local/cuda chain (schema: facts/toolkit.py)."""
    return f"{state_dir.rstrip('/')}/toolkits.json"


def toolkit_marker_path(state_dir: str) -> str:
    """Present only while a toolkit install runs: lets the next run finish or move aside an interrupted one."""
    return f"{state_dir.rstrip('/')}/toolkit-install.json"


def verification_record_path(settings: Settings) -> str:
    """The verify step's record of the checks that passed (operations/verify.py)."""
    return f"{settings.servestack_state_dir}/{VERIFICATION_RECORD}"


def speculation_record_path(settings: Settings) -> str:
    """The host's record of the last speculation benchmark and its decision."""
    return f"{settings.servestack_state_dir}/{SPECULATION_RECORD}"


def benchmark_marker_path(settings: Settings) -> str:
    """Present while a speculation benchmark runs on the host: one left behind names a benchmark that
    did not finish (its controller was killed)."""
    return f"{settings.servestack_state_dir}/speculation.running.json"


def service_state_dir(settings: Settings) -> str:
    return f"{settings.servestack_state_dir}/service"


def service_record_path(settings: Settings) -> str:
    """The health gate's record of the unit + secrets last seen healthy."""
    return f"{service_state_dir(settings)}/{settings.service_name}.json"


def good_unit_path(settings: Settings) -> str:
    """The text of the unit last seen healthy: what a failed restart goes back to."""
    return f"{service_state_dir(settings)}/{settings.service_name}.good"


# -- the service ------------------------------------------------------------------------------------

def unit_path(settings: Settings) -> str:
    return f"{UNIT_DIR}/{settings.service_name}"


def candidate_unit_path(settings: Settings) -> str:
    """Where the health gate installs the unit it starts until it has verified it: a runtime unit, which
    overrides unit_path's and which a reboot forgets (a host rebooted mid-gate boots the verified unit)."""
    return f"{RUNTIME_UNIT_DIR}/{settings.service_name}"


def secrets_path(settings: Settings) -> str:
    return f"{SECRETS_DIR}/{settings.service_name}.env"


def secrets_staging_path(path: str) -> str:
    """Where files/scripts/secrets-file.sh stages the secrets file before renaming it into place."""
    return f"{path}.servestack-new"


def service_home_dir(settings: Settings) -> str:
    return f"/var/lib/{settings.service_user}"


def release_cache_dir(settings: Settings, release_id: str) -> str:
    """JIT caches for one toolkit + release: kernels built by one nvcc are never reused by another."""
    return f"{settings.service_cache_dir}/{settings.cuda_version}-{release_id}"


def unit_copy_path(settings: Settings, rel: Release) -> str:
    """The copy of the unit kept in its release (the unit that release runs with): what the health
    gate installs as the service's unit when it starts it."""
    return f"{rel.dir}/{settings.service_name}"


def benchmark_unit_path(settings: Settings, rel: Release, configuration: str) -> str:
    """The unit of one benchmark configuration, which the health gate installs when it starts it."""
    return f"{rel.dir}/{settings.service_name}.{configuration}"


# -- model weights (service_models_dir) -------------------------------------------------------------

def model_dir(settings: Settings, repo: str, revision: str) -> str:
    """Where the weights step stages one revision of a repository: <models_dir>/<org>--<name>/<revision>
    (the Hub cache's own way of naming a repository in one path component)."""
    return f"{settings.service_models_dir.rstrip('/')}/{repo.replace('/', '--')}/{revision}"


def weights_record_path(directory: str) -> str:
    """The weights step's record of what it verified in a staged model directory, beside it."""
    return f"{directory}.verified.json"


# -- releases ---------------------------------------------------------------------------------------

def patch_record_path(release: Release) -> str:
    """Where the patch step records the set it applied to a release."""
    return f"{release.dir}/{PATCH_RECORDS[0]}"


def uv_binary(settings: Settings) -> str:
    return f"{settings.uv_install_dir}/bin/uv"


def uv_cache_dir(settings: Settings) -> str:
    """uv's cache, beside the releases by default: same filesystem, so installs are hard links."""
    return settings.uv_cache_dir or os.path.dirname(settings.venv_releases_dir.rstrip("/")) + "/uv-cache"


# -- the CUDA toolkit -------------------------------------------------------------------------------

def kept_paths(settings: Settings) -> tuple[str, ...]:
    """The kept toolkits' roots: `cuda-<version>` beside the link (/usr/local/cuda-12.8)."""
    parent = posixpath.dirname(settings.manifest.cuda["link_path"])
    return tuple(posixpath.join(parent, f"cuda-{version}") for version in settings.manifest.cuda["keep"])


@dataclass(frozen=True)
class RunfileSource:
    """Where the runfile for one architecture comes from and where its verified copy lives."""

    runfile: Runfile
    mode: str               # "prestaged", "host" (the host downloads) or "controller" (uploaded)
    cached: str             # the verified file: <cuda_cache_dir>/<file>, or the pre-staged path
    part: str | None        # download/upload target (<cached>.part); None when pre-staged


def runfile_source(settings: Settings, arch: str | None) -> RunfileSource | None:
    """The runfile source for `arch`, or None when the manifest has no runfile for it."""
    if arch not in settings.manifest.runfiles:
        return None
    return _runfile_source(settings, arch)


def _runfile_source(settings: Settings, arch: str) -> RunfileSource:
    runfile = settings.runfile(arch)
    if settings.cuda_runfile_path:
        return RunfileSource(runfile, "prestaged", settings.cuda_runfile_path, None)
    cached = posixpath.join(settings.cuda_cache_dir, runfile.file)
    return RunfileSource(runfile, settings.cuda_runfile_from, cached, cached + ".part")


def runfile_candidates(settings: Settings) -> tuple[str, ...]:
    """Every runfile path worth a stat, for every architecture of the manifest."""
    paths = []
    for arch in settings.manifest.runfiles:
        source = _runfile_source(settings, arch)
        paths += [source.cached] + ([source.part] if source.part else [])
    return tuple(dict.fromkeys(paths))
