"""The SGLang unit: flags, pinned environment, rendering, secrets, warnings and the restart decision inputs."""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FileContents

from facts.batch import FactRequest
from facts.service import ServiceRecord, UserAccount, combine_digests, parse_properties, parse_record
from facts.venv import MlEnvState
from operations import service
from sandbox.standins import fake_sglang_server
from servestack import serving
from servestack.errors import ConfigError
from servestack.paths import speculation_record_path, unit_path
from servestack.scripts import SCRIPTS, script_text
from servestack.settings import host_settings, settings_from_data
from tests.unit.fake_host import fake_state, read_keys

RELEASE_ID = "r-0123456789ab"
PATCHSET = "ab" * 32


def settings(**data):
    return settings_from_data("gpu-01", data)


def render(data=None, patchset=PATCHSET, groups=("video", "render"), with_secrets=False) -> str:
    s = settings(**(data or {}))
    return service.render_unit(s, service.release(s, RELEASE_ID), patchset, groups, with_secrets)


def unit_values(text: str, key: str) -> list[str]:
    return [line[len(key) + 1:] for line in text.splitlines() if line.startswith(key + "=")]


# -- flags ------------------------------------------------------------------------------------------

def test_launch_arguments_come_from_the_manifest_defaults():
    assert serving.launch_arguments(settings()) == [
        "--model-path", "nvidia/Kimi-K2.5-NVFP4", "--tp", "8",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "lightseekorg/kimi-k2.5-eagle3",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--attention-backend", "flashinfer", "--trust-remote-code", "--enable-torch-symm-mem",
        "--host", "0.0.0.0", "--port", "30000",
    ]


def test_the_unit_gives_up_on_a_server_that_keeps_crashing_while_it_loads():
    text = service.render_unit(settings(), service.release(settings(), "r-0123456789ab"), None)
    unit_section = text.split("[Service]")[0]
    # 3 starts, each up to start_timeout_s (1800) + RestartSec (10): a crash while loading trips it
    assert "StartLimitIntervalSec=5430\n" in unit_section and "StartLimitBurst=3\n" in unit_section
    assert "RestartSec=10\n" in text and "Restart=on-failure\n" in text
    bigger = settings(service_start_limit_burst=5, service_start_timeout_s=600)
    unit = service.render_unit(bigger, service.release(bigger, "r-0123456789ab"), None)
    assert "StartLimitIntervalSec=3050\n" in unit


def test_host_data_changes_flags_and_appends_extra_arguments():
    args = serving.launch_arguments(settings(
        service_tp=4, service_speculative_algorithm="NONE", service_enable_torch_symm_mem=False,
        service_enable_flashinfer_allreduce_fusion=True, service_port=31000,
        service_extra_args=["--mem-fraction-static", "0.88"]))
    assert "--speculative-algorithm" not in args and "--enable-torch-symm-mem" not in args
    assert args[args.index("--tp") + 1] == "4" and args[args.index("--port") + 1] == "31000"
    assert "--enable-flashinfer-allreduce-fusion" in args
    assert args[-2:] == ["--mem-fraction-static", "0.88"]


def test_the_stand_in_parses_exactly_what_the_unit_passes():
    parsed = fake_sglang_server.parse(serving.launch_arguments(settings(service_extra_args=["--log-level", "info"])))
    assert (parsed.tp, parsed.speculative_num_draft_tokens, parsed.attention_backend) == (8, 4, "flashinfer")
    with pytest.raises(SystemExit):
        fake_sglang_server.parse(["--model-path", "m", "--no-such-flag"])


