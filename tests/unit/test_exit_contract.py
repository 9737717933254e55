"""The exit-status contract (servestack/errors.py) and one validation of an inventory, held by every
`servestack` command: bad input is exit 2 with one line per problem before any host is contacted, an
unreachable host 3, a failed check 1, an interruption 130; through `servestack.cli.main` and the real
entry point, against inventory files in tmp_path (no SSH, no DNS: loopback addresses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import Config, State
from pyinfra.api.exceptions import ConnectorDataTypeError

from servestack import bench, cli, status
from servestack.checks.outcome import FAILED
from servestack.errors import ConfigError
from servestack.fleet import load_inventory
from servestack.preconnect import targets_problems, validate_connection_data
from servestack.verify import Results, contract_status

COMMANDS = ("status", "verify", "doctor", "backups", "bench")
LOCAL = {"servestack_allow_local": True}


def inventory(tmp_path: Path, *hosts: tuple[str, dict], text: str | None = None) -> str:
    path = tmp_path / "fleet.py"
    path.write_text(text if text is not None else f"hosts = {list(hosts)!r}\n")
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status_ = cli.main(list(argv))
    captured = capsys.readouterr()
    return status_, captured.out, captured.err


def deploy_refusal(path: str) -> list[str]:
    """The lines the deploy's pre-connection validation (config.py: validate_targets) refuses with."""
    return targets_problems(list(load_inventory(path)), environ={})


@pytest.mark.parametrize("command", COMMANDS)
def test_an_ssh_port_that_is_no_number_is_bad_input_for_every_command(tmp_path, capsys, command):
    path = inventory(tmp_path, ("127.0.0.9", {"ssh_port": "nine", **LOCAL}))
    code, out, err = run(capsys, command, path)
    assert code == 2
    # doctor reports each host's refusal in its table, the others before they run
    assert "host 127.0.0.9: 'ssh_port': pyinfra's SSHConnector expects int, got 'nine'" in (out if command ==
                                                                                           "doctor" else err)
    assert "Traceback" not in out + err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_ssh_port_given_as_a_string_is_refused_as_the_deploy_refuses_it(tmp_path, capsys, command):
    """pyinfra's SSH connector refuses a str ssh_port when the deploy sets up its connections (naming no
    host); servestack says so first, with the host, in the deploy and in every command."""
    path = inventory(tmp_path, ("127.0.0.9", {"ssh_port": "9", **LOCAL}))
    with pytest.raises(ConnectorDataTypeError):
        State().init(load_inventory(path), Config())
    line = "host 127.0.0.9: 'ssh_port': pyinfra's SSHConnector expects int, got '9'"
    assert line in deploy_refusal(path)
    code, out, err = run(capsys, command, path)
    assert code == 2 and line in (out if command == "doctor" else err)


@pytest.mark.parametrize("command", ("status", "verify", "doctor"))
def test_ssh_password_is_refused_alike_by_the_deploy_and_the_commands(tmp_path, capsys, command):
    path = inventory(tmp_path, ("127.0.0.9", {"ssh_password": "secret", **LOCAL}))
    (line,) = deploy_refusal(path)
    assert line.startswith("host 127.0.0.9: 'ssh_password': ")
    code, out, err = run(capsys, command, path)
    assert code == 2 and line in (out if command == "doctor" else err) and "secret" not in out + err


@pytest.mark.parametrize(("text", "line"), [
    ("hosts = [('127.0.0.9', {\n", "fleet.py line 1: SyntaxError: '{' was never closed"),
    ("hosts = []\nraise RuntimeError('no fleet today')\n", "fleet.py line 2: RuntimeError: no fleet today"),
])
@pytest.mark.parametrize("command", ("status", "doctor"))
def test_an_inventory_that_does_not_load_is_one_line_naming_the_file(tmp_path, capsys, command, text, line):
    code, _out, err = run(capsys, command, inventory(tmp_path, text=text))
    assert code == 2 and line in err and len(err.strip().splitlines()) == 1


def test_verify_with_bad_host_data_is_exit_2_before_pytest_runs(tmp_path, capsys):
    path = inventory(tmp_path, ("127.0.0.9", {"service_port": "abc", **LOCAL}))
    code, out, err = run(capsys, "verify", path)
    assert code == 2
    assert "host 127.0.0.9: 'service_port': expected" in err
    assert "INTERNALERROR" not in out + err


def test_a_closed_stdout_is_no_traceback(tmp_path):
    """`servestack doctor --json | head -c 10`: a report larger than the pipe holds, the reader gone."""
    hosts = [(f"127.0.1.{n}", {"service_secret_env": ["SERVESTACK_TEST_UNSET"], **LOCAL}) for n in range(1, 200)]
    path = inventory(tmp_path, *hosts)
    servestack = Path(sys.executable).parent / "servestack"
    result = subprocess.run(f"'{servestack}' doctor --json '{path}' | head -c 10; exit ${{PIPESTATUS[0]}}",
                            shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert result.stdout == '{\n  "ok": '
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr
    assert result.returncode == 141


@pytest.mark.parametrize(("option", "name"), [("--json", "x.json"), ("--plot", "x.png")])
def test_bench_refuses_an_output_path_it_could_not_write_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                              option, name):
    path = inventory(tmp_path, ("127.0.0.9", LOCAL))
    monkeypatch.setattr(bench, "plotting_available", lambda: True)
    monkeypatch.setattr(bench, "targets_from_inventory", lambda *a, **k: pytest.fail("the benchmark ran"))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    code, _out, err = run(capsys, "bench", path, option, str(tmp_path / "nonexistent" / name))
    assert code == 2 and f"{option} {tmp_path / 'nonexistent' / name}: {tmp_path / 'nonexistent'} does not exist" in err
    code, _out, err = run(capsys, "bench", path, option, str(blocked / name))
    assert code == 2 and f"{blocked} is not a folder" in err


