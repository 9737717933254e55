"""servestack/hostrun.py: one run as the hosts see it -- refusing a host, writing records, the run's
id, releasing the lock of a host that fails -- on real pyinfra States of @fake hosts."""

from __future__ import annotations

import logging
import re
import subprocess

import pytest
from pyinfra import host
from pyinfra.api import Config, FunctionCommand, Inventory, State, operation
from pyinfra.api.connect import connect_all
from pyinfra.api.host import Host
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.connectors.fake import FakeConnector
from pyinfra.context import ctx_host

from servestack import hostrun
from servestack.scripts import script_command


def two_hosts(responses: dict | None = None, config: Config | None = None, **options):
    """A connected State of @fake/gpu1 and @fake/gpu2 (a host may fail and the run go on)."""
    data = {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses or {}}
    inventory = Inventory((["@fake/gpu1", "@fake/gpu2"], data))
    state = State(inventory, config or Config(), **options)
    connect_all(state)
    return state, inventory.get_host("@fake/gpu1"), inventory.get_host("@fake/gpu2")


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    return caplog


@operation()
def refusing(problems: list):
    """What every servestack operation does to refuse a host."""
    yield from hostrun.refuse(host, problems)
    return


@operation()
def then_runs():
    yield "echo after"


# --- fail_host / refuse ----------------------------------------------------------------------------


def test_refuse_at_prepare_fails_the_host_now(logs):
    state, gpu1, gpu2 = two_hosts()
    add_op(state, refusing, problems=["driver too old", "no disk"], host=gpu1)
    assert state.failed_hosts == {gpu1}            # before anything executes
    assert logs.text.count("refused: driver too old") == 1 and logs.text.count("refused: no disk") == 1
    add_op(state, then_runs)
    run_ops(state)
    assert "echo after" not in gpu1.connector.executed_commands
    assert "echo after" in gpu2.connector.executed_commands
    assert logs.text.count("refused: driver too old") == 1


def test_refuse_at_execute_yields_a_command_that_fails_the_host(logs):
    """Under `pyinfra -y` an operation's body first runs at execute: the refusal is a command."""
    state, gpu1, gpu2 = two_hosts(check_for_changes=False)
    op = add_op(state, refusing, problems=["the lock is held"], host=gpu1)[gpu1]
    add_op(state, then_runs)
    assert state.failed_hosts == set() and "refused" not in logs.text
    run_ops(state)
    assert state.failed_hosts == {gpu1}
    assert op.did_error()
    assert logs.text.count("refused: the lock is held") == 1
    assert "echo after" not in gpu1.connector.executed_commands
    assert "echo after" in gpu2.connector.executed_commands


def test_at_execute_refuse_is_one_function_command_that_fails_when_run(logs):
    state, gpu1, _ = two_hosts()
    state.is_executing = True
    commands = list(hostrun.refuse(gpu1, ["a", "b"]))
    assert len(commands) == 1 and isinstance(commands[0], FunctionCommand)
    assert state.failed_hosts == set() and "refused" not in logs.text
    assert commands[0].execute(state, gpu1, {}) is False    # pyinfra fails the operation, so the host
    assert "refused: a" in logs.text and "refused: b" in logs.text


def test_fail_host_from_a_deploy_function_fails_the_real_host(logs):
    state, gpu1, gpu2 = two_hosts()
    with ctx_host.use(gpu1):
        assert not hostrun.host_refused(host)
        assert hostrun.fail_host(host, hostrun.REFUSED, ["bad host data"]) is False   # the context proxy
        assert hostrun.host_refused(host)
    assert state.failed_hosts == {gpu1} and not hostrun.host_refused(gpu2)
    assert "refused: bad host data" in logs.text
    assert hostrun.reasons(state) == {"@fake/gpu1": [hostrun.Reason("refused", "bad host data")]}


@operation()
def checks_after(problem: str):
    def check(state, host):
        return hostrun.fail_host(host, hostrun.FAILED, [problem])
    yield FunctionCommand(check, (), {})


def test_a_function_command_fails_the_host_with_its_lines_as_said_and_its_reason_kept(logs):
    state, gpu1, gpu2 = two_hosts()
    hostrun.record_failed_commands(state)
    add_op(state, checks_after, problem="toolkit check failed: nvcc reports 12.4", host=gpu1)
    add_op(state, then_runs)
    assert state.failed_hosts == set()
    run_ops(state)
    assert state.failed_hosts == {gpu1} and "echo after" in gpu2.connector.executed_commands
    errors = [record.getMessage() for record in logs.records if record.levelno == logging.ERROR]
    assert sum("toolkit check failed: nvcc reports 12.4" in line for line in errors) == 1
    assert "refused:" not in logs.text
    said = hostrun.Reason("failed", "toolkit check failed: nvcc reports 12.4")
    assert hostrun.reasons(state) == {"@fake/gpu1": [said]}


