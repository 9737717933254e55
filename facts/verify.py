"""The verification probes of servestack/checks.py, read through pyinfra (the deploy's last step).

Each probe group is one shell script printing framed sections; the script always exits 0, so a
host without a GPU, a toolkit or a service answers with sections saying so instead of failing.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from servestack.checks import Section, parse_sections


@dataclass(frozen=True)
class ProbeScript:
    """One probe group's script; shown by its group name in pyinfra's log lines, not its text."""

    group: str
    text: str = field(repr=False)
    prelude: str = field(default="", repr=False)  # a read it shares with other facts (facts/probe.py)

    def __str__(self) -> str:
        return self.group


class VerificationProbe(FactBase):
    """
    Returns ``{section name: Section(rc, text)}`` of one probe script.

    + probe: a ``ProbeScript`` of a ``servestack.checks`` probe group (``host_script(settings)``, ...)
    """

    probe_background = True  # starts nvidia-smi, nvcc, python, an HTTP request (facts/probe.py)

    def probe_parts(self, probe: ProbeScript) -> tuple[str, str] | None:
        return (probe.prelude, probe.text) if probe.prelude else None

    def command(self, probe: ProbeScript) -> str:
        return f"{probe.prelude}\n{probe.text}" if probe.prelude else probe.text

    @staticmethod
    def default() -> dict[str, Section]:
        return {}

    def process(self, output: list[str]) -> dict[str, Section]:
        return parse_sections("\n".join(output))


class VerificationRecord(FactBase):
    """
    The record the deploy's verify step left on the host (``operations/verify.py``), or None when
    there is none or it is not a JSON object.

    + path: the record file (``<servestack_state_dir>/verified.json``)
    """

    def command(self, path: str) -> str:
        return f"cat {shlex.quote(path)} 2>/dev/null; true"

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> dict | None:
        try:
            record = json.loads("\n".join(output))
        except ValueError:
            return None
        return record if isinstance(record, dict) else None
