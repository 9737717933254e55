"""`servestack rehearse`: the real deploy.py against sandbox hosts, the way a user runs it on a fleet.

1. boot sandbox GPU-host stand-ins (systemd, SSH, a stand-in GPU, CUDA 12.8 and a hand-made ml-env)
2. `pyinfra --dry --diff`: and prove the hosts did not change (a fingerprint before and after)
3. apply, 4. apply again: the second run must change nothing
5. the verification suite against the converged hosts

It ends with one machine-readable line: `rehearse: OK hosts=N first_run_changes=N ...`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from servestack.manifest import PROJECT_ROOT

console = Console(stderr=True)

STAND_IN_NOTICE = ("Stand-ins: the GPUs (nvidia-smi), the CUDA runfile and the CUDA wheels on these hosts are "
                   "small stand-ins; systemd, SSH, uv, the SGLang sources and the deploy are real.")


class RehearsalFailed(Exception):
    """A rehearsal step failed; the message says which and why."""


@dataclass
class Outcome:
    hosts: int = 0
    first_run_changes: int | None = None
    second_run_changes: int | None = None
    verify: dict = field(default_factory=lambda: {"passed": 0, "failed": 0, "skipped": 0})
    timings: dict = field(default_factory=dict)

    def line(self, status: str, reason: str = "") -> str:
        fields = (f"hosts={self.hosts} first_run_changes={_n(self.first_run_changes)} "
                  f"second_run_changes={_n(self.second_run_changes)} verify_passed={self.verify['passed']} "
                  f"verify_failed={self.verify['failed']} verify_skipped={self.verify['skipped']}")
        return f"rehearse: {status} {fields}" + (f" reason={reason!r}" if reason else "")


def _n(value) -> str:
    return "-" if value is None else str(value)


def pyinfra_argv(inventory: Path, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "pyinfra"), str(inventory), "deploy.py", *args]


def _run(lab, argv: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(lab.controller_argv(argv), cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def dry_run(lab, inventory: Path, outcome: Outcome) -> None:
    before = lab.snapshots()
    result = _timed(outcome, "dry run", lambda: _run(lab, pyinfra_argv(inventory, "--dry", "--diff")))
    console.print(result.stderr + result.stdout, markup=False, highlight=False)
    if result.returncode != 0:
        raise RehearsalFailed(f"dry run failed (exit {result.returncode})")
    changes = lab.changes(before, lab.snapshots())
    if changes:
        console.print("the dry run changed:\n" + "\n".join(changes), markup=False, highlight=False)
        raise RehearsalFailed("the dry run changed a host")
    console.print("[green]dry run: no host changed (fingerprints identical)[/]")


def apply(lab, inventory: Path, outcome: Outcome, label: str) -> int:
    result = _timed(outcome, label, lambda: _run(lab, pyinfra_argv(inventory, "-y", "--json")))
    try:
        totals = json.loads(result.stdout)["results"]["totals"]
    except (ValueError, KeyError):
        raise RehearsalFailed(f"{label}: pyinfra failed (exit {result.returncode}):\n"
                              f"{_tail(result.stdout + result.stderr)}") from None
    if result.returncode != 0 or totals.get("error"):
        raise RehearsalFailed(f"{label}: {totals.get('error', '?')} operation(s) failed:\n"
                              f"{_tail(result.stderr)}")
    console.print(f"{label}: {totals.get('success', 0)} changed, {totals.get('no_change', 0)} unchanged")
    return int(totals.get("success", 0))


def verify(lab, inventory: Path, outcome: Outcome) -> None:
    junit = lab.state_dir / "verify-junit.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "tests/verify", "--inventory", str(inventory),
            f"--junitxml={junit}", "-p", "no:cacheprovider", "-q", "-rs"]
    result = _timed(outcome, "verify", lambda: _run(lab, argv))
    console.print(_tail(result.stdout, 60), markup=False, highlight=False)
    if result.returncode not in (0, 1, 5):
        raise RehearsalFailed(f"the verification suite could not run (exit {result.returncode}):\n"
                              f"{_tail(result.stdout + result.stderr)}")
    outcome.verify = junit_counts(junit) if junit.exists() else outcome.verify
    if outcome.verify["failed"]:
        raise RehearsalFailed(f"{outcome.verify['failed']} verification check(s) failed")


def junit_counts(path: Path) -> dict:
    """passed/failed/skipped totals of a pytest JUnit XML report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(suite.get("tests", 0)) for suite in suites)
    failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
    skipped = sum(int(suite.get("skipped", 0)) for suite in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def _timed(outcome: Outcome, label: str, step):
    console.rule(label)
    started = time.monotonic()
    result = step()
    outcome.timings[label] = time.monotonic() - started
    return result


def summary(outcome: Outcome) -> Table:
    table = Table(title="servestack rehearsal")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for label, seconds in outcome.timings.items():
        table.add_row(label, f"{seconds:.1f}")
    return table


def rehearse(hosts: int = 2, keep: bool = False) -> int:
    """Run the rehearsal; print the summary and the final line; 0 only when everything held."""
    from servestack.sandbox.lab import Lab, gpu_spec

    outcome, status, reason = Outcome(hosts=hosts), "OK", ""
    console.print(f"[bold]{STAND_IN_NOTICE}[/]")
    lab = Lab("rehearse")
    try:
        inventory = _timed(outcome, "sandbox up", lambda: lab.up(hosts, gpu=gpu_spec()))
        dry_run(lab, inventory, outcome)
        outcome.first_run_changes = apply(lab, inventory, outcome, "first apply")
        outcome.second_run_changes = apply(lab, inventory, outcome, "second apply")
        if outcome.second_run_changes:
            raise RehearsalFailed(f"the second apply changed {outcome.second_run_changes} operation(s)")
        verify(lab, inventory, outcome)
    except (RehearsalFailed, subprocess.TimeoutExpired) as error:
        status, reason = "FAILED", str(error).splitlines()[0]
        console.print(f"[red]{error}[/]", markup=True, highlight=False)
    finally:
        if keep:
            console.print(f"sandbox kept: {lab.state_dir} (servestack sandbox down, with SERVESTACK_SANDBOX=rehearse)")
        else:
            lab.down()
    console.print(summary(outcome))
    console.print(STAND_IN_NOTICE)
    print(outcome.line(status, reason))
    return 0 if status == "OK" else 1
