"""What a deploy or rollback run tells the operator at its end, and when it is interrupted.

`install(state)` (config.py, once pyinfra has loaded the inventory) registers a state callback that
follows each host through the execute stage (the operation it is in), and has servestack/hostrun.py keep a
reason for each host that fails.
Then:

- Ctrl-C or SIGTERM: one line per host naming the step it was in and what the next run will do
  about it, and the run ends with 130 (SIGINT) or 143 (SIGTERM), never 0. Long host-side steps
  (the CUDA install, a venv build, a model download, a health-gated restart) run under
  files/scripts/busy.sh: they finish on the host, holding its lock, and a run that comes meanwhile
  refuses the host naming them.
- A normal end: the recap, one line per host in the spirit of Ansible's PLAY RECAP: changed,
  unchanged, failed or refused, the release the run leaves active, whether the service restarted,
  and the first reason of a failure or refusal, as servestack/hostrun.py kept it; with `--json`, the
  same as one JSON object on standard error (standard output stays pyinfra's JSON).
- A run that would ask for confirmation with standard input closed (or /dev/null) is refused before
  connecting, with a message (`prompt_problem`), instead of pyinfra's EOFError traceback.
- pyinfra's "[host] Ready: deploy.py" line is left out for a host that was just refused (a filter on
  pyinfra's logger): the refusal is that host's last word.

Everything here uses pyinfra's public callbacks and logger and Python's own hooks (signal, atexit).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import stat
import sys
from dataclasses import dataclass

from pyinfra.api.state import BaseStateCallback

from servestack.hostrun import REFUSED, UNREACHABLE, notes, op_name, reasons, record_failed_commands

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# What the next run does about a step interrupted on a host (by words of its operation's name).
LONG_STEPS = {
    "cuda toolkit": "the download or installer goes on on the host, holding the host's lock; the next run "
             "refuses the host until it ends, then finishes or moves aside the install (toolkit-install.json)",
    "build release": "the build goes on on the host, holding the host's lock; the next run refuses the host "
                     "until it ends, then uses the release if it was built and checked, or rebuilds it",
    "stage model weights": "the download goes on on the host, holding the host's lock; the next run refuses the "
                           "host until it ends, then finds the weights verified, or resumes the download",
    "health-gated restart": "the health gate goes on on the host until the service is healthy or rolled back "
                            "to its last good unit, holding the host's lock; the next run refuses the host "
                            "until then, then checks the unit again",
}
SHORT_STEP = ("the next run finds this run's lock stale, says so in its first lines, replaces it and "
              "converges the host again (each step checks what is there)")


@dataclass
class HostProgress:
    current: str | None = None                 # the operation running on the host now (execute)


class RunReport(BaseStateCallback):
    """Follows every host through the execute stage (pyinfra's public state callbacks)."""
    # pyinfra types its callbacks as static methods but calls them on the instance it was given
    # (State.trigger_callbacks, pyinfra/api/state.py:304): hence the override ignores below.

    def __init__(self, state):
        self.state = state
        self.hosts: dict[str, HostProgress] = {}

    def progress(self, host) -> HostProgress:
        return self.hosts.setdefault(host.name, HostProgress())

    def operation_host_start(self, state, host, op_hash):  # type: ignore[override]
        self.progress(host).current = op_name(state, op_hash)

    def operation_host_success(self, state, host, op_hash, retry_count=0):  # type: ignore[override]
        self.progress(host).current = None

    def operation_host_error(self, state, host, op_hash, retry_count=0, max_retries=0):  # type: ignore[override]
        self.progress(host).current = None


def next_run_for(step: str) -> str:
    return next((what for words, what in LONG_STEPS.items() if words in step.lower()), SHORT_STEP)


def interruption_lines(report: RunReport) -> list[str]:
    """One line per host: the step it was in, and what the next run will do about it."""
    state = report.state
    if not state.is_executing:
        return ["interrupted while pyinfra prepared the run: nothing was changed on any host"]
    lines = []
    for host in state.inventory.iter_activated_hosts():
        progress = report.progress(host)
        if progress.current:
            lines.append(f"[{host.name}] interrupted during '{progress.current}': {next_run_for(progress.current)}")
        else:
            lines.append(f"[{host.name}] interrupted between steps: {SHORT_STEP}")
    return lines


def host_recap(report: RunReport, host) -> dict:
    """changed / unchanged / failed / refused, with counts, the release left active, the service."""
    state = report.state
    said = reasons(state).get(host.name, [])
    ops = [state.get_op_data_for_host(host, op_hash).operation_meta for op_hash in state.ops.get(host, {})]
    complete = [meta for meta in ops if meta.is_complete()]
    changed = sum(1 for meta in complete if meta.did_change())
    failed = host in state.failed_hosts
    noted = notes(state).get(host.name, {})
    if failed:   # refused: servestack would not touch it, and nothing changed; failed: a step failed
        status = said[0].kind if not changed and said and said[0].kind in (REFUSED, UNREACHABLE) else "failed"
    else:
        status = "changed" if changed else "unchanged"
    reason = said[0].text if said else None
    restarted = any("Health-gated restart" in name and meta.did_change()
                    for op_hash, meta in zip(state.ops.get(host, {}), ops) if meta.is_complete()
                    for name in state.get_op_meta(op_hash).names)
    untouched = status in (REFUSED, UNREACHABLE)
    return {"host": host.name, "status": status, "changed": 0 if untouched else changed,
            "unchanged": 0 if untouched else len(complete) - changed,
            "release": noted.get("release") if status in ("changed", "unchanged") else noted.get("was"),
            "service_restarted": restarted, "reason": reason}


def recap(report: RunReport) -> list[dict]:
    return [host_recap(report, host) for host in report.state.inventory if report.state.is_host_in_limit(host)]


def recap_lines(rows: list[dict]) -> list[str]:
    width = max([len(row["host"]) for row in rows] + [4])
    status_width = max([len(row["status"]) for row in rows] + [9])
    lines = ["SERVESTACK RECAP"]
    for row in rows:
        release = row["release"] or "-"
        service = "restarted" if row["service_restarted"] else "not restarted"
        line = (f"{row['host']:<{width}}  {row['status']:<{status_width}} changed={row['changed']} "
                f"unchanged={row['unchanged']} release={release} service={service}")
        if row["reason"]:
            line += f"  reason: {row['reason']}"
        lines.append(line)
    return lines


def _write(lines: list[str]) -> None:
    sys.stdout.flush()
    sys.stderr.write("".join(f"{line}\n" for line in lines))
    sys.stderr.flush()


def _on_signal(report: RunReport, signum):
    def handler(number, frame):
        _write(interruption_lines(report))
        os._exit(EXIT_STATUS[signum])
    return handler


def _at_exit(report: RunReport, as_json: bool, dry: bool):
    def show():
        if dry or (not report.state.is_executing and not reasons(report.state)):
            return  # a dry run, or nothing ran: pyinfra's own output says it all
        rows = recap(report)
        _write(recap_lines(rows) if not as_json else [json.dumps({"servestack_recap": rows}, sort_keys=True)])
    return show


def _stdin_closed(fd: int = 0) -> bool:
    """Standard input is closed, or /dev/null: a prompt would read end-of-file at once."""
    try:
        found = os.fstat(fd)
    except OSError:
        return True
    null = os.stat(os.devnull)
    return stat.S_ISCHR(found.st_mode) and found.st_rdev == null.st_rdev


def prompt_problem(argv: list[str], environ=os.environ, fd: int = 0) -> str | None:
    """Why this pyinfra run cannot ask for its confirmation, or None (it passes -y, --dry, or can read)."""
    yes = environ.get("PYINFRA_YES", "").lower() in ("1", "true", "yes")
    asks = not ({"-y", "--yes", "--dry"} & set(argv)) and not yes
    if asks and _stdin_closed(fd):
        return ("pyinfra asks for confirmation before it changes anything, but standard input is closed: "
                "look with --dry first, then run with -y to apply without asking")
    return None


class NoReadyAfterRefusal(logging.Filter):
    """Drops pyinfra's "[host] Ready: <deploy file>" line for a host this run refused."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        message = ANSI.sub("", record.getMessage())
        if "Ready:" not in message:
            return True
        return not any(f"[{name}]" in message for name in reasons(self.state))


def install(state, argv: list[str] | None = None) -> RunReport:
    """Follow this run's hosts: report interruptions, and the recap at the end."""
    argv = sys.argv if argv is None else argv
    report = RunReport(state)
    state.add_callback_handler(report)
    record_failed_commands(state)
    for signum in EXIT_STATUS:
        signal.signal(signum, _on_signal(report, signum))
    atexit.register(_at_exit(report, "--json" in argv, "--dry" in argv))
    logging.getLogger("pyinfra").addFilter(NoReadyAfterRefusal(state))
    return report