def test_doctor_reports_the_refusals_of_the_deploy_with_their_reasons(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SERVESTACK_TEST_UNSET", raising=False)
    path = inventory(tmp_path, ("127.0.0.9", {"service_secret_env": ["SERVESTACK_TEST_UNSET"], **LOCAL}))
    code, out, _err = run(capsys, "doctor", "--json", path)
    settings = json.loads(out)["hosts"]["127.0.0.9"]["checks"]["settings"]
    assert code == 2
    assert settings["status"] == "fail"
    assert settings["problems"] == targets_problems(list(load_inventory(path)))
    assert "SERVESTACK_TEST_UNSET is not set in the control machine's environment" in settings["detail"]


PINNED = {"service_model_revision": "0" * 40, "service_draft_model_revision": "1" * 40}


def test_doctor_reports_a_model_pinned_nowhere_as_the_deploy_refuses_it(tmp_path, capsys):
    """The shipped manifest pins no model revision: the deploy's weights step refuses such a host before any
    change (at prepare); doctor says so without contacting it."""
    path = inventory(tmp_path, ("127.0.0.1", {"ssh_port": 1, "ssh_user": "nobody", **LOCAL}))
    code, out, _err = run(capsys, "doctor", "--json", path)
    checks = json.loads(out)["hosts"]["127.0.0.1"]["checks"]
    assert code == 2 and checks["connect"]["status"] == "skip"
    assert [line.split(" serves ")[1].split(",")[0] for line in checks["settings"]["problems"]] == [
        "nvidia/Kimi-K2.5-NVFP4 (model)", "lightseekorg/kimi-k2.5-eagle3 (draft)"]
    assert all(line.startswith("host 127.0.0.1: profile 'kimi-k2.5-eagle3' serves ") and "'service_" in line
               for line in checks["settings"]["problems"])


def test_doctor_says_why_it_cannot_connect_and_exits_3(tmp_path, capsys):
    path = inventory(tmp_path, ("127.0.0.1", {"ssh_port": 1, "ssh_user": "nobody", **PINNED, **LOCAL}))
    code, out, _err = run(capsys, "doctor", "--json", path)
    document = json.loads(out)
    connect = document["hosts"]["127.0.0.1"]["checks"]["connect"]
    assert document["hosts"]["127.0.0.1"]["checks"]["settings"]["detail"] == "valid (no group data)"
    assert isinstance(document["unused_group_data"], list)
    assert code == 3
    assert connect["status"] == "fail" and connect["detail"].startswith("cannot connect: ")
    assert "port 1" in connect["detail"]


def test_status_exits_3_when_a_host_cannot_be_read_and_130_when_interrupted(monkeypatch, capsys):
    unread = status.unreachable_status("cannot run the probes on h1 (ssh://10.0.0.1): Connection timed out")
    monkeypatch.setattr(status, "collect", lambda path, limit: {"h1": unread})
    assert cli.main(["status", "--json", "inv.py"]) == 3

    def interrupted(path, limit):
        raise KeyboardInterrupt

    monkeypatch.setattr(status, "collect", interrupted)
    assert cli.main(["status", "inv.py"]) == 130
    assert "servestack: interrupted" in capsys.readouterr().err


def test_verify_maps_pytests_status_to_the_contract():
    unreachable, failed = Results(), Results()
    unreachable.add("driver", "h1", FAILED, "cannot run the probes on h1 (ssh://h1): refused")
    failed.add("driver", "h1", FAILED, "cannot run the probes on h1 (ssh://h1): refused")
    failed.add("driver", "h2", FAILED, "driver 570.1 is older than 580.82.07")
    assert [contract_status(code, Results()) for code in (0, 2, 3, 4, 5)] == [0, 130, 1, 2, 1]
    assert (contract_status(1, unreachable), contract_status(1, failed)) == (3, 1)


def test_connection_data_is_refused_by_host_and_key_before_pyinfra_sets_up_connections(tmp_path):
    path = inventory(tmp_path, ("127.0.0.9", {"ssh_port": "9", **LOCAL}), ("127.0.0.10", {"ssh_port": 22, **LOCAL}))
    with pytest.raises(ConfigError) as refused:
        validate_connection_data(load_inventory(path))
    assert str(refused.value).splitlines()[1:] == [
        "host 127.0.0.9: 'ssh_port': pyinfra's SSHConnector expects int, got '9'"]


def test_verify_names_an_unreachable_host_once_and_exits_3(tmp_path):
    """The real entry point against a loopback port nothing listens on: one line for the host, not one per check."""
    path = inventory(tmp_path, ("127.0.0.1", {"ssh_port": 1, "ssh_user": "nobody", **LOCAL}))
    servestack = Path(sys.executable).parent / "servestack"
    result = subprocess.run([str(servestack), "verify", path], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    lines = result.stdout.splitlines()
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    named = [line for line in lines if "cannot run the probes on 127.0.0.1" in line]
    assert len(named) == 1 and named[0].startswith("unreachable 127.0.0.1: ") and "checks not run)" in named[0]
    assert lines[-1].endswith("on 1 host(s); 1 could not be reached") and lines[-1].startswith("0 passed, 0 failed")