@pytest.mark.parametrize("data, expected", [
    ({"service_tp": 3}, "'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 3"),
    ({"service_tp": 0}, "'service_tp': expected an integer from 1 to 64, got 0"),
    ({"service_speculative_num_draft_tokens": 5},
     "expected speculative_num_steps + 1 = 4 when speculative_eagle_topk is 1, got 5"),
    ({"service_port": "30000"}, "'service_port': expected an integer from 1 to 65535"),
    ({"service_enable_torch_symm_mem": "yes"}, "'service_enable_torch_symm_mem': expected true or false"),
    ({"service_speculative_algorithm": "eagle3"}, "'service_speculative_algorithm': expected one of"),
    # the service data a unit cannot use: refused with the other settings, before any connection
    ({"service_extra_args": ["--port=31000"]}, "'service_extra_args': --port is set from its own host-data key"),
    ({"service_extra_args": ["--tp-size", "4"]}, "'service_extra_args': --tp-size is set from its own host-data key"),
    ({"service_env": {"CUDA_HOME": "/usr/local/cuda"}}, "'service_env': CUDA_HOME is pinned by servestack"),
    ({"service_env": {"PATH": "/usr/bin"}}, "'service_env': PATH is pinned by servestack"),
    ({"service_secret_env": ["LD_LIBRARY_PATH"]}, "'service_secret_env': LD_LIBRARY_PATH is pinned"),
    ({"service_user": "root"}, "'service_user': expected a dedicated unprivileged user, got 'root'"),
    ({"service_model_path": "/models/kimi k2"}, "'service_model_path': expected a non-empty string without whitespace"),
    ({"service_host": "bad host!"}, "'service_host': expected an IP address or host name"),
    ({"service_host": "0.0.0.0;id"}, "'service_host': expected an IP address or host name"),
    ({"service_env": {"NCCL_DEBUG": "INFO\nX=1"}}, "'service_env': expected a dict of environment variable names to "
                                                    "single-line string values"),
    ({"service_env": {"NCCL_P2P_DISABLE": True}}, "'service_env': expected a dict of environment variable names"),
    ({"service_extra_args": ["--served-model-name", ""]},
     "'service_extra_args': expected a list of non-empty arguments"),
    ({"service_extra_args": ["--y\r"]}, "'service_extra_args': expected a list of non-empty arguments without control"),
    ({"service_launch_module": "sglang.launch_server --evil"},
     "'service_launch_module': expected a python module name"),
    ({"cuda_install_path": "/usr/local/cuda-13.0\r"}, "'cuda_install_path': expected an absolute path"),
])
def test_settings_refuse_bad_values_naming_host_and_key(data, expected):
    with pytest.raises(ConfigError, match="host gpu-01: ") as error:
        settings(**data)
    assert expected in str(error.value)


def test_default_settings_and_common_service_data_are_accepted():
    s = settings(service_env={"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": 2}, service_host="10.0.0.5")
    assert s.service_env["NCCL_DEBUG"] == "2" and s.service_launch_module == "sglang.launch_server"


# -- warnings ---------------------------------------------------------------------------------------

def test_fusion_on_sm120_with_sglang_0_5_9_is_warned_not_refused():
    warnings = service.ineffective_settings(settings(service_enable_flashinfer_allreduce_fusion=True))
    assert len(warnings) == 1
    assert "service_enable_flashinfer_allreduce_fusion is enabled but has no effect on SM120" in warnings[0]
    assert "sglang 0.5.9" in warnings[0] and "majors 9 and 10" in warnings[0]


@pytest.mark.parametrize("data", [
    {"service_enable_flashinfer_allreduce_fusion": False},
    {"service_enable_flashinfer_allreduce_fusion": True, "gpu_compute_capability": "10.0"},
    {"service_enable_flashinfer_allreduce_fusion": True, "gpu_compute_capability": "9.0"},
])
def test_no_warning_where_the_flag_works_or_is_off(data):
    assert service.ineffective_settings(settings(**data)) == []


# -- the unit ---------------------------------------------------------------------------------------

def test_unit_pins_the_13_0_toolkit_and_never_uses_usr_local_cuda():
    text = render({"service_env": {"NCCL_P2P_DISABLE": "1"}})
    env = dict(value.split("=", 1) for value in unit_values(text, "Environment"))
    assert env["CUDA_HOME"] == env["CUDA_PATH"] == "/usr/local/cuda-13.0"
    assert env["PATH"].split(":")[:2] == ["/usr/local/cuda-13.0/bin", f"/opt/servestack/releases/{RELEASE_ID}/venv/bin"]
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda-13.0/lib64"
    assert env["CUDA_LIB_PATH"] == "/usr/local/cuda-13.0/lib64"     # flashinfer loads no CUDA 12 runtime from it
    assert env["FLASHINFER_WORKSPACE_BASE"] == f"/var/cache/servestack/flashinfer/13.0.1-{RELEASE_ID}"
    assert env["TRITON_CACHE_DIR"].startswith(env["FLASHINFER_WORKSPACE_BASE"] + "/")
    assert env["NCCL_P2P_DISABLE"] == "1"
    assert env["SERVESTACK_PATCHSET"] == PATCHSET and env["SERVESTACK_RELEASE"] == RELEASE_ID
    assert "/usr/local/cuda/" not in text and "/usr/local/cuda:" not in text and "/usr/local/cuda\n" not in text


