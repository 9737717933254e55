"""Each stack's whole package set as a real host resolves it, and the real metadata of every package.

`resolve(stack)` resolves a stack the way a host's venv step does (the release's own pyproject.toml,
overrides.txt and upload-time bound from servestack/releases.py, the same uv), against the REAL
PyPI, for the sandbox hosts' Python on x86_64. The wheels PyPI does not host (the torch 2.9.1+cu130
family, the sgl-kernel +cu130 file, flashinfer's jit cache) stand in with their kept Requires-Dist
(kept_metadata.toml), served on loopback. `pypi_metadata(pins)` reads the real METADATA of PyPI
packages without downloading them (pip's --dry-run --report uses the index's .metadata files).

The sandbox serves its hosts exactly this set (build.py): so a sandbox host resolves what a real
host resolves. Both are kept in the sandbox cache, keyed by what decides them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import AbstractSet, cast

from packaging.markers import default_environment
from packaging.requirements import Requirement

from sandbox.rootfs import cache_dir
from sandbox.standins.index import normalize_project, write_simple_index
from sandbox.standins.pypi import HOST_PLATFORMS, pip_command, pip_environment
from sandbox.standins.stack import HOST_PYTHON, HOST_PYTHON_VERSION, manifest
from sandbox.standins.wheels import build_wheel, kept_metadata, standin_wheel
from servestack.manifest import PROJECT_ROOT, Stack

PLATFORM = "x86_64-manylinux_2_34"   # uv's --python-platform for the hosts (glibc 2.36)


def _tag(python: str) -> str:
    abi = "cp" + python.replace(".", "")
    return f"{abi}-{abi}-manylinux_2_28_x86_64"


def unreachable_wheels(dest: Path, python: str = HOST_PYTHON) -> dict[str, Path]:
    """Stand-ins, tagged for `python`, of the kept wheels PyPI does not host (a local label in the
    version: '+cu130'), each with its whole kept Requires-Dist. {project: wheel}."""
    built = {}
    for key in kept_metadata():
        name, version = key.split("==")
        if "+" in version:
            spec = standin_wheel(name, version)
            if spec.tag.startswith("cp3"):
                spec = dataclasses.replace(spec, tag=_tag(python))
            built[normalize_project(name)] = build_wheel(spec, dest)
    return built


def stack_host_data(stack: Stack) -> dict:
    """Host data that builds `stack`'s release: a profile serving it, else the default profile on it."""
    profiles = manifest().service["profiles"]
    named = sorted(name for name, profile in profiles.items() if profile.get("stack") == stack.name)
    if named:
        return {"service_profile": named[0]}
    return {"service_stack": stack.name, "service_patches": []}


def _cached(kind: str, key: dict, compute) -> dict:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "closure" / f"{kind}-{digest}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True))
    temporary.replace(path)
    return value


