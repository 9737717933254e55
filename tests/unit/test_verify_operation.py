"""The deploy's verification step (operations/verify.py) through pyinfra's @fake connector: it
reads nothing at prepare, passes quietly, and fails the host naming the check that failed."""

from __future__ import annotations

import json
import logging
import shlex

import pytest
from pyinfra import host
from pyinfra.api import Config, Inventory, State, operation
from pyinfra.api.connect import connect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops

from facts.gpu import QUERY_FIELDS
from facts.framing import BEGIN, END
from facts.verify import OUTPUT
from operations import verify as verify_step
from operations.verify import DEPLOY_CHECKS, verify
from servestack import reads
from servestack.checks.catalogue import CHECKS
from servestack.checks.readings import requests
from servestack.releases import release_at
from servestack.settings import host_settings

# What NvidiaGpus' command prints on the real H200 (tests/fixtures/h200-ubuntu2404/nvidia-smi-query.txt).
READS_GPUS = f"--query-gpu={','.join(QUERY_FIELDS)}"
H200_GPU = [
    "smi_exit 0",
    "smi 0, NVIDIA H200, 9.0, 580.159.04, 143771 MiB, GPU-b9361222-cb9e-0727-9b70-c512a10ee626, 00000000:00:06.0",
]
GPU_CHECKS = ("driver_version", "gpu_capability", "gpu_count")
RUNS_SAMPLE = "verify-sample.sh"


def make_state(**data) -> State:
    host_data = {"fake_delay": 0, "fake_delay_jitter": 0, "gpu_count": 1, "service_tp": 1,
                 "fake_responses": {READS_GPUS: H200_GPU}, **data}
    state = State(Inventory((["@fake/gpu1"], host_data)), Config())
    state.print_noop_info = True
    connect_all(state)
    return state


def fake_host(state: State):
    return state.inventory.get_host("@fake/gpu1")


def test_prepare_reads_nothing_and_predicts_no_change():
    state = make_state(gpu_compute_capability="9.0")
    add_deploy(state, verify, names=GPU_CHECKS)
    host_ = fake_host(state)
    assert host_.connector.executed_commands == []
    assert state.get_meta_for_host(host_).ops_change == 0


def test_passing_checks_change_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state(gpu_compute_capability="9.0")
    add_deploy(state, verify, names=GPU_CHECKS)
    run_ops(state)
    host_ = fake_host(state)
    assert not state.failed_hosts
    assert len(host_.connector.executed_commands) == 1  # the GPUs' read, no other command
    assert "verified: 3 check(s) passed, 0 skipped" in caplog.text


def test_a_failing_check_fails_the_host_saying_which_and_why(caplog):
    # The manifest expects SM120 (12.0) and the host is an H200.
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state()
    add_deploy(state, verify, names=GPU_CHECKS)
    with pytest.raises(PyinfraError):  # the only host failed
        run_ops(state)
    assert fake_host(state) in state.failed_hosts
    assert ("refused: verify gpu_capability: expected compute capability 12.0 on @fake/gpu1: "
            "GPU 0 (NVIDIA H200, 00000000:00:06.0) reports 9.0") in caplog.text


def test_a_driver_that_does_not_answer_fails_the_gpu_checks_naming_the_cause(caplog):
    """Host data always expects GPUs: no skip, a failure."""
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state(fake_responses={READS_GPUS: ["smi_missing"]})
    add_deploy(state, verify, names=GPU_CHECKS)
    with pytest.raises(PyinfraError):  # the only host failed
        run_ops(state)
    assert fake_host(state) in state.failed_hosts
    assert ("refused: verify gpu_count: no NVIDIA driver answers on @fake/gpu1, host data expects gpu_count = 1: "
            "nvidia-smi not found (no NVIDIA driver installed?)") in caplog.text
    assert " skipped" not in caplog.text


def test_the_deploy_runs_every_check_but_the_generate_request():
    assert set(DEPLOY_CHECKS) == {check.name for check in CHECKS} - {"service_generate"}




def reported(*lines: str, rc: int = 0) -> list[str]:
    """What a reporting fact (facts/verify.py) prints for a command that printed `lines`."""
    return [BEGIN + OUTPUT, *lines, "", f"{END}{OUTPUT} {rc}"]


SAMPLE = reported("nvcc -gencode arch=compute_90,code=sm_90",   # what the real sample printed on the H200
                  'device 0 sm_90 "NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error', "devices 1: PASS")
WITH_SAMPLE = (*GPU_CHECKS, "cuda_sample")
READS_RECORD = "verified.json 2>/dev/null"


def run_verify(caplog, responses: dict, **data):
    caplog.clear()
    state = make_state(gpu_compute_capability="9.0", fake_responses={READS_GPUS: H200_GPU, **responses}, **data)
    add_deploy(state, verify, names=WITH_SAMPLE)
    run_ops(state)
    assert not state.failed_hosts
    assert state.get_meta_for_host(fake_host(state)).ops_change == 0
    return fake_host(state).connector.executed_commands


