"""Stand-in wheels with a wheel for everything they require, for the unit tests' small indexes.

`build_with_requirements(name, version, dest)` builds the stand-in `name==version` (servestack's
builders: a code stand-in, or metadata-only) and, transitively, one wheel for each requirement it
declares on a Linux x86_64 CPython 3.11 host (no extras): at its `==` pin, else at the lowest version
its specifier allows (metadata-only, "1.0" when it names none). Enough for uv to resolve and install
them; what a real host resolves is closure.py's business.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement

from sandbox.standins.closure import host_environment
from sandbox.standins.index import normalize_project
from sandbox.standins.wheels import build_wheel, standin_wheel


def _version_for(requirement: Requirement) -> str:
    pins = [item.version for item in requirement.specifier if item.operator in ("==", "===")]
    if pins:
        return pins[0]
    floors = [item.version for item in requirement.specifier if item.operator in (">=", "~=")]
    return floors[0] if floors else "1.0"


def build_with_requirements(name: str, version: str, dest: Path, built: dict[str, Path] | None = None) -> list[Path]:
    """The stand-in `name==version` first, then a wheel for each thing it needs (see the module docstring)."""
    built = {} if built is None else built
    order: list[Path] = []
    pending = [(normalize_project(name), version)]
    chosen: dict[str, str] = {}
    while pending:
        project, pin = pending.pop(0)
        if chosen.setdefault(project, pin) != pin and project != normalize_project(name):
            continue   # one version of each requirement
        spec = standin_wheel(project, pin)
        if spec.filename in built:
            continue
        built[spec.filename] = build_wheel(spec, dest)
        order.append(built[spec.filename])
        for line in spec.requires:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate({**host_environment(), "extra": ""}):
                continue
            child = normalize_project(requirement.name)
            if child not in chosen:
                pending.append((child, _version_for(requirement)))
    return order
