"""servestack/runreport.py: what a run says when it is interrupted, at its end, and before a prompt it cannot answer."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra import host
from pyinfra.api import Config, FunctionCommand, Inventory, State, operation
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from servestack import hostrun, runreport
from tests.unit.fake_host import fake_state

ROOT = Path(__file__).resolve().parents[2]


def test_each_long_step_says_what_the_next_run_does_and_others_get_the_general_answer():
    assert "the build goes on on the host" in runreport.next_run_for(
        "ML environment: build release | Build release r-1")
    assert "the build goes on" in runreport.next_run_for("ML environment: build release")  # names differ per host
    assert "health gate goes on" in runreport.next_run_for("SGLang service | Health-gated restart of sglang.service")
    assert "installer goes on" in runreport.next_run_for("CUDA toolkit | CUDA 13.0.1 at /usr/local/cuda-13.0")
    assert runreport.next_run_for("SGLang patches | Apply SGLang source patches") == runreport.SHORT_STEP


def test_recap_lines_name_status_counts_release_service_and_reason():
    rows = [{"host": "gpu-1", "status": "changed", "changed": 6, "unchanged": 8, "release": "r-0123",
             "service_restarted": True, "reason": None},
            {"host": "h2", "status": "refused", "changed": 0, "unchanged": 0, "release": None,
             "service_restarted": False, "reason": "no NVIDIA driver answers"}]
    assert runreport.recap_lines(rows) == [
        "SERVESTACK RECAP",
        "gpu-1  changed   changed=6 unchanged=8 release=r-0123 service=restarted",
        "h2     refused   changed=0 unchanged=0 release=- service=not restarted  reason: no NVIDIA driver answers",
    ]


def test_a_run_that_would_ask_with_stdin_closed_is_refused_with_a_message(tmp_path):
    with open(os.devnull) as null:
        assert "standard input is closed" in runreport.prompt_problem(["pyinfra", "inv.py", "deploy.py"], {},
                                                                      null.fileno())
        assert runreport.prompt_problem(["pyinfra", "-y", "inv.py", "deploy.py"], {}, null.fileno()) is None
        assert runreport.prompt_problem(["pyinfra", "inv.py", "deploy.py", "--dry"], {}, null.fileno()) is None
        assert runreport.prompt_problem(["pyinfra", "inv.py", "deploy.py"], {"PYINFRA_YES": "1"}, null.fileno()) is None
    read, write = os.pipe()  # a pipe may bring an answer (tests type one): pyinfra asks
    try:
        assert runreport.prompt_problem(["pyinfra", "inv.py", "deploy.py"], {}, read) is None
    finally:
        os.close(read)
        os.close(write)
    closed = subprocess.run([sys.executable, "-c", "from servestack import runreport; "
                             "print(runreport.prompt_problem(['pyinfra', 'i', 'd'], {}, 0) is not None)"],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, close_fds=True)
    assert closed.stdout.strip() == "True", closed.stderr


def test_pyinfra_says_no_ready_line_for_a_host_it_just_refused():
    state = fake_state({})
    gpu1 = state.inventory.get_host("@fake/gpu1")
    with pytest.raises(PyinfraError, match="No hosts remaining"):   # its only host (the CLI exits 1)
        hostrun.fail_host(gpu1, hostrun.REFUSED, ["no NVIDIA driver answers"])
    keep = runreport.NoReadyAfterRefusal(state).filter

    def record(text):
        return logging.LogRecord("pyinfra", logging.INFO, __file__, 1, text, (), None)

    assert not keep(record(f"{gpu1.print_prefix}Ready: deploy.py"))   # as pyinfra's loader logs it
    assert keep(record("[h2] Ready: deploy.py")) and keep(record("[@fake/gpu1] Connected"))


def test_the_recap_gives_each_failed_hosts_reason_as_hostrun_kept_it():
    @operation()
    def step():
        if host.name == "@fake/gpu1":   # a check on the controller: servestack says why
            yield FunctionCommand(lambda state, host: hostrun.fail_host(host, hostrun.FAILED, [
                "toolkit check failed: nvcc reports 12.4"]), (), {})
        else:                           # a command pyinfra runs: its stderr says why
            yield "write-unit"

    inventory = Inventory((["@fake/gpu1", "@fake/gpu2"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": {
        "write-unit": {"success": False, "stderr": ["servestack: /etc/systemd/system is read-only", "exit 1"]}}}))
    state = State(inventory, Config())
    connect_all(state)
    report = runreport.RunReport(state)
    state.add_callback_handler(report)
    hostrun.record_failed_commands(state)
    add_op(state, step, name="Step")
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        run_ops(state)
    assert [(row["host"], row["status"], row["reason"]) for row in runreport.recap(report)] == [
        ("@fake/gpu1", "failed", "toolkit check failed: nvcc reports 12.4"),
        ("@fake/gpu2", "failed", "'Step' failed: servestack: /etc/systemd/system is read-only")]


def _closed_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_run_where_no_host_connects_still_ends_with_the_recap_naming_each_host(tmp_path, as_json):
    """The real pyinfra CLI: pyinfra stops with "No hosts remaining!" when no host connects, and the run
    ended with no recap and no JSON object. Each host's line says it was unreachable, and why."""
    port = _closed_loopback_port()
    inventory = tmp_path / "fleet.py"
    inventory.write_text(f'hosts = [(name, {{"ssh_hostname": "127.0.0.1", "ssh_port": {port}, '
                         f'"servestack_allow_local": True}}) for name in ("gpu-a", "gpu-b")]\n')
    run = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), str(inventory), "deploy.py", "-y",
                          *(["--json"] if as_json else [])], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    if as_json:
        rows = json.loads(run.stderr.strip().splitlines()[-1])["servestack_recap"]
        assert [(row["host"], row["status"], row["changed"]) for row in rows] == [("gpu-a", "unreachable", 0),
                                                                                  ("gpu-b", "unreachable", 0)]
        assert all(row["reason"].startswith("cannot connect: ") and str(port) in row["reason"] for row in rows)
    else:
        recap = output[output.index("SERVESTACK RECAP"):].splitlines()
        for name, line in zip(("gpu-a", "gpu-b"), recap[1:3]):
            assert line.startswith(f"{name}  unreachable changed=0 unchanged=0 release=- service=not restarted"
                                   "  reason: cannot connect: "), output


def test_a_recap_line_of_an_unreachable_host_keeps_the_columns():
    rows = [{"host": "gpu-1", "status": "changed", "changed": 6, "unchanged": 8, "release": "r-0123",
             "service_restarted": True, "reason": None},
            {"host": "gpu-2", "status": "unreachable", "changed": 0, "unchanged": 0, "release": None,
             "service_restarted": False, "reason": "cannot connect: timed out"}]
    assert runreport.recap_lines(rows)[1:] == [
        "gpu-1  changed     changed=6 unchanged=8 release=r-0123 service=restarted",
        "gpu-2  unreachable changed=0 unchanged=0 release=- service=not restarted  reason: cannot connect: timed out"]