def test_a_command_pyinfra_runs_that_fails_the_host_leaves_its_stderr_as_the_reason():
    state, gpu1, _ = two_hosts({"broken-step": {"success": False, "stderr": ["warming up", "servestack: no space left",
                                                                             "exit 1"]}})
    hostrun.record_failed_commands(state)
    add_op(state, fails, name="Broken step", host=gpu1)
    run_ops(state)
    assert hostrun.reasons(state) == {"@fake/gpu1": [hostrun.Reason(
        "failed", "'Broken step' failed: servestack: no space left")]}


@operation()
def long_step(step: str):
    yield hostrun.while_busy(host, "/var/lib/servestack", step, "the-gate --go")


def test_a_long_step_killed_on_the_host_names_the_step_and_what_it_left(logs):
    """Issue 32 §3: a health gate killed on the host (its controller still connected) said "no error output"."""
    step = "health-gated restart of sglang.service"
    killed = f"servestack: {step} was killed on the host by signal 9 before it finished"
    state, gpu1, _ = two_hosts({"the-gate --go": {"success": False, "stderr": [killed]}})
    add_op(state, long_step, step=step, host=gpu1)
    run_ops(state)
    reason = hostrun.reasons(state)["@fake/gpu1"][0].text
    assert reason == (f"{step} failed: {killed}: the unit it was starting may be loaded without a verified healthy "
                      "start; the next run finds no healthy start recorded for it and starts it through the gate again")
    assert sum(reason in record.getMessage() for record in logs.records if record.levelno == logging.ERROR) == 1


@pytest.mark.parametrize(("step", "words"), [
    ("cuda runfile download", "resumes it"), ("cuda 13.0.1 install", "moves the tree aside"),
    ("venv build r-0123456789ab", "builds it again"), ("SGLang pre-start check of r-0123456789ab", "checks again"),
    ("health-gated start of the baseline configuration of sglang.service", "through the gate again"),
])
def test_each_long_step_says_what_a_kill_leaves(step, words):
    assert words in hostrun.after_killed(step)


def test_busy_sh_says_the_step_was_killed_when_its_command_dies_of_a_signal(tmp_path):
    killed = subprocess.run(["bash", "-c", script_command("busy.sh", str(tmp_path), "run-1", "venv build r-1",
                                                          "bash", "-c", "kill -9 $$")],
                            capture_output=True, text=True)
    assert killed.returncode == 137
    assert hostrun.said_in(killed.stderr.splitlines()) == \
        "servestack: venv build r-1 was killed on the host by signal 9 before it finished"   # after bash's "Killed"
    failed = subprocess.run(["bash", "-c", script_command("busy.sh", str(tmp_path), "run-1", "venv build r-1",
                                                          "bash", "-c", "echo 'servestack: no space' >&2; exit 3")],
                            capture_output=True, text=True)
    assert failed.returncode == 3 and failed.stderr == "servestack: no space\n"


def test_what_a_failed_command_said_is_servestacks_first_line_or_its_last():
    assert hostrun.said_in(["x", "servestack: a", "servestack: b"]) == "servestack: a"
    assert hostrun.said_in(["first", "  last  ", " "]) == "last"
    assert hostrun.said_in([]) == "no error output" and hostrun.said_in([], nothing="no output") == "no output"


# --- write_record / run_remote --------------------------------------------------------------------


def test_write_record_runs_now():
    state, gpu1, _ = two_hosts()
    assert hostrun.write_record(gpu1, "echo record > /var/lib/servestack/seen", "the record")
    assert gpu1.connector.executed_commands == ["echo record > /var/lib/servestack/seen"]


def test_a_record_that_cannot_be_written_is_a_warning_naming_it(logs):
    state, gpu1, _ = two_hosts({"write-it": {"success": False, "stderr": "No space left on device"}})
    assert not hostrun.write_record(gpu1, "write-it", "the verification record")
    warnings = [record.getMessage() for record in logs.records if record.levelno == logging.WARNING]
    assert any("could not write the verification record: No space left on device" in line for line in warnings)
    assert state.failed_hosts == set()        # bookkeeping: the host goes on


def test_run_remote_uses_the_current_operations_connection_arguments(monkeypatch):
    seen: list = []
    run = FakeConnector.run_shell_command

    def recording(self, command, *args, **arguments):
        seen.append((str(command), arguments.get("_sudo"), arguments.get("_sudo_user")))
        return run(self, command, *args, **arguments)

    monkeypatch.setattr(FakeConnector, "run_shell_command", recording)

    @operation()
    def records():
        if host.state.is_executing:
            hostrun.run_remote(host, "echo inside")
        yield "echo done"

    state, gpu1, _ = two_hosts({"echo outside": ["out"]})
    assert hostrun.run_remote(gpu1, "echo outside") == (True, ["out"], [])
    add_op(state, records, _sudo=True, _sudo_user="svc", host=gpu1)
    run_ops(state)
    assert ("echo outside", False, None) in seen
    assert ("echo inside", True, "svc") in seen
    assert hostrun.run_remote(gpu1, "echo extra", _sudo=True) == (True, [], [])
    assert seen[-1] == ("echo extra", True, None)


