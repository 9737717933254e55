"""Reading what the host-side checks printed: report sections, the sample's results, versions."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from facts.framing import Section, split
from facts.toolkit import parse_json_object
from facts.verify import REPORT, HostReport
from servestack import patchlib
from servestack.paths import PATCH_RECORDS


def nonblank(section: Section) -> list[str]:
    return [line for line in section.lines if line.strip()]


def tail(section: Section, count: int) -> str:
    return "\n".join(nonblank(section)[-count:])


def json_section(section: Section, name: str) -> dict | None:
    """The JSON object printed as the section `name` (the last one) in `section`'s output, or None."""
    found = split(section.lines).get(name)
    return parse_json_object(found.text) if found else None


def report(section: Section) -> dict | None:
    """The report a probe printed: its section REPORT."""
    return json_section(section, REPORT)


def patch_report(section: Section) -> dict | None:
    """The patch check's report: its section patchlib.RESULT (files/scripts/patch-check.sh)."""
    return json_section(section, patchlib.RESULT)


def sample_results(section: Section) -> list[str]:
    """The sample's result lines: `device N ...: PASS|FAIL ...` and `devices N: PASS|FAIL`."""
    return [line for line in section.lines if line.startswith(("device ", "devices "))]


def sample_flags(section: Section) -> str:
    """The nvcc flags the sample was built with, as it printed them (`nvcc -gencode ...`)."""
    return next((line for line in section.lines if line.startswith("nvcc ")), "nvcc")


def package_owner(host: HostReport) -> tuple[str, str, str] | None:
    """(manager, package, version) of the package owning the toolkit's nvcc, or None."""
    for line in host.toolkit_package:
        fields = line.split()
        if len(fields) == 3 and fields[0] in ("dpkg", "rpm", "wheel"):
            return fields[0], fields[1], fields[2]
    return None


def packaged_release(host: HostReport) -> str | None:
    """'cuda-compiler-13-0 13.0.2-1': the meta package giving a packaged toolkit's release."""
    releases = [line.split(maxsplit=1)[1] for line in host.toolkit_package if line.startswith("dpkg-release ")]
    return releases[0] if releases else None


def patch_record_for(host: HostReport) -> str | None:
    """The record the patches step wrote for the active release: `<release>/patches.json`
    (docs/design.md) when present, else the step's default `<venv>/servestack-patches.json` (None)."""
    designed = [path for path in host.records if path.endswith("/" + PATCH_RECORDS[0])]
    return designed[0] if designed else None


def major_minor(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def version_or_none(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None
