"""The deploy's verification step (operations/verify.py) through pyinfra's @fake connector: it
reads nothing at prepare, passes quietly, and fails the host naming the check that failed."""

from __future__ import annotations

import json
import logging
import shlex

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops

from operations.verify import DEPLOY_CHECKS, verify
from servestack import checks

# What the real H200 answers to the GPU section (tests/fixtures/h200-ubuntu2404/nvidia-smi-query.txt).
H200_GPU = [
    f"{checks.MARK} begin gpu",
    "smi_exit 0",
    "smi 0, NVIDIA H200, 9.0, 580.159.04, 143771 MiB, GPU-b9361222-cb9e-0727-9b70-c512a10ee626, 00000000:00:06.0",
    f"{checks.MARK} end gpu 0",
]
GPU_CHECKS = ("driver_version", "gpu_capability", "gpu_count")


def make_state(**data) -> State:
    host_data = {"fake_delay": 0, "fake_delay_jitter": 0, "gpu_count": 1, "service_tp": 1,
                 "fake_responses": {"begin gpu": H200_GPU}, **data}
    state = State(Inventory((["@fake/gpu1"], host_data)), Config())
    state.print_noop_info = True
    connect_all(state)
    return state


def fake_host(state: State):
    return state.inventory.get_host("@fake/gpu1")


def test_prepare_reads_nothing_and_predicts_no_change():
    state = make_state(gpu_compute_capability="9.0")
    add_deploy(state, verify, names=GPU_CHECKS)
    host = fake_host(state)
    assert host.connector.executed_commands == []
    assert state.get_meta_for_host(host).ops_change == 0


def test_passing_checks_change_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state(gpu_compute_capability="9.0")
    add_deploy(state, verify, names=GPU_CHECKS)
    run_ops(state)
    host = fake_host(state)
    assert not state.failed_hosts
    assert len(host.connector.executed_commands) == 1  # one probe script, no other command
    assert "verified: 3 check(s) passed, 0 skipped" in caplog.text


def test_a_failing_check_fails_the_host_saying_which_and_why():
    # The manifest expects SM120 (12.0) and the host is an H200. (@fake runs nothing: it is told
    # that the failure command fails, as `exit 1` does on a real host.)
    state = make_state(fake_responses={"begin gpu": H200_GPU, "check(s) failed": {"success": False}})
    add_deploy(state, verify, names=GPU_CHECKS)
    with pytest.raises(PyinfraError):  # the only host failed
        run_ops(state)
    host = fake_host(state)
    assert host in state.failed_hosts
    failure = host.connector.executed_commands[-1]
    assert "exit 1" in failure and "check(s) failed" in failure
    assert "gpu_capability: expected compute capability 12.0 on @fake/gpu1: GPU 0 (NVIDIA H200, 00000000:00:06.0) reports 9.0" in failure


