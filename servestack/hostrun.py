"""One servestack run as the hosts see it: its id, its lock, and how its operations speak.

Helpers shared by the preflight and toolkit operations (control-machine side):

- `run_id(state)`: one id per pyinfra run (per `State`), written into the host lock and records;
- `plan` / `noop`: the per-host lines `--dry --diff` shows ("download 4.3 GB from ...");
- `refuse_now` (prepare: fail the host before anything runs) and `refusal` (execute: a command
  that fails the host with its reasons), each reason one line naming the host;
- `run_remote`: run a command with the current operation's connection arguments (sudo, ...);
- `release_lock_on_failure`: a state callback releasing this run's lock on a host that fails;
- `keep` / `kept_with_release`: bookkeeping writes (records, memos) that ride with the lock's release.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import datetime, timezone
from weakref import WeakKeyDictionary

from pyinfra import logger
from pyinfra.api import FunctionCommand
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import ContextObject

from facts.host import release_lock_command

_RUNS: "WeakKeyDictionary" = WeakKeyDictionary()
_LOCKED: "WeakKeyDictionary" = WeakKeyDictionary()   # state -> {host name: state dir}
_KEPT: "WeakKeyDictionary" = WeakKeyDictionary()     # state -> {host name: [(what, command)]}
KEPT_FAILED = "servestack-kept-failed"


def utc_stamp() -> str:
    """A compact UTC timestamp for file names and records: 20261130T021500Z."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def controller_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_id(state) -> str:
    """This run's id (one per pyinfra State): `<UTC>-<8 hex>`."""
    if state not in _RUNS:
        _RUNS[state] = {"id": f"{utc_stamp()}-{uuid.uuid4().hex[:8]}", "started": utc_stamp()}
    return _RUNS[state]["id"]


def run_started(state) -> str:
    run_id(state)
    return _RUNS[state]["started"]


def real_host(host):
    """The Host behind pyinfra's `host` context proxy (state sets must hold real hosts)."""
    return host._get_module() if isinstance(host, ContextObject) else host


def is_executing(host) -> bool:
    return bool(host.state.is_executing)


def host_refused(host) -> bool:
    """Whether this host already failed (e.g. refused by preflight) in this run."""
    return real_host(host) in host.state.failed_hosts


def plan(host, text: str) -> None:
    """A line of what this step does on this host, shown with --diff (before the first yield)."""
    if host.state.config.DIFF:
        host.log(text)


def noop(host, text: str) -> None:
    """No change: pyinfra's noop, also shown with --diff so a dry run tells every decision."""
    host.noop(text)
    if host.state.config.DIFF and not host.state.print_noop_info:
        host.log(f"no change: {text}")


def _log_problems(host, problems: list[str]) -> None:
    for problem in problems:
        host.log_styled(f"refused: {problem}", fg="red", log_func=logger.error)


def refuse_now(host, problems: list[str]) -> None:
    """Prepare stage: log one line per problem and fail the host, so nothing runs on it."""
    _log_problems(host, problems)
    host.state.fail_hosts({real_host(host)})


def _fail(state, host, problems):
    _log_problems(host, problems)
    return False


def refusal(problems: list[str]) -> FunctionCommand:
    """Execute stage: a command that logs the problems and fails the host (others go on)."""
    return FunctionCommand(_fail, (list(problems),), {})


def connector_arguments(host) -> dict:
    """The connection arguments (sudo, su, env, ...) of the current operation, or the host's."""
    arguments = host.current_op_global_arguments
    if arguments is None:
        arguments, _ = pop_global_arguments(host.state, host, {})
    return {key: arguments[key] for key in CONNECTOR_ARGUMENT_KEYS if key in arguments}


def run_remote(host, command: str, **overrides) -> tuple[bool, list[str], list[str]]:
    """Run `command` on the host now, with the operation's arguments; (ok, stdout, stderr)."""
    arguments = connector_arguments(host)
    arguments.update(overrides)
    ok, output = host.run_shell_command(command, **arguments)
    return ok, output.stdout_lines, output.stderr_lines


class _ReleaseLockOnFailure(BaseStateCallback):
    """When an operation fails a host, release this run's lock there (if it holds it)."""

    @staticmethod
    def operation_host_error(state, host, op_hash, retry_attempt=0, max_retries=0):
        op_data = state.ops.get(host, {}).get(op_hash)
        if op_data is not None and op_data.global_arguments.get("_ignore_errors"):
            return
        state_dir = _LOCKED.get(state, {}).get(host.name)
        if not state_dir:
            return
        try:
            ok, stdout, _ = run_remote(host, release_lock_command(state_dir, run_id(state)))
        except Exception as error:  # the connection may be what failed
            host.log(f"could not release the servestack lock ({error}); the next run will find it stale")
            return
        if ok and "released" in stdout:
            host.log("released the servestack lock after the failure")


def release_lock_on_failure(host, state_dir: str) -> None:
    """Register (once per run) the callback releasing `state_dir`'s lock when this host fails."""
    state = host.state
    if state not in _LOCKED:
        _LOCKED[state] = {}
        state.add_callback_handler(_ReleaseLockOnFailure())
    _LOCKED[state][host.name] = state_dir


def keep(host, command: str, what: str) -> None:
    """Write bookkeeping on the host (a record or memo of what this run saw: not a change).

    While this run holds the host's lock, the command rides with the lock's release, the run's last
    remote command, instead of costing a round trip of its own (`kept_with_release`); if the host
    fails first, it is not written and a later run makes it again. Without the lock (an operation
    run on its own) it runs now."""
    state = host.state
    if host.name not in _LOCKED.get(state, {}):
        ok, _, stderr = run_remote(host, command)
        if not ok:
            host.log(f"could not write {what}: {' '.join(stderr)}", logger.warning)
        return
    _KEPT.setdefault(state, {}).setdefault(host.name, []).append((what, command))


def kept_with_release(host, release_command: str) -> tuple[str, list[str]]:
    """The lock release preceded by the bookkeeping `keep` queued for this host (each in its own
    subshell: one that fails prints `KEPT_FAILED <index>` and the lock is released all the same),
    and what each queued write is, by index."""
    kept = _KEPT.get(host.state, {}).pop(host.name, [])
    writes = [f"( {command}\n) || echo '{KEPT_FAILED} {index}'\n" for index, (_, command) in enumerate(kept)]
    return "".join(writes) + release_command, [what for what, _ in kept]


def report_kept(host, stdout: list[str], stderr: list[str], whats: list[str]) -> None:
    """Warn about each queued bookkeeping write that failed (see `kept_with_release`)."""
    for line in stdout:
        if line.startswith(KEPT_FAILED + " "):
            index = int(line.split()[1])
            host.log(f"could not write {whats[index]}: {' '.join(stderr)}", logger.warning)