def written_record(commands: list[str]) -> str:
    (write,) = [command for command in commands if "atomic-write.sh" in command and "verified.json" in command]
    return next(word for word in shlex.split(write) if word.startswith("CONTENT=")).removeprefix("CONTENT=")


def test_heavy_checks_that_passed_are_recorded_and_reused_while_the_host_state_is_the_same(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    first = run_verify(caplog, {RUNS_SAMPLE: SAMPLE})
    assert any(RUNS_SAMPLE in command for command in first)
    record = written_record(first)
    assert json.loads(record)["outcomes"][0][:2] == ["cuda_sample", "passed"]
    assert "verified: 4 check(s) passed, 0 skipped" in caplog.text

    second = run_verify(caplog, {RUNS_SAMPLE: SAMPLE, READS_RECORD: [record]})
    assert not any(RUNS_SAMPLE in command for command in second), "the sample ran again"
    assert not any("atomic-write.sh" in command for command in second)
    assert "verified: 4 check(s) passed, 0 skipped; 1 of them not re-run: recorded at" in caplog.text


def test_a_changed_driver_makes_the_heavy_checks_run_again(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    record = written_record(run_verify(caplog, {RUNS_SAMPLE: SAMPLE}))
    upgraded = [line.replace("580.159.04", "580.190.01") for line in H200_GPU]
    commands = run_verify(caplog, {RUNS_SAMPLE: SAMPLE, READS_RECORD: [record], READS_GPUS: upgraded})
    assert any(RUNS_SAMPLE in command for command in commands)
    assert any("atomic-write.sh" in command for command in commands)
    assert "not re-run" not in caplog.text


def test_a_failed_heavy_check_is_not_recorded(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = make_state(gpu_compute_capability="9.0", fake_responses={
        READS_GPUS: H200_GPU,
        RUNS_SAMPLE: reported("nvcc -gencode arch=compute_90,code=sm_90", "device 0: FAIL", rc=1)})
    add_deploy(state, verify, names=WITH_SAMPLE)
    with pytest.raises(PyinfraError):
        run_ops(state)
    assert "refused: verify cuda_sample: the CUDA sample built with" in caplog.text
    assert not any("atomic-write.sh" in command for command in fake_host(state).connector.executed_commands)


def test_verify_reuse_false_runs_every_check_and_keeps_no_record(caplog):
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    record = written_record(run_verify(caplog, {RUNS_SAMPLE: SAMPLE}))
    commands = run_verify(caplog, {RUNS_SAMPLE: SAMPLE, READS_RECORD: [record]}, verify_reuse=False)
    assert any(RUNS_SAMPLE in command for command in commands)
    assert not any("verified.json" in command for command in commands)


RELEASE = release_at("/opt/servestack/releases", "r-0123456789ab")


@operation()
def read_as_the_lock_does():
    """What preflight's lock reads at execute: every step's host_reads (here the verify step's)."""
    if host.state.is_executing:
        reads.read(host, verify_step.host_reads(host_settings(host), RELEASE))
    host.noop("read")
    yield from ()


def test_what_host_reads_lists_is_what_the_step_reads_first():
    """Read ahead (as the lock does), the step's first reads are answered from this stage's reads:
    it reads only the heavy groups the record does not cover (nvidia-smi runs once per stage)."""
    state = make_state(gpu_compute_capability="9.0")
    add_deploy(state, lambda: read_as_the_lock_does(name="read ahead"))
    add_deploy(state, verify, release=RELEASE)
    commands = fake_host(state).connector.executed_commands
    with pytest.raises(PyinfraError):  # @fake answers nothing else: the checks fail
        run_ops(state)
    settings = host_settings(fake_host(state))
    read_ahead = {request.command() for request in verify_step.host_reads(settings, RELEASE)}
    heavy = {request.command() for group in verify_step.REUSABLE_GROUPS
             for request in requests(settings, group, generate=False, release=RELEASE)}
    assert sum(READS_GPUS in command for command in commands) == 1
    assert read_ahead <= set(commands)
    after = commands[commands.index(max(read_ahead & set(commands), key=commands.index)) + 1:]
    assert set(after) <= heavy, [command[:80] for command in set(after) - heavy]
    assert verify_step.host_reads(settings) == []  # nothing to read at prepare


def test_host_reads_list_the_record_only_where_it_is_used():
    state = make_state()
    settings = host_settings(fake_host(state))
    names = {request.name for request in verify_step.host_reads(settings, RELEASE)}
    assert names == {"NvidiaGpus", "CudaToolkits", "ToolkitFingerprint", "VerifyHost", "ServiceHttp",
                     "VerificationRecord", "FileContents"}
    assert "VerificationRecord" not in {request.name for request in
                                        verify_step.host_reads(settings, RELEASE, names=GPU_CHECKS)}
