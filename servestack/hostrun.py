"""One servestack run as the hosts see it: its id, how its operations speak, refuse and write records.

- `run_id(state)`: one id per pyinfra run (per `State`), written into the host lock and records;
- `plan` / `noop`: the per-host lines `--dry --diff` shows ("download 4.3 GB from ...");
- `fail_host` (and `refuse`, its form for an operation's body): the one way to refuse or fail a
  host, one line per problem naming it, the reason kept for the run's recap (`reasons`);
- `run_remote`: run a command now with the current operation's connection arguments (sudo, ...);
- `write_record`: bookkeeping written now (a record of what this run saw: not a change);
- `while_busy`: a long command (venv build, health-gated restart) that keeps the host's lock alive
  while it runs, even after this run's connection is gone (files/scripts/busy.sh);
- `release_lock_on_failure`: a state callback releasing this run's lock on a host that fails.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from weakref import WeakKeyDictionary

import pyinfra
from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import ContextObject

from servestack.scripts import script_command

_RUNS: "WeakKeyDictionary" = WeakKeyDictionary()     # State -> {"id", "started"}
_REASONS: "WeakKeyDictionary" = WeakKeyDictionary()  # State -> {host name: [Reason]}: why it was refused or failed
_NOTES: "WeakKeyDictionary" = WeakKeyDictionary()    # State -> {host name: {what: value}} for the recap
_LOCKED: "WeakKeyDictionary" = WeakKeyDictionary()   # State -> {host name: release command}
_UNSAID: "WeakKeyDictionary" = WeakKeyDictionary()   # State -> [(host, op hash)]: failed, no reason said yet


def utc_stamp() -> str:
    """A compact UTC timestamp for file names and records: 20261130T021500Z."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def parse_stamp(stamp: str | None) -> datetime | None:
    """servestack's compact UTC stamps (20260106T100000Z) and ISO 8601 ones (2026-01-06T10:00:00Z)."""
    for form in ("%Y%m%dT%H%M%SZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(stamp or "", form).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
    return None


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
    """The Host behind pyinfra's `host` context proxy (whose hash and == follow the current host;
    state sets and caches must hold real hosts)."""
    return host.state.inventory.get_host(host.name) if isinstance(host, ContextObject) else host


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


REFUSED = "refused"          # servestack would not change the host
FAILED = "failed"            # a step failed on it
UNREACHABLE = "unreachable"  # pyinfra could not connect to it


@dataclass(frozen=True)
class Reason:
    """Why a host stopped: `refused` (servestack would not change it), `failed` (a step failed) or
    `unreachable` (pyinfra could not connect to it)."""

    kind: str
    text: str


def reasons(state) -> dict[str, list[Reason]]:
    """The hosts this run refused or failed, and why, in the order it was said (servestack/runreport.py)."""
    _settle_failed_commands(state)
    return _REASONS.get(state, {})


def _remember(state, host, kind: str, texts: list[str]) -> None:
    if texts:
        _REASONS.setdefault(state, {}).setdefault(host.name, []).extend(Reason(kind, text) for text in texts)


def note(host, what: str, value) -> None:
    """Tell the run's recap something about this host (e.g. the release it leaves active)."""
    _NOTES.setdefault(host.state, {}).setdefault(host.name, {})[what] = value


def notes(state) -> dict[str, dict]:
    return _NOTES.get(state, {})


def fail_host(host, kind: str, problems: list[str], shown: bool = True) -> bool:
    """The one way servestack refuses (`REFUSED`) or fails (`FAILED`) a host. Returns False.

    Each problem is one line naming it, printed in red ("refused: <problem>" for a refusal) unless
    `shown=False` (its output was shown already), and kept as the host's reason for the recap.
    Where to call it:

    - a deploy function, at prepare: ``fail_host(host, REFUSED, [...]); return``: the host is failed
      now, so no operation runs on it;
    - a FunctionCommand, at execute: ``return fail_host(host, FAILED, [...])``: pyinfra fails the
      operation, so the host (other hosts go on; pyinfra's --fail-percent applies);
    - an operation's body: ``yield from refuse(host, [...]); return`` (below), which calls this now at
      prepare and yields it as the operation's failing command at execute.

    A command pyinfra runs itself (a StringCommand) that fails the host has its reason taken from
    its stderr (`record_failed_commands`). A `ConfigError` is not a host's failure: it stops the whole
    run on bad input (an inventory, a manifest, the controller's environment) before any host changes.
    """
    _remember(host.state, host, kind, problems)
    if shown:
        for problem in problems:
            host.log_styled(f"refused: {problem}" if kind == REFUSED else problem, fg="red", log_func=logger.error)
    if not is_executing(host):
        _fail_at_prepare(host)
    return False


def _fail_at_prepare(host) -> None:
    try:
        host.state.fail_hosts({real_host(host)})
    except PyinfraError:
        if not pyinfra.is_cli:
            raise
        raise SystemExit(1) from None   # no host left: the CLI would show "No hosts remaining!" as an error
    except EOFError:   # without -y pyinfra asks whether to go on without this host; stdin is closed
        logger.error("servestack: pyinfra asks whether to go on without the refused host, but standard input is "
                     "closed: stopping here (nothing was changed); run with -y to go on with the other hosts")
        raise SystemExit(1) from None


def _refused(state, host, problems: list[str]) -> bool:
    return fail_host(host, REFUSED, problems)


def refuse(host, problems: list[str]):
    """`fail_host(host, REFUSED, problems)` in an operation's body: ``yield from refuse(host, [...]); return``."""
    if is_executing(host):
        yield FunctionCommand(_refused, (list(problems),), {})
    else:
        fail_host(host, REFUSED, problems)


def said_in(lines: list[str], nothing: str = "no error output") -> str:
    """What a failed command said: its first line of servestack's ("servestack: ..."), or its last line."""
    lines = [line.strip() for line in lines if line.strip()]
    ours = [line for line in lines if line.startswith("servestack:")]
    return (ours or lines[-1:] or [nothing])[0]


def op_name(state, op_hash) -> str:
    """The operation's name as pyinfra shows it ("<deploy> | <operation>"). One operation has one
    name per host when the name carries a host's own value (a release id): then the deploy's name."""
    names = sorted(state.get_op_meta(op_hash).names)
    if len(names) == 1:
        return names[0]
    steps = {name.split(" | ")[0] for name in names}
    return steps.pop() if len(steps) == 1 else ", ".join(names) or "an operation"


class _FailedCommands(BaseStateCallback):
    """An operation that failed on a host without saying why through `fail_host` (a command pyinfra
    ran itself failed): its reason is its stderr, read once pyinfra has kept it (after this callback).
    A host pyinfra could not connect to: what the connector said."""

    @staticmethod
    def host_connect_error(state, host, error):
        said = str(error).removeprefix("Could not connect").strip().removeprefix("(").removesuffix(")")
        _remember(state, host, UNREACHABLE, [f"cannot connect: {said or type(error).__name__}"])

    @staticmethod
    def operation_host_error(state, host, op_hash, retry_attempt=0, max_retries=0):
        if host.name not in _REASONS.get(state, {}):
            _UNSAID.setdefault(state, []).append((host, op_hash))


def record_failed_commands(state) -> None:
    """Keep a reason for each host whose failure no servestack code said, and for each host that could not
    be reached (servestack/runreport.py)."""
    state.add_callback_handler(_FailedCommands())


def _settle_failed_commands(state) -> None:
    unsaid = _UNSAID.get(state, [])
    for host, op_hash in list(unsaid):
        meta = state.get_op_data_for_host(host, op_hash).operation_meta
        if meta.is_complete():
            unsaid.remove((host, op_hash))
            _remember(state, host, FAILED, [f"'{op_name(state, op_hash)}' failed: {said_in(meta.stderr_lines)}"])


def connector_arguments(host) -> dict:
    """The connection arguments (sudo, su, env, ...) of the current operation, or the host's."""
    arguments = host.current_op_global_arguments
    if arguments is None:
        arguments, _ = pop_global_arguments(host.state, host, {})
    return {key: arguments[key] for key in CONNECTOR_ARGUMENT_KEYS if key in arguments}


def run_remote(host, command, **overrides) -> tuple[bool, list[str], list[str]]:
    """Run `command` on the host now, with the operation's arguments; (ok, stdout, stderr)."""
    arguments = connector_arguments(host)
    arguments.update(overrides)
    ok, output = host.run_shell_command(command, **arguments)
    return ok, output.stdout_lines, output.stderr_lines


def write_record(host, command, what: str) -> bool:
    """Write bookkeeping on the host now (a record of what this run saw, not a change to report);
    a failure is a warning naming `what`."""
    ok, _, stderr = run_remote(host, command)
    if not ok:
        host.log(f"could not write {what}: {' '.join(stderr)}", logger.warning)
    return ok


def while_busy(host, state_dir: str, step: str, command) -> FunctionCommand:
    """A long step: `command` under files/scripts/busy.sh (the lock of this run stays alive while any
    of its processes runs, and a run that finds the host busy is told `step` and since when), its
    output shown as it comes (pyinfra's `print_output`), its failure remembered for the recap."""
    text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
    return FunctionCommand(_run_long_step, (step, script_command("busy.sh", state_dir, run_id(host.state), step,
                                                                 "bash", "-c", text)), {})


# What a long step killed on the host leaves, and what the next run does about it (busy.sh says "killed").
KILLED_STEPS = {
    "cuda runfile download": "the partial download stays beside the cache; the next run resumes it",
    "install": "the install is left marked unfinished (toolkit-install.json); the next run moves the tree "
               "aside and installs again",
    "venv build": "the release is left unchecked, never active; the next run builds it again",
    "pre-start check": "nothing was switched; the next run checks again",
    "model weights download": "the partial files stay in the model's directory; the next run resumes them",
    "health-gated": "the unit it was starting may be loaded without a verified healthy start; the next run "
                    "finds no healthy start recorded for it and starts it through the gate again",
}


def after_killed(step: str) -> str:
    return next((what for words, what in KILLED_STEPS.items() if words in step), "the next run converges again")


def _run_long_step(state, host, step: str, command: str) -> bool:
    arguments = connector_arguments(host)
    ok, output = host.run_shell_command(StringCommand(command), print_output=True, **arguments)
    if not ok:
        said = said_in(output.stderr_lines)
        killed = said.startswith(f"servestack: {step} was killed on the host")   # its output said nothing more
        return fail_host(host, FAILED, [f"{step} failed: {said}" + (f": {after_killed(step)}" if killed else "")],
                         shown=killed)
    return ok


class _ReleaseLockOnFailure(BaseStateCallback):
    """When an operation fails a host, release this run's lock there (if it holds it)."""

    @staticmethod
    def operation_host_error(state, host, op_hash, retry_attempt=0, max_retries=0):
        if state.get_op_data_for_host(host, op_hash).global_arguments.get("_ignore_errors"):
            return
        command = _LOCKED.get(state, {}).pop(host.name, None)
        if command is None:
            return
        try:
            ok, stdout, _ = run_remote(host, command)
        except Exception as error:  # the connection may be what failed
            host.log(f"could not release the servestack lock ({error}); the next run will find it stale")
            return
        if ok and "released" in stdout:
            host.log("released the servestack lock after the failure")


def release_lock_on_failure(host, release_command) -> None:
    """Register (once per run) the callback that runs `release_command` when this host fails."""
    state = host.state
    if state not in _LOCKED:
        _LOCKED[state] = {}
        state.add_callback_handler(_ReleaseLockOnFailure())
    _LOCKED[state][host.name] = release_command


def lock_released(host) -> None:
    """This host's lock was released by the run: no release on a later failure."""
    _LOCKED.get(host.state, {}).pop(host.name, None)