# --- releasing the lock of a host that fails --------------------------------------------------------


@operation()
def fails():
    yield "broken-step"


def test_a_host_that_fails_releases_this_runs_lock(logs):
    state, gpu1, gpu2 = two_hosts({"broken-step": {"success": False}, "release-lock": ["released"]})
    hostrun.release_lock_on_failure(gpu1, "release-lock run-1")
    hostrun.release_lock_on_failure(gpu1, "release-lock run-1")     # the callback is added once
    add_op(state, fails, host=gpu1)
    run_ops(state)
    assert gpu1 in state.failed_hosts
    assert gpu1.connector.executed_commands[-1] == "release-lock run-1"
    assert gpu1.connector.executed_commands.count("release-lock run-1") == 1
    assert "released the servestack lock after the failure" in logs.text
    assert sum(type(handler).__name__ == "_ReleaseLockOnFailure" for handler in state.callback_handlers) == 1


def test_a_lock_released_by_the_run_is_not_released_again():
    state, gpu1, _ = two_hosts({"broken-step": {"success": False}})
    hostrun.release_lock_on_failure(gpu1, "release-lock run-1")
    hostrun.lock_released(gpu1)
    add_op(state, fails, host=gpu1)
    run_ops(state)
    assert gpu1 in state.failed_hosts and "release-lock run-1" not in gpu1.connector.executed_commands


def test_an_ignored_error_keeps_the_lock():
    state, gpu1, _ = two_hosts({"broken-step": {"success": False}})
    hostrun.release_lock_on_failure(gpu1, "release-lock run-1")
    add_op(state, fails, _ignore_errors=True, host=gpu1)
    run_ops(state)
    assert gpu1 not in state.failed_hosts and "release-lock run-1" not in gpu1.connector.executed_commands


def test_a_release_that_cannot_run_is_logged_and_left_stale(logs, monkeypatch):
    state, gpu1, _ = two_hosts({"broken-step": {"success": False}})
    hostrun.release_lock_on_failure(gpu1, "release-lock run-1")

    def connection_gone(target, command):
        raise OSError("connection reset")

    monkeypatch.setattr(hostrun, "run_remote", connection_gone)
    add_op(state, fails, host=gpu1)
    run_ops(state)
    assert "could not release the servestack lock (connection reset)" in logs.text


def test_only_the_failing_host_releases_its_lock():
    state, gpu1, gpu2 = two_hosts({"broken-step": {"success": False}})
    hostrun.release_lock_on_failure(gpu1, "release-lock gpu1")
    hostrun.release_lock_on_failure(gpu2, "release-lock gpu2")
    add_op(state, fails, host=gpu1)
    run_ops(state)
    assert "release-lock gpu1" in gpu1.connector.executed_commands
    assert "release-lock gpu2" not in gpu2.connector.executed_commands


# --- the run's id, hosts, what --diff shows ---------------------------------------------------------


def test_one_run_id_per_state():
    state, _, _ = two_hosts()
    other, _, _ = two_hosts()
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", hostrun.run_id(state))
    assert hostrun.run_id(state) == hostrun.run_id(state) != hostrun.run_id(other)
    assert re.fullmatch(r"\d{8}T\d{6}Z", hostrun.run_started(state))
    assert hostrun.run_id(state).startswith(hostrun.run_started(state)[:8])
    assert re.fullmatch(r"\d{8}T\d{6}Z", hostrun.utc_stamp())


def test_real_host_is_the_inventorys_host_behind_the_context_proxy():
    state, gpu1, _ = two_hosts()
    with ctx_host.use(gpu1):
        assert host is not gpu1 and type(host) is not Host    # pyinfra's context proxy
        assert hostrun.real_host(host) is gpu1
    assert hostrun.real_host(gpu1) is gpu1


def test_plan_and_noop_lines_show_with_diff(logs):
    config = Config()
    config.DIFF = True
    state, gpu1, _ = two_hosts(config=config)
    state.print_noop_info = False
    hostrun.plan(gpu1, "download 4.3 GB")
    hostrun.noop(gpu1, "toolkit in place")
    assert "download 4.3 GB" in logs.text and "no change: toolkit in place" in logs.text

    logs.clear()
    quiet, other, _ = two_hosts()
    hostrun.plan(other, "download 4.3 GB")
    hostrun.noop(other, "toolkit in place")
    assert "download 4.3 GB" not in logs.text and "no change:" not in logs.text
    assert "noop: toolkit in place" in logs.text   # pyinfra's own noop line (debug when not shown)
