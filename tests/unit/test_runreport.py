"""servestack/runreport.py: what a run says when it is interrupted, at its end, and before a prompt it cannot answer."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from pyinfra import host
from pyinfra.api import Config, FunctionCommand, Inventory, State, operation
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

from servestack import hostrun, runreport
from tests.unit.fake_host import fake_state


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