def resolve(stack: Stack, python: str = HOST_PYTHON, manifest_path: str | None = None) -> dict[str, str]:
    """{project: version} of `stack` resolved as a host on `python` resolves it, on the real PyPI;
    a direct wheel's entry is its file name. `manifest_path`: another manifest to read the stack from."""
    from servestack.releases import release_plan   # the hosts' own resolution inputs
    from sandbox.artifacts import ArtifactServer
    from servestack.settings import settings_from_data

    def plan_for(base_url: str, wheels: dict[str, Path]):
        data = {**stack_host_data(stack), "index_torch_url": f"{base_url}/torch",
                "index_flashinfer_url": f"{base_url}/flashinfer"}
        if manifest_path:
            data["servestack_manifest"] = manifest_path
        for package in stack.packages:
            if package.wheel:
                data["wheel_url_" + normalize_project(package.name).replace("-", "_")] = (
                    f"{base_url}/wheels/{wheels[normalize_project(package.name)].name}")
        minor = HOST_PYTHON_VERSION if python == HOST_PYTHON else f"{python}.0"
        return release_plan(settings_from_data("sandbox", data), "x86_64", minor)

    def compute() -> dict:
        work = Path(tempfile.mkdtemp(prefix="stack-closure-"))
        try:
            wheels = unreachable_wheels(work / "wheels", python)
            write_simple_index(work / "torch", [w for n, w in wheels.items() if n.startswith("torch")])
            write_simple_index(work / "flashinfer", [w for n, w in wheels.items() if n.startswith("flashinfer")])
            with ArtifactServer(work) as server:
                plan = plan_for(server.url, wheels)
                for name, text in plan.files.items():
                    (work / name).write_text(text)
                out = subprocess.run(
                    [_uv(), "pip", "compile", "pyproject.toml", "--quiet", "--no-config", "--overrides",
                     "overrides.txt", "--python-version", python, "--python-platform", PLATFORM, "--no-header",
                     "--index-strategy", "first-index", *plan.bound, "-o", "lock.txt"],
                    cwd=work, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(f"resolving stack {stack.name} on PyPI failed: {out.stderr.strip()[-2000:]}")
            return parse_lock((work / "lock.txt").read_text())
        finally:
            shutil.rmtree(work, ignore_errors=True)

    key = {"stack": dataclasses.asdict(stack), "python": python, "uv": manifest().uv["version"],
           "kept": kept_metadata(), "manifest": manifest_path}
    return _cached("lock", key, compute)


def parse_lock(text: str) -> dict[str, str]:
    """{project: version} of a `uv pip compile` output (a direct URL's entry: its file name)."""
    lock = {}
    for line in text.splitlines():
        if not line or line.startswith((" ", "#")):
            continue
        spec = line.split(";")[0].strip()
        if " @ " in spec:
            name, url = spec.split(" @ ", 1)
            lock[normalize_project(name)] = url.rsplit("/", 1)[-1]
        else:
            name, _, version = spec.partition("==")
            lock[normalize_project(name)] = version.strip()
    return lock


def _uv() -> str:
    """servestack.sh's own uv (`.tools/bin`, not on PATH: `./servestack.sh rehearse` failed without it), else PATH's."""
    own = PROJECT_ROOT / ".tools" / "bin" / "uv"
    found = str(own) if own.is_file() else shutil.which("uv")
    if not found:
        raise RuntimeError("uv is needed on the control machine to resolve the stacks (servestack.sh installs it)")
    return found


def pypi_metadata(pins: dict[str, str], python: str = HOST_PYTHON) -> dict[str, dict]:
    """{project: {"requires_dist": [...], "provides_extra": [...]}} of each `pins` project at its
    version, as its real wheel on PyPI declares it for the hosts' platform."""
    def compute() -> dict:
        with tempfile.TemporaryDirectory(prefix="pypi-metadata-") as work:
            report = Path(work) / "report.json"
            command = pip_command("install", python) + [
                "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--target", str(Path(work) / "t"),
                "--report", str(report), *(f"{name}=={version}" for name, version in sorted(pins.items()))]
            out = subprocess.run(command, capture_output=True, text=True, env=pip_environment(), timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"reading PyPI's metadata failed: {out.stderr.strip()[-2000:]}")
            found = {}
            for item in json.loads(report.read_text())["install"]:
                metadata = item["metadata"]
                found[normalize_project(metadata["name"])] = {
                    "requires_dist": metadata.get("requires_dist", []),
                    "provides_extra": metadata.get("provides_extra", [])}
            return found

    return _cached("metadata", {"pins": pins, "python": python, "platforms": HOST_PLATFORMS}, compute)


def host_environment(python: str = HOST_PYTHON) -> dict[str, str]:
    """The marker environment of a sandbox host (CPython `python` on Linux x86_64)."""
    environment = default_environment()
    environment.update({"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                        "implementation_name": "cpython", "platform_python_implementation": "CPython"})
    return cast("dict[str, str]", environment)  # packaging's Environment: str values, which mypy reads as object


def requirements_closure(roots: set[str], metadata: dict[str, dict], stop: AbstractSet[str] = frozenset(),
                         python: str = HOST_PYTHON) -> set[str]:
    """The projects `roots` need on a host, following each one's Requires-Dist (with the extras
    asked for) within `metadata`'s projects, never into those of `stop`."""
    needed: set[str] = set()
    pending: list[tuple[str, frozenset[str]]] = [(root, frozenset()) for root in roots if root in metadata]
    seen = set()
    while pending:
        project, extras = pending.pop()
        if (project, extras) in seen:
            continue
        seen.add((project, extras))
        needed.add(project)
        for line in metadata[project]["requires_dist"]:
            requirement = Requirement(line)
            child = normalize_project(requirement.name)
            wanted = any(requirement.marker is None or requirement.marker.evaluate({**host_environment(python),
                                                                                     "extra": extra})
                         for extra in ({""} | set(extras)))
            if wanted and child in metadata and child not in stop:
                pending.append((child, frozenset(requirement.extras)))
    return needed