def test_skipped_checks_are_logged_with_their_reason(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state(fake_responses={"begin gpu": [f"{checks.MARK} begin gpu", "smi_missing",
                                                     f"{checks.MARK} end gpu 0"]})
    add_deploy(state, verify, names=GPU_CHECKS)
    run_ops(state)
    assert "gpu_count skipped: no NVIDIA driver answers on @fake/gpu1: nvidia-smi not found" in caplog.text
    assert "verified: 0 check(s) passed, 3 skipped" in caplog.text


def test_the_deploy_runs_every_check_but_the_generate_request():
    assert set(DEPLOY_CHECKS) == {check.name for check in checks.CHECKS} - {"service_generate"}


SAMPLE = [f"{checks.MARK} begin sample", "nvcc -gencode arch=compute_90,code=sm_90",
          "device 0 NVIDIA H200: vector_add PASS", f"{checks.MARK} end sample 0"]
WITH_SAMPLE = (*GPU_CHECKS, "cuda_sample")
READS_RECORD = "verified.json 2>/dev/null"


def run_verify(caplog, responses: dict, **data):
    caplog.clear()
    state = make_state(gpu_compute_capability="9.0", fake_responses={"begin gpu": H200_GPU, **responses}, **data)
    add_deploy(state, verify, names=WITH_SAMPLE)
    run_ops(state)
    assert not state.failed_hosts
    assert state.get_meta_for_host(fake_host(state)).ops_change == 0
    return fake_host(state).connector.executed_commands


def written_record(commands: list[str]) -> str:
    (write,) = [command for command in commands if "verified.json.tmp" in command]
    return shlex.split(write.split("printf '%s\\n' ", 1)[1].split(" > ", 1)[0])[0]


def test_heavy_checks_that_passed_are_recorded_and_reused_while_the_host_state_is_the_same(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    first = run_verify(caplog, {"begin sample": SAMPLE})
    assert any("begin sample" in command for command in first)
    record = written_record(first)
    assert json.loads(record)["outcomes"][0][:2] == ["cuda_sample", "passed"]
    assert "verified: 4 check(s) passed, 0 skipped" in caplog.text

    second = run_verify(caplog, {"begin sample": SAMPLE, READS_RECORD: [record]})
    assert not any("begin sample" in command for command in second), "the sample ran again"
    assert not any("verified.json.tmp" in command for command in second)
    assert "verified: 4 check(s) passed, 0 skipped; 1 of them not re-run: recorded at" in caplog.text


def test_a_changed_driver_makes_the_heavy_checks_run_again(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    record = written_record(run_verify(caplog, {"begin sample": SAMPLE}))
    upgraded = [line.replace("580.159.04", "580.190.01") for line in H200_GPU]
    commands = run_verify(caplog, {"begin sample": SAMPLE, READS_RECORD: [record], "begin gpu": upgraded})
    assert any("begin sample" in command for command in commands)
    assert any("verified.json.tmp" in command for command in commands)
    assert "not re-run" not in caplog.text


def test_a_failed_heavy_check_is_not_recorded():
    state = make_state(gpu_compute_capability="9.0", fake_responses={
        "begin gpu": H200_GPU, "begin sample": [*SAMPLE[:2], "device 0: FAIL", f"{checks.MARK} end sample 1"],
        "check(s) failed": {"success": False}})
    add_deploy(state, verify, names=WITH_SAMPLE)
    with pytest.raises(PyinfraError):
        run_ops(state)
    commands = fake_host(state).connector.executed_commands
    assert "cuda_sample: the CUDA sample built with" in commands[-1]
    assert not any("verified.json.tmp" in command for command in commands)


def test_verify_reuse_false_runs_every_check_and_keeps_no_record(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    record = written_record(run_verify(caplog, {"begin sample": SAMPLE}))
    commands = run_verify(caplog, {"begin sample": SAMPLE, READS_RECORD: [record]}, verify_reuse=False)
    assert any("begin sample" in command for command in commands)
    assert not any("verified.json" in command for command in commands)


def test_the_gpus_preflight_read_are_judged_without_asking_nvidia_smi_again(caplog):
    """nvidia-smi wakes the driver for every GPU: the verify step replays what preflight read in
    this run (the deploy's probe cache) instead of running it a second time."""
    from pyinfra import host
    from pyinfra.api import deploy

    from facts.preflight import HostPreflight
    from operations.preflight import preflight_fact_arguments
    from servestack import probe
    from servestack.settings import host_settings

    @deploy("read as preflight does")
    def read_preflight():
        found = probe.fact(host, HostPreflight, **preflight_fact_arguments(host_settings(host)))
        assert found.gpu.gpus and found.gpu_output

    caplog.set_level(logging.DEBUG, logger="pyinfra")
    preflight_answer = ["args {}", "@@section gpu", *H200_GPU[1:-1]]
    state = make_state(gpu_compute_capability="9.0",
                       fake_responses={"begin gpu": H200_GPU, "@@section gpu": preflight_answer})
    add_deploy(state, read_preflight)
    add_deploy(state, verify, names=GPU_CHECKS)
    run_ops(state)
    host_ = fake_host(state)
    assert not state.failed_hosts
    script = [command for command in host_.connector.executed_commands if "begin gpu" in command][-1]
    assert "nvidia-smi --query-gpu" not in script
    assert shlex.quote(H200_GPU[2]) in script
    assert "verified: 3 check(s) passed, 0 skipped" in caplog.text
