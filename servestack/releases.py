"""Releases of the ML environment, decided on the control machine (pure functions, no host access).

A release is one venv built beside the others under `venv_releases_dir`:

    <releases_dir>/<id>/venv/              the environment (its scripts name this path)
    <releases_dir>/<id>/requirements.txt   the stack pins (the manifest's packages, in install order)
    <releases_dir>/<id>/pyproject.toml     the resolution input: pins + per-package index sources
    <releases_dir>/<id>/overrides.txt      the one overrides set, passed to every uv step
    <releases_dir>/<id>/lock.txt           `uv pip compile --generate-hashes` output: the exact set
    <releases_dir>/<id>/release.json       id, status, created, python, packages, lock sha256, inputs
    <releases_dir>/<id>/check.json         the release check's result: what it expected, with which
                                           environment, what it found, every problem
    <releases_dir>/<id>/check-scratch/     HOME and caches of the check's imports (`check_scratch`)

The id is `r-` + 12 hex digits of the sha256 of the release's *inputs* (the stack's name, every pin
and its source, the upload-time bound, the default index, uv's version, the host's Python
major.minor and architecture),
so the control machine predicts it without resolving anything, and a converged host rebuilds
nothing. A hand-made venv adopted on the first run is release `adopted-<UTC timestamp>`.

How the stack is resolved (why it looks like this):
- Packages from a non-default index (torch*, flashinfer-jit-cache) are pinned to that index with
  `tool.uv.sources` + `[[tool.uv.index]] explicit = true`: they can come from nowhere else, and
  nothing else comes from there (no `unsafe-best-match`, no dependency confusion).
- The overrides make the set coherent (sglang 0.5.9 pins flashinfer 0.6.3; the stack wants
  0.6.4): every pin from the default index, and each direct wheel as `name @ url`. uv drops a
  package's index source when it is overridden, so explicit-index pins are not overridden; their
  local labels (`+cu130`) already satisfy dependents' pins such as sglang's `torch==2.9.1`.
- Pinning the local label (`torch==2.9.1+cu130`) is what defeats the reference upgrade's trap: a
  pin without it is satisfied by an installed `+cu128` build.
- The stack's `exclude_newer` bounds every upload time (`upload_bound`): every host of a fleet that
  builds the release, today or in a year, resolves the same set (a resolution of sglang 0.5.9 without
  it picked numpy, pillow, protobuf and apache-tvm-ffi releases from months later). The bound is an
  input, so it is part of the release id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from servestack.errors import ConfigError

SCRIPTS = Path(__file__).resolve().parent.parent / "files" / "scripts"
TOOL = SCRIPTS / "ml_env.py"
CHECK = SCRIPTS / "check_release.py"
DEFAULT_INDEX = "pypi"  # the manifest's [indexes] entry uv treats as the default index
IMPORT_CHECKS = ("flashinfer", "sglang")  # flashinfer's import runs its own version check
RELEASE_ID = re.compile(r"^(r-[0-9a-f]{12}|adopted-\d{8}T\d{6}Z)$")
INPUTS_SCHEMA = 2  # 2: the stack's name, torch_cuda and exclude_newer


@dataclass(frozen=True)
class Release:
    """A release as other steps need it: the service runs `python` by its release path."""

    id: str
    dir: str

    @property
    def venv(self) -> str:
        return f"{self.dir}/venv"

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"

    @property
    def check_scratch(self) -> str:
        """Where the release check's imports write (its HOME and caches: servestack/serving.py
        `service_environment` with `writable`), never the service's own directories."""
        return f"{self.dir}/check-scratch"


@dataclass(frozen=True)
class ReleasePlan(Release):
    """One host's target release (where it lives, as a `Release`) and what builds it."""

    inputs: dict = field(repr=False)
    files: dict = field(repr=False)
    steps: dict = field(repr=False)
    bound: list = field(repr=False)
    expect: dict = field(repr=False)


def release_at(releases_dir: str, release_id: str) -> Release:
    return Release(release_id, f"{releases_dir}/{release_id}")


def python_series(version: str) -> str:
    """'3.11.2' -> '3.11': a patch update of the host's Python keeps the release."""
    release = Version(version).release
    return f"{release[0]}.{release[1]}"