def test_unit_runs_the_release_python_as_the_service_user_and_restarts_on_failure():
    text = render({"service_start_timeout_s": 2400})
    assert unit_values(text, "ExecStart")[0].startswith(
        f"/opt/servestack/releases/{RELEASE_ID}/venv/bin/python -m sglang.launch_server \\")
    assert "    --speculative-num-draft-tokens 4 \\\n" in text
    assert unit_values(text, "User") == ["sglang"] and unit_values(text, "SupplementaryGroups") == ["video render"]
    assert unit_values(text, "Restart") == ["on-failure"] and unit_values(text, "TimeoutStartSec") == ["2400"]
    assert unit_values(text, "WantedBy") == ["multi-user.target"]
    assert unit_values(text, "EnvironmentFile") == []


def test_a_release_or_patch_set_change_is_a_unit_change():
    s = settings()
    base = service.render_unit(s, service.release(s, RELEASE_ID), PATCHSET)
    assert service.render_unit(s, service.release(s, "r-ffffffffffff"), PATCHSET) != base
    assert service.render_unit(s, service.release(s, RELEASE_ID), "cd" * 32) != base
    assert service.render_unit(s, service.release(s, RELEASE_ID), PATCHSET) == base


def test_secrets_file_is_named_in_the_unit_only_when_configured():
    text = render({"service_secret_env": ["HF_TOKEN"]}, with_secrets=True)
    assert unit_values(text, "EnvironmentFile") == ["/etc/servestack/sglang.service.env"]


@pytest.mark.parametrize("value, quoted", [
    ("plain-value_1.0", "plain-value_1.0"),
    ("two words", '"two words"'),
    ("100%", "100%%"),
    ("$HOME", "$$HOME"),
    ('say "hi"\\', '"say \\"hi\\"\\\\"'),
    ("", '""'),
])
def test_systemd_quoting(value, quoted):
    assert service.systemd_quote(value) == quoted


@pytest.mark.parametrize("assignment, quoted", [
    ("A=plain-value_1.0", "A=plain-value_1.0"),
    ("A=$HOME", "A=$HOME"),          # systemd does not expand variables in Environment=
    ("A=100%", "A=100%%"),
    ('A=say "hi" $x', '"A=say \\"hi\\" $x"'),
])
def test_environment_quoting_keeps_a_dollar_as_it_is(assignment, quoted):
    assert service.systemd_environment_quote(assignment) == quoted


def test_a_dollar_in_service_env_reaches_the_service_as_written():
    text = render({"service_env": {"HF_ENDPOINT": "https://mirror/$x", "OTHER": "a b$"}})
    assert unit_values(text, "Environment").count("HF_ENDPOINT=https://mirror/$x") == 1
    assert '"OTHER=a b$"' in text and "$$" not in text.split("ExecStart")[0]


