"""What the host's ML environment looks like: venv_path, releases, activation history, backups.

`MlEnvState` is one shell script (files/scripts/ml-env-state.sh) that prints the raw records; its
`process` makes the value here, on the controller. The active environment's packages
(`ActivePackages`) start the environment's python, so they are a fact of their own, read only when
a change is due. Neither fails for "absent": a host without the configured python prints nothing.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex

from pyinfra.api import FactBase

from facts.framing import Section, split
from servestack.releases import RELEASE_ID, TOOL, encode
from servestack.scripts import python_script_command, script_command

HISTORY_KEY = "activations"
RESULT = "result"   # the section the host tool prints its result in (files/scripts/ml_env.py)


def tool_command(python: str, command: str, params: dict) -> str:
    """The venv step's host tool (files/scripts/ml_env.py, stdlib only) running `command` with
    `params` (base64 JSON): `python -I -S -c TOOL COMMAND PARAMS` (servestack/scripts.py)."""
    return python_script_command(python, TOOL, command, encode(params), site=False)


def tool_result(lines):
    """What a tool command printed as its result (JSON); None when it printed none (no python)."""
    found = split(lines).get(RESULT)
    return json.loads(found.text) if found else None


def guarded_tool_command(python: str, command: str, params: dict) -> str:
    """A tool command that prints nothing (instead of failing) when the host has no `python`."""
    return f"if command -v {shlex.quote(python)} >/dev/null 2>&1; then {tool_command(python, command, params)}; fi"


class MlEnvState(FactBase):
    """
    Returns a dict (or None when the host lacks ``python``):

    + venv_path: the environment's path (``venv_path``), a link to the active release's venv
    + releases_dir: where the releases are kept (``venv_releases_dir``)
    + state_dir: servestack's state directory (activation history, backups)
    + python: the host's interpreter that servestack builds with (``venv_python``)

    .. code:: python

        {
            "python": {"version": "3.11.2", "executable": "/usr/bin/python3"},
            "machine": "x86_64",
            "venv_path": {"path": "/opt/ml-env", "kind": "missing|link|broken-link|venv|other",
                          "target": ..., "realpath": ..., "release": "r-..." or None},
            "releases": {"r-...": {"status": "ok|failed|building|incomplete", "has_venv": True, ...}},
            "history": [{"release": ..., "previous": ..., "by": "deploy|rollback|adopt", "at": ...}],
            "backups": ["20260101T120000Z.json", ...],
            "latest_backup": {...} or None,
        }
    """

    def command(self, venv_path, releases_dir, state_dir, python="python3"):
        self.venv_path, self.releases_dir = venv_path, releases_dir
        return script_command("ml-env-state.sh", python, venv_path, releases_dir, state_dir)

    def process(self, output):
        sections = split(output)
        if "python" not in sections:
            return None
        return {
            "python": python_identity(sections["python"]),
            "machine": sections["machine"].text.strip(),
            "venv_path": venv_path_state(sections["venv_path"], self.venv_path, self.releases_dir),
            "releases": {name[len("release "):]: release_record(section) for name, section in sections.items()
                         if name.startswith("release ") and RELEASE_ID.match(name[len("release "):])},
            "history": (_json(sections.get("history")) or {}).get(HISTORY_KEY, []),
            "backups": [line for line in sections["backups"].lines if line],
            "latest_backup": _json(sections.get("latest_backup")),
        }


def _json(section: Section | None):
    """A JSON record's value; None when it is absent, empty or not JSON (as the host tool reads it)."""
    try:
        return json.loads(section.text) if section and section.text.strip() else None
    except ValueError:
        return None


def python_version(text: str) -> str:
    """`python -V`'s version as platform.python_version() gives it (x.y becomes x.y.0)."""
    match = re.match(r"[\w.+]+", text, re.ASCII)
    if match is None:
        raise ValueError(f"`python -V` printed no version: {text!r}")
    version = match.group()
    return version + ".0" if version.count(".") == 1 else version


def python_identity(section: Section) -> dict:
    version_line, executable = (list(section.lines) + ["", ""])[:2]
    return {"version": python_version(version_line.removeprefix("Python ").strip()), "executable": executable}


def release_of(link_target: str, releases_dir: str) -> str | None:
    """The release id a venv_path link names (`<releases_dir>/<id>/venv`), else None."""
    parent, leaf = posixpath.split(posixpath.normpath(link_target))
    name = posixpath.basename(parent)
    if leaf == "venv" and posixpath.dirname(parent) == posixpath.normpath(releases_dir) and RELEASE_ID.match(name):
        return name
    return None


def venv_path_state(section: Section, path: str, releases_dir: str) -> dict:
    """What sits at venv_path (the same verdicts as the host tool's `venv_path_state`)."""
    found = dict(line.split(" ", 1) for line in section.lines if " " in line)
    kind = found.get("kind", "missing")
    pyvenv = found.get("pyvenv") == "yes"
    state = {"path": path, "kind": kind, "target": found.get("target"), "realpath": found.get("realpath"),
             "release": None}
    if kind == "directory":
        state["kind"] = "venv" if pyvenv else "other"
    elif kind == "link":
        state["release"] = release_of(found["target"], releases_dir)  # the host tool prints a link's target
        if not pyvenv:
            state["kind"] = "broken-link"
    return state


def release_record(section: Section) -> dict:
    """A release's record (release.json), with `has_venv` and a `status` (incomplete by default)."""
    lines = list(section.lines)
    has_venv = bool(lines) and lines[0] == "venv yes"
    record = _json(Section(section.rc, tuple(lines[1:])))
    record = dict(record) if isinstance(record, dict) else {}
    record["has_venv"] = has_venv
    record.setdefault("status", "incomplete")
    return record


class ActivePackages(FactBase):
    """
    The active environment's packages, by running its own python (None when venv_path is not a
    venv or a link to one, or the host lacks ``python``):

    + venv_path: the environment's path (``venv_path``)
    + releases_dir: where the releases are kept (``venv_releases_dir``)
    + python: the host's interpreter that runs servestack's host tool (``venv_python``)

    .. code:: python

        {"python": "3.11.2", "prefix": "/opt/servestack/releases/r-.../venv",
         "packages": {"torch": "2.9.1+cu128", ...}}   # or {"error": "..."}
    """

    slow = True  # starts python twice

    def command(self, venv_path, releases_dir, python="python3"):
        return guarded_tool_command(python, "packages", {"venv_path": venv_path, "releases_dir": releases_dir})

    def process(self, output):
        return tool_result(output)


class MlEnvBackups(FactBase):
    """
    Summaries of the environment snapshots kept under ``<state_dir>/backups`` (oldest first):

    + state_dir: servestack's state directory
    + python: the host's interpreter that runs the tool (``venv_python``)

    .. code:: python

        [{"file": ".../20260101T120000Z.json", "timestamp": "20260101T120000Z",
          "venv_path": "/opt/ml-env", "realpath": ..., "release": "r-..." or None,
          "python": "3.11.2", "packages": 143, "torch": "2.9.1+cu128", "reason": "before change"}]
    """

    def command(self, state_dir, python="python3"):
        return guarded_tool_command(python, "backups", {"state_dir": state_dir})

    def process(self, output):
        return (tool_result(output) or {}).get("backups", [])

    @staticmethod
    def default() -> list:
        return []