def package_source(settings, package, arch: str) -> tuple[str, str]:
    """('index', url) or ('wheel', url) for one manifest package on this host."""
    if package.wheel:
        if arch not in package.wheel and not settings.wheel_urls.get(package.name):
            raise ConfigError(f"host {settings.host_name}: {settings.manifest.path} has no {package.name} wheel for "
                              f"architecture {arch!r} (it has {sorted(package.wheel)})")
        return "wheel", settings.wheel_url(package, arch)
    return "index", settings.index_url(package.index)


def release_inputs(settings, arch: str, python_version: str) -> dict:
    """Everything that decides a release's contents; hashed into its id."""
    packages = []
    for package in settings.packages:
        kind, url = package_source(settings, package, arch)
        packages.append({"name": package.name, "version": package.version, "step": package.step,
                         "index_name": package.index, kind: url})
    return {
        "schema": INPUTS_SCHEMA,
        "stack": settings.service_stack,
        "exclude_newer": settings.stack.exclude_newer,
        "torch_cuda": settings.stack.torch_cuda,
        "packages": packages,
        "default_index": settings.index_url(DEFAULT_INDEX),
        "uv": settings.manifest.uv["version"],
        "python": python_series(python_version),
        "arch": arch,
    }


def release_id(inputs: dict) -> str:
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode())
    return "r-" + digest.hexdigest()[:12]


def requirements_text(inputs: dict) -> str:
    lines = ["# The stack pins, in install order (step: packages); resolved into lock.txt."]
    lines += [f"{p['name']}=={p['version']}  # step {p['step']}" for p in inputs["packages"]]
    return "\n".join(lines) + "\n"


def overrides_text(inputs: dict) -> str:
    lines = ["# Applied to every uv step: makes the stack coherent despite dependents' pins."]
    for package in inputs["packages"]:
        if "wheel" in package:
            lines.append(f"{package['name']} @ {package['wheel']}")
        elif package["index_name"] == DEFAULT_INDEX:
            lines.append(f"{package['name']}=={package['version']}")
    return "\n".join(lines) + "\n"


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def pyproject_text(inputs: dict) -> str:
    """The resolution input: pins, explicit per-package indexes, the direct wheels."""
    dependencies = ",\n".join(f"    {_toml_string(p['name'] + '==' + p['version'])}"
                              for p in inputs["packages"])
    explicit = {}
    sources = []
    for package in inputs["packages"]:
        if "wheel" in package:
            sources.append(f"{package['name']} = {{ url = {_toml_string(package['wheel'])} }}")
        elif package["index_name"] != DEFAULT_INDEX:
            explicit[package["index_name"]] = package["index"]
            sources.append(f"{package['name']} = {{ index = {_toml_string(package['index_name'])} }}")
    parts = ["[project]", 'name = "servestack-release"', 'version = "0"',
             f"dependencies = [\n{dependencies},\n]", ""]
    for name, url in explicit.items():
        parts += ["[[tool.uv.index]]", f"name = {_toml_string(name)}", f"url = {_toml_string(url)}",
                  "explicit = true", ""]
    parts += ["[[tool.uv.index]]", f"name = {_toml_string(DEFAULT_INDEX)}",
              f"url = {_toml_string(inputs['default_index'])}", "default = true", "",
              "[tool.uv.sources]", *sources]
    return "\n".join(parts) + "\n"


def upload_bound(inputs: dict) -> list[str]:
    """uv's arguments bounding what the resolution may pick by upload time: the stack's
    `exclude_newer`, except for the pins of other indexes (exact pins: download.pytorch.org and
    flashinfer.ai give no upload time for many files, and uv drops a file without one under a bound).
    Their dependencies from the default index stay bounded."""
    exempt = sorted(p["name"] for p in inputs["packages"] if p["index_name"] not in (DEFAULT_INDEX, None))
    return (["--exclude-newer", inputs["exclude_newer"]]
            + [argument for name in exempt for argument in ("--exclude-newer-package", f"{name}=false")])


def release_plan(settings, arch: str, python_version: str) -> ReleasePlan:
    inputs = release_inputs(settings, arch, python_version)
    pins = {p["name"]: p["version"] for p in inputs["packages"]}
    target = release_at(settings.venv_releases_dir, release_id(inputs))
    return ReleasePlan(
        id=target.id,
        dir=target.dir,
        inputs=inputs,
        files={"requirements.txt": requirements_text(inputs), "overrides.txt": overrides_text(inputs),
               "pyproject.toml": pyproject_text(inputs)},
        steps={p["name"]: p["step"] for p in inputs["packages"]},
        bound=upload_bound(inputs),
        expect={"packages": pins, "torch_cuda": inputs["torch_cuda"],
                "wheels": {p["name"]: p["wheel"].rsplit("/", 1)[-1] for p in inputs["packages"] if "wheel" in p},
                "imports": list(IMPORT_CHECKS)},
    )