def test_unit_arguments_with_spaces_and_specifiers_survive_systemd():
    text = render({"service_extra_args": ["--served-model-name", "kimi k2 100%"]})
    assert '--served-model-name "kimi k2 100%%"' in text


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_rendered_unit_passes_systemd_analyze_verify(tmp_path):
    """Offline check against a scratch root (--root): nothing of this machine's systemd is touched."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    python = root / f"opt/servestack/releases/{RELEASE_ID}/venv/bin/python"
    python.parent.mkdir(parents=True)
    shutil.copy("/bin/true", python)
    unit = root / "etc/systemd/system/sglang.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(render({"service_env": {"NCCL_P2P_DISABLE": "1"}, "service_secret_env": ["HF_TOKEN"],
                            "service_extra_args": ["--served-model-name", "a b%"]}, with_secrets=True))
    proc = subprocess.run(["systemd-analyze", f"--root={root}", "verify", "/etc/systemd/system/sglang.service"],
                          capture_output=True, text=True)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")

    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    proc = subprocess.run(["systemd-analyze", f"--root={root}", "verify", "/etc/systemd/system/sglang.service"],
                          capture_output=True, text=True)
    assert "Failed to parse service restart specifier" in proc.stderr  # the check above would see a bad unit


# -- secrets ----------------------------------------------------------------------------------------

def test_secrets_content_comes_from_the_controller_environment():
    content = service.secrets_content("gpu-01", ("HF_TOKEN",), {"HF_TOKEN": "hf_abc"})
    assert content.splitlines()[1:] == ["HF_TOKEN='hf_abc'"]
    assert repr(content) == "<secret>" and "hf_abc" not in repr([content])
    assert service.secrets_content("gpu-01", (), {}) is None


def test_missing_or_unusable_secrets_are_refused_naming_only_the_variable():
    with pytest.raises(ConfigError) as error:
        service.secrets_content("gpu-01", ("HF_TOKEN", "OTHER", "QUOTED"), {"OTHER": "", "QUOTED": "it's-secret"})
    message = str(error.value)
    assert "host gpu-01: 'service_secret_env': HF_TOKEN is not set in the control machine's environment" in message
    assert "OTHER is set but empty" in message and "QUOTED contains a newline or a single quote" in message
    assert "it's-secret" not in message


def test_fingerprint_follows_the_unit_and_the_secrets():
    unit = render()
    assert service.fingerprint(unit, None) == service.fingerprint(unit, None)
    assert service.fingerprint(unit, None) != service.fingerprint(unit, "a" * 64)
    assert service.fingerprint(unit, "a" * 64) != service.fingerprint(unit, "b" * 64)
    assert service.fingerprint(unit, None) != service.fingerprint(render({"service_port": 31000}), None)


# -- the health gate --------------------------------------------------------------------------------

@pytest.mark.parametrize("host, url", [
    ("0.0.0.0", "http://127.0.0.1:30000"), ("::", "http://127.0.0.1:30000"),
    ("10.0.0.5", "http://10.0.0.5:30000"), ("fd00::5", "http://[fd00::5]:30000"),
])
def test_the_gate_reaches_the_server_where_it_listens(host, url):
    assert serving.check_url(settings(service_host=host)) == url


def test_gate_rolls_back_to_the_recorded_release():
    s = settings()
    rel = service.release(s, "r-bbbbbbbbbbbb")
    env = service.gate_environment(s, rel, "f" * 64, {"release": "r-aaaaaaaaaaaa", "fingerprint": "0" * 64})
    assert env["SS_PREVIOUS_VENV"] == "/opt/servestack/releases/r-aaaaaaaaaaaa/venv"
    assert env["SS_PREVIOUS_LABEL"] == "release r-aaaaaaaaaaaa"
    assert env["SS_GOOD_UNIT"] == "/var/lib/servestack/service/sglang.service.good"
    assert env["SS_RELEASE_DIR"] == "/opt/servestack/releases/r-bbbbbbbbbbbb"
    first = service.gate_environment(s, rel, "f" * 64, None)
    assert first["SS_PREVIOUS_VENV"] == "" and "before servestack" in first["SS_PREVIOUS_LABEL"]


def test_gate_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / service.GATE_SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gate_command_quotes_every_input():
    command = service.gate_command({"SS_UNIT": "sglang.service", "SS_GENERATE_BODY": '{"text": "it\'s"}'})
    words = shlex.split(command.get_raw_value())
    assert 'SS_GENERATE_BODY={"text": "it\'s"}' in words and "SS_UNIT=sglang.service" in words
    assert words[words.index("bash") + 2] == script_text(service.GATE_SCRIPT)


# -- fact parsers -----------------------------------------------------------------------------------

def test_the_release_before_the_deploy_is_read_through_a_linked_releases_dir(tmp_path):
    """The service step names the release venv_path pointed at before the deploy from the venv
    step's own MlEnvState read (the link as written, not resolved): a releases dir on another disk
    behind a symlink (/opt/servestack -> /data/servestack) still names its release."""
    disk = tmp_path / "data" / "releases"
    (disk / RELEASE_ID / "venv").mkdir(parents=True)
    (disk / RELEASE_ID / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "releases").symlink_to(disk)
    (tmp_path / "ml-env").symlink_to(tmp_path / "releases" / RELEASE_ID / "venv")
    s = settings(venv_path=str(tmp_path / "ml-env"), venv_releases_dir=str(tmp_path / "releases"),
                 servestack_state_dir=str(tmp_path / "state"), venv_python=shutil.which("python3"))
    [request] = [request for request in service.deploy_reads(s) if request.cls is MlEnvState]
    fact, command = request._rendered
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    before = fact.process(result.stdout.splitlines())["venv_path"]
    assert before["realpath"] == str(disk / RELEASE_ID / "venv")
    assert service._pre_deploy_release(s, before) == RELEASE_ID


def test_systemctl_show_properties():
    state = parse_properties(["LoadState=loaded", "ActiveState=active", "MainPID=805", "ExecMainStatus=", "junk"])
    assert state == {"LoadState": "loaded", "ActiveState": "active", "MainPID": "805", "ExecMainStatus": ""}


def test_release_of_a_unit_servestack_wrote():
    s = settings()
    lines = render().splitlines()
    assert service._release_of_unit(s, lines) == RELEASE_ID
    assert service._release_of_unit(s, ["ExecStart=/opt/ml-env/bin/python -m sglang.launch_server"]) is None


def test_record_and_digest_parsers():
    assert parse_record(['{"fingerprint": "x",', '"release": "r-1"}']) == {"fingerprint": "x", "release": "r-1"}
    assert parse_record(["not json"]) is None and parse_record(["[1]"]) is None
    one = "a" * 64 + "  /opt/servestack/releases/r-1/patches.json"
    assert combine_digests([one]) == "a" * 64
    both = combine_digests([one, "b" * 64 + "  /opt/servestack/releases/r-1/venv/servestack-patches.json"])
    assert both not in (None, "a" * 64) and len(both) == 64
    assert combine_digests([]) is None


def test_no_secret_or_version_literal_lives_in_the_service_code():
    source = (Path(service.__file__).read_text() + service.UNIT_TEMPLATE.read_text()
              + (SCRIPTS / service.GATE_SCRIPT).read_text() + (SCRIPTS / service.SECRETS_SCRIPT).read_text())
    assert "13.0.1" not in source and "cu130" not in source and "/usr/local/cuda-13.0" not in source


@pytest.mark.parametrize("state, expected", [
    ({"ActiveState": "active", "SubState": "running"}, True),
    ({"ActiveState": "activating", "SubState": "start"}, True),
    ({"ActiveState": "activating", "SubState": "auto-restart"}, False),   # a crash loop, between two starts
    ({"ActiveState": "failed", "SubState": "failed"}, False),
    ({}, False),
])
def test_a_crash_loop_between_automatic_restarts_is_not_a_running_service(state, expected):
    assert service.running(state) is expected


VERIFIED = {"fingerprint": "f" * 64, "healthy_at": "2026-12-01T10:00:00Z", "invocation": "aaaa"}


@pytest.mark.parametrize("record, invocation, unit_mtime, expected", [
    (VERIFIED, "aaaa", datetime(2026, 12, 1, 11, 0), False),      # edited, not restarted: the verified unit runs
    (VERIFIED, "bbbb", datetime(2026, 12, 1, 9, 0), False),       # restarted, unit untouched since: the same unit
    (VERIFIED, "bbbb", datetime(2026, 12, 1, 10, 0), False),      # written in the second it was verified
    (VERIFIED, "bbbb", datetime(2026, 12, 1, 11, 0), True),       # edited and restarted by hand
    ({**VERIFIED, "invocation": None}, "bbbb", datetime(2026, 12, 1, 11, 0), False),   # a record from before
    (VERIFIED, "bbbb", None, False),                              # no unit file
])
def test_a_server_restarted_from_a_hand_edited_unit_is_told_apart(record, invocation, unit_mtime, expected):
    state = {"InvocationID": invocation}
    assert (service.restarted_since_verified(record, state)
            and service.edited_since_verified(record, unit_mtime)) is expected


# -- the roll-out's failure budget --------------------------------------------------------------------

class _Host:
    def __init__(self, name):
        self.name = name


def test_rollout_failures_count_completed_gate_failures_only():
    state = fake_state({})
    failures = service.gate_failures(state)
    assert service.gate_failures(state) is failures and failures in state.callback_handlers
    for name in ("h1", "h2", "h3", "h5"):
        failures.gating("op", name)
    for name in ("h1", "h4", "h5"):  # h4: stopped by the roll-out (its gate never ran): not a gate failure
        state.trigger_callbacks("operation_host_error", _Host(name), "op")
    state.trigger_callbacks("operation_host_success", _Host("h2"), "op")
    state.trigger_callbacks("operation_host_error", _Host("h2"), "another-op")
    assert service.rollout_failures(state, "op") == ["h1", "h5"]  # h3: its gate is still running


def fleet(names: list[str], responses: dict, config: Config | None = None, **data) -> State:
    """A connected State of @fake hosts answering `responses` (and nothing else), with host data `data`."""
    inventory = Inventory(([f"@fake/{name}" for name in names],
                           {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses, **data}))
    state = State(inventory, config or Config())
    state.print_noop_info = True
    connect_all(state)
    return state


def gated(state: State) -> list[str]:
    return [host.name for host in state.inventory
            if any(service.GATE_SCRIPT in command for command in host.connector.executed_commands)]


@pytest.mark.parametrize("budget, gates", [(0, 1), (1, 2), (2, 3)])
def test_the_rollout_stops_once_more_hosts_failed_their_gate_than_the_budget(budget, gates, caplog):
    state = fleet(["h1", "h2", "h3"], {service.GATE_SCRIPT: {"success": False, "stderr": "unhealthy"}},
                  rollout_failure_budget=budget)
    add_op(state, service.restart, release=service.release(settings(), RELEASE_ID), _parallel=1)
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        run_ops(state)
    assert len(gated(state)) == gates, caplog.text
    assert state.failed_hosts == set(state.inventory)
    stopped = "sglang.service not restarted: the roll-out stopped after"
    assert caplog.text.count(stopped) == 3 - gates
    if gates < 3:
        assert f"{stopped} {gates} host(s) failed their health gate ({', '.join(sorted(gated(state)))}; " \
               f"rollout_failure_budget={budget})" in caplog.text


def test_healthy_hosts_restart_batch_after_batch():
    state = fleet(["h1", "h2", "h3"], {}, rollout_failure_budget=0)
    add_op(state, service.restart, release=service.release(settings(), RELEASE_ID), _parallel=1)
    run_ops(state)
    assert sorted(gated(state)) == ["@fake/h1", "@fake/h2", "@fake/h3"] and not state.failed_hosts


# -- the step on a fresh host (pyinfra's @fake connector) -------------------------------------------

FRESH_HOST = {"command -v curl": "/usr/bin/curl", "command -v useradd": "/usr/sbin/useradd", "uname -s": "Linux"}


def test_host_reads_lists_what_the_step_reads_with_the_same_arguments(monkeypatch):
    state = fleet(["gpu1"], FRESH_HOST)
    s = settings()
    rel = service.release(s, RELEASE_ID)
    keys = read_keys(monkeypatch)
    add_deploy(state, service.sglang_service, release=rel)
    listed = {request.key for request in service.host_reads(s, rel)}
    unit_text = FactRequest.of(FileContents, path=unit_path(s)).key  # read only to diff a change
    assert set(keys) - listed == {unit_text}
    assert listed - set(keys) == set()
    assert {request.key for request in service.host_reads(s)} < listed


@pytest.mark.parametrize("policy", ["on", "adaptive"])
def test_under_yes_the_deploy_function_reads_only_what_deploy_reads_lists(monkeypatch, policy):
    """pyinfra -y runs no operation while it prepares: what the step reads then, and what its
    `host_reads` with the release reads to list (the adaptive config the record names), is what
    `deploy_reads` lists (deploy.py reads it with preflight's facts, in one command)."""
    data = {"service_profile": "glm-5-mtp", "service_speculation": policy}
    state = fleet(["gpu1"], FRESH_HOST, **data)
    state.check_for_changes = False          # what pyinfra's CLI sets for -y
    s, gpu1 = settings(**data), state.inventory.get_host("@fake/gpu1")
    keys = read_keys(monkeypatch)
    add_deploy(state, service.sglang_service, release=service.release(s, RELEASE_ID))
    with ctx_state.use(state), ctx_host.use(gpu1):
        service.host_reads(s, service.release(s, RELEASE_ID))   # deploy.py lists it while it prepares
    record = FactRequest.of(ServiceRecord, path=speculation_record_path(s)).key
    assert set(keys) | {record} == {request.key for request in service.deploy_reads(s)}
    assert (record in keys) == (policy == "adaptive")


def test_a_dry_run_on_a_fresh_host_diffs_the_unit_of_the_planned_release(caplog):
    caplog.set_level(logging.INFO, logger="pyinfra")
    state = fleet(["gpu1"], FRESH_HOST, Config(DIFF=True))
    rel = service.release(settings(), RELEASE_ID)  # not on the host: what venv.plan() names in --dry
    add_deploy(state, service.sglang_service, release=rel)
    host = state.inventory.get_host("@fake/gpu1")
    assert not state.failed_hosts
    assert f"+ ExecStart=/opt/servestack/releases/{RELEASE_ID}/venv/bin/python -m sglang.launch_server \\" \
        in caplog.text, caplog.text
    assert f"will restart sglang.service on release {RELEASE_ID}: no healthy start recorded yet" in caplog.text
    assert state.get_meta_for_host(host).ops_change == 4  # user, cache directory, unit, restart; no secrets
    assert all(not command.startswith(("install", "systemctl")) for command in host.connector.executed_commands)


def test_the_secret_is_never_on_a_command_line_or_in_the_log(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    token = "hf_" + "5e" * 16
    monkeypatch.setenv("HF_TOKEN", token)
    inventory = Inventory((["@fake/gpu1"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": FRESH_HOST,
                                            "service_secret_env": ["HF_TOKEN"]}))
    state = State(inventory, Config(DIFF=True))
    connect_all(state)
    s = host_settings(state.inventory.get_host("@fake/gpu1"))
    add_deploy(state, service.sglang_service, release=service.release(s, RELEASE_ID))
    run_ops(state)
    host = state.inventory.get_host("@fake/gpu1")
    commands = "\n".join(host.connector.executed_commands)
    assert "secrets-file.sh" in commands and "secrets file changed" in caplog.text
    assert token not in commands and token not in caplog.text


def test_an_existing_login_user_is_refused_naming_the_key(caplog):
    account = UserAccount().command(user="sglang")
    state = fleet(["gpu1"], {**FRESH_HOST, account: "sglang:x:1001:1001::/home/sglang:/bin/bash|sglang|sglang||"})
    with pytest.raises(PyinfraError, match="No hosts remaining"):  # the only host was refused
        add_deploy(state, service.sglang_service, release=service.release(settings(), RELEASE_ID))
    assert "refused: 'service_user': sglang is an existing login user (uid 1001)" in caplog.text
    assert state.get_meta_for_host(state.inventory.get_host("@fake/gpu1")).ops == 0


def test_only_model_paths_on_disk_are_checked_for_the_service_user():
    assert service.local_model_paths(settings()) == []
    assert service.local_model_paths(settings(service_model_path="/models/k", service_draft_model_path="/models/d")) \
        == ["/models/k", "/models/d"]
    assert service.local_model_paths(settings(service_model_path="/models/k", service_speculative_algorithm="NONE",
                                              service_draft_model_path="/models/d")) == ["/models/k"]


def test_the_user_account_fact_reads_as_pyinfras_users_with_one_id_call():
    """Each local account, as the old three-program command read it (getent, id -gn, id -Gn)."""
    import subprocess

    def run(command: str) -> list[str]:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()

    users = [line.split(":")[0] for line in run("getent passwd")][:40]
    for user in users:
        old = run(f"e=$(getent passwd {user}); echo \"$e|$(id -gn {user})|$(id -Gn {user})||\"")
        command = UserAccount().command(user)
        assert run(command) == old, user
        assert UserAccount().process(run(command)) == UserAccount().process(old)
    assert "id -gn" not in UserAccount().command("root")
    assert run(UserAccount().command("no-such-user-servestack")) == []
