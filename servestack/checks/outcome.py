"""The verdict of one check on one host, and how a judge gives it.

A judge returns the detail of a pass, raises `Fail` with what it found, or raises `Skip` when it
cannot judge (the host lacks what the check needs), saying why; `Check.outcome` (catalogue.py)
makes the `Outcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


class Fail(Exception):
    """The check failed: the message says what was found."""


class Skip(Exception):
    """The check cannot judge on this host: the message says why."""


@dataclass(frozen=True)
class Outcome:
    """The verdict of one check on one host."""

    check: str
    status: str
    detail: str

    @property
    def passed(self) -> bool:
        return self.status == PASSED