# --- the host tool's parameters (facts/venv.py `tool_command` sends the tool) ------------------------

def encode(params: dict) -> str:
    """The tool's parameters as its argument: base64 of JSON (no shell quoting needed)."""
    return base64.b64encode(json.dumps(params, sort_keys=True).encode()).decode()


# --- decisions ----------------------------------------------------------------------------------

def package_diff(before: dict | None, after: dict) -> dict:
    """Added, removed and changed packages (name -> version, local label included) between two sets."""
    before = {canonical_name(name): (name, version) for name, version in (before or {}).items()}
    after = {canonical_name(name): (name, version) for name, version in after.items()}
    return {
        "added": sorted((after[key][0], after[key][1]) for key in after.keys() - before.keys()),
        "removed": sorted((before[key][0], before[key][1]) for key in before.keys() - after.keys()),
        "changed": sorted((after[key][0], before[key][1], after[key][1])
                          for key in after.keys() & before.keys() if before[key][1] != after[key][1]),
    }


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def format_diff(diff: dict, before_label: str, after_label: str, partial: bool) -> str:
    """A unified-diff-like package listing for `--diff`."""
    lines = [f"--- {before_label}", f"+++ {after_label}"]
    lines += [f"- {name}=={version}" for name, version in diff["removed"]]
    lines += [f"~ {name} {old} -> {new}" for name, old, new in diff["changed"]]
    lines += [f"+ {name}=={version}" for name, version in diff["added"]]
    if not (diff["removed"] or diff["changed"] or diff["added"]):
        lines.append("  (no package changes)")
    if partial:
        lines.append("  (stack packages only: their dependencies are resolved on the host when the "
                     "release is built)")
    return "\n".join(lines)


class NoRollbackTarget(Exception):
    """There is nothing (usable) to roll back to; the message says why."""


def rollback_target(history: list, releases: dict, active: str | None, explicit: str | None) -> str:
    """The release rollback.py re-activates.

    Default: the release that was active before the most recent deploy activation. Rollback
    activations are not deploys, so running rollback again picks the same target (a no-op);
    running deploy.py again rolls forward. `explicit` (venv_rollback_to) names any kept release.
    """
    kept = ", ".join(sorted(releases)) or "none"
    if explicit:
        target, why = explicit, f"venv_rollback_to={explicit}"
    else:
        deploys = [entry for entry in history if entry.get("by") == "deploy"]
        if not deploys or not deploys[-1].get("previous"):
            raise NoRollbackTarget("nothing to roll back to: no release was active before the last deploy ("
                                   + (f"active: {active}; " if active else "") + f"kept releases: {kept})")
        target = deploys[-1]["previous"]
        why = f"the release active before the deploy of {deploys[-1]['release']}"
    record = releases.get(target)
    if record is None:
        raise NoRollbackTarget(f"cannot roll back to {target} ({why}): it is not kept on the host "
                               f"(kept releases: {kept})")
    if record.get("status") != "ok" or not record.get("has_venv"):
        raise NoRollbackTarget(f"cannot roll back to {target} ({why}): its status is "
                               f"{record.get('status')!r}, not a complete release")
    return target


def releases_to_prune(releases: dict, history: list, active: str | None, keep: int) -> list[str]:
    """Releases beyond the newest `keep`, never the active one, the previous one, or an adopted one.

    Rank: active first, then by last activation (newest first), then never-activated releases by
    creation time. Adopted (hand-made) venvs are never deleted: servestack did not build them.
    """
    last_active = {}
    previous = None
    for number, entry in enumerate(history):
        last_active[entry.get("release")] = number
    for entry in reversed(history):
        if entry.get("release") == active:
            previous = entry.get("previous")
            break
    ranked = sorted(releases, key=lambda rid: (rid != active, -last_active.get(rid, -1),
                                               _negated(releases[rid].get("created") or "")))
    kept = set(ranked[:keep]) | {active, previous}
    return [rid for rid in ranked if rid not in kept and not releases[rid].get("adopted")]


def _negated(stamp: str) -> str:
    return "".join(chr(0x10FFFF - ord(character)) for character in stamp)
