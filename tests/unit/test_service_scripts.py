"""The service step's host-side scripts (files/scripts), run with bash here against a temporary directory.

The health gate runs with stand-ins for systemctl, curl and journalctl on PATH: a unit whose file
holds the word BROKEN fails (systemd reports it failed, /health does not answer); any other is
healthy and answers /generate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from facts.service import parse_record
from operations import service
from servestack.paths import good_unit_path, secrets_staging_path, service_record_path, unit_path
from servestack.releases import TOOL
from servestack.scripts import SCRIPTS, atomic_copy_command, atomic_write_command, script_command, script_text
from servestack.settings import settings_from_data

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the scripts set root ownership")


def bash(command: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))[2:]


# -- secrets-file.sh ------------------------------------------------------------------------------

def secrets(*args) -> subprocess.CompletedProcess:
    return bash(script_command(service.SECRETS_SCRIPT, *args), check=False)


@needs_root
def test_secrets_are_staged_root_only_before_any_byte_is_written(tmp_path):
    path = tmp_path / "etc-servestack" / "sglang.service.env"
    assert secrets("stage", path).returncode == 0
    staging = Path(secrets_staging_path(str(path)))
    assert staging.read_bytes() == b"" and mode(staging) == "600" and staging.stat().st_uid == 0
    assert mode(path.parent) == "700" and not path.exists()


@needs_root
def test_the_staged_secrets_replace_the_file_and_the_upload_directory_goes(tmp_path):
    path = tmp_path / "sglang.service.env"
    path.write_text("HF_TOKEN='old'\n")
    upload = tmp_path / "upload"
    upload.mkdir(mode=0o700)
    (upload / "secrets").write_text("left by the upload")
    assert secrets("stage", path).returncode == 0
    Path(secrets_staging_path(str(path))).write_text("HF_TOKEN='new'\n")  # what the SFTP upload does
    placed = secrets("place", path, upload)
    assert placed.returncode == 0 and placed.stdout == "" and placed.stderr == ""
    assert path.read_text() == "HF_TOKEN='new'\n" and mode(path) == "600"
    assert not upload.exists() and not Path(secrets_staging_path(str(path))).exists()


@needs_root
def test_placing_without_a_staged_file_fails_and_keeps_the_secrets(tmp_path):
    path = tmp_path / "sglang.service.env"
    path.write_text("HF_TOKEN='kept'\n")
    placed = secrets("place", path, tmp_path / "upload")
    assert placed.returncode != 0 and "nothing staged" in placed.stderr
    assert path.read_text() == "HF_TOKEN='kept'\n"


def test_removing_the_secrets_removes_a_left_over_staging_file_too(tmp_path):
    path = tmp_path / "sglang.service.env"
    path.write_text("x")
    Path(secrets_staging_path(str(path))).write_text("y")
    assert secrets("remove", path).returncode == 0
    assert list(tmp_path.iterdir()) == []
    assert secrets("remove", path).returncode == 0  # nothing there: still done
    unknown = secrets("rotate", path)
    assert unknown.returncode == 2 and "unknown command 'rotate'" in unknown.stderr


# -- the unit and its baseline record (atomic-write.sh) ----------------------------------------------

def settings(**data):
    return settings_from_data("gpu-01", data)


def test_the_written_unit_has_the_hash_the_operation_compares(tmp_path):
    s = settings(service_extra_args=["--served-model-name", "kimi k2 100%"])
    text = service.render_unit(s, service.release(s, "r-0123456789ab"), "ab" * 32, ("video",))
    path = tmp_path / "sglang.service"
    bash(atomic_write_command(str(path), text, "644"))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == service.sha256_text(text)
    assert mode(path) == "644"


def test_the_baseline_record_names_the_release_the_found_unit_ran(tmp_path):
    s = settings(servestack_state_dir=str(tmp_path / "state"))
    found = ["ExecStart=/opt/servestack/releases/r-aaaaaaaaaaaa/venv/bin/python -m sglang.launch_server"]
    keep_unit, write_record = service._baseline_commands(s, found, None)
    assert keep_unit.get_raw_value() == atomic_copy_command(unit_path(s), good_unit_path(s), "644")   # atomic
    bash(write_record.get_raw_value())
    record = parse_record(Path(service_record_path(s)).read_text().splitlines())
    assert record["fingerprint"] is None and record["release"] == "r-aaaaaaaaaaaa"


# -- sglang-health-gate.sh ----------------------------------------------------------------------------

SYSTEMCTL = r"""#!/bin/bash
loaded=$SS_UNIT_PATH; [ -f "$SS_UNIT_CANDIDATE" ] && loaded=$SS_UNIT_CANDIDATE   # the runtime unit wins
broken() { grep -q BROKEN "$loaded"; }
echo "systemctl $*" >> "$STUB_LOG"
case $1 in
    daemon-reload|restart|stop) exit 0 ;;
    show)
        case $2 in
            --property=ActiveState,SubState,NRestarts,Result,ExecMainStatus)
                if broken; then printf 'ActiveState=failed\nSubState=failed\n'
                else printf 'ActiveState=active\nSubState=running\n'; fi
                printf 'NRestarts=%s\nResult=exit-code\nExecMainStatus=1\n' "${STUB_NRESTARTS:-0}" ;;
            --property=InvocationID) echo 0123abcd ;;
            *) echo "systemctl stand-in: unexpected $*" >&2; exit 1 ;;
        esac ;;
esac
"""
CURL = r"""#!/bin/bash
loaded=$SS_UNIT_PATH; [ -f "$SS_UNIT_CANDIDATE" ] && loaded=$SS_UNIT_CANDIDATE
grep -q BROKEN "$loaded" && exit 7
if [ -n "${STUB_HEALTH_FAILS:-}" ]; then       # the server is still starting for that many requests
    n=$(cat "$STUB_LOG.curl" 2>/dev/null || echo 0)
    echo $((n + 1)) > "$STUB_LOG.curl"
    [ "$n" -lt "$STUB_HEALTH_FAILS" ] && exit 7
fi
for word in "$@"; do case $word in */generate) echo '{"text": " Paris."}' ;; esac; done
"""
JOURNALCTL = """#!/bin/bash
echo "Traceback: the stand-in's last words"
"""


class Gate:
    """A host in a directory: a unit, releases a and b, the venv link, the service's state."""

    def __init__(self, root: Path):
        self.root = root
        stubs = root / "bin"
        stubs.mkdir()
        for name, text in (("systemctl", SYSTEMCTL), ("curl", CURL), ("journalctl", JOURNALCTL)):
            (stubs / name).write_text(text)
            (stubs / name).chmod(0o755)
        for release in ("r-a", "r-b"):
            python = root / "releases" / release / "venv" / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("#!/bin/sh\n")
            python.chmod(0o755)
        self.unit = root / "sglang.service"
        self.candidate = root / "run" / "sglang.service"   # the runtime unit (/run/systemd/system.control)
        self.source = root / "releases" / "r-b" / "sglang.service"   # the release's copy: what the gate installs
        self.venv = root / "ml-env"
        self.venv.symlink_to(root / "releases" / "r-b" / "venv")
        self.state = root / "state"
        self.history = root / "releases.json"
        self.history.write_text(json.dumps({"activations": []}))
        self.log = root / "calls.log"
        self.path = f"{stubs}:{os.environ['PATH']}"

    def env(self, previous: str | None) -> dict:
        s = settings(servestack_state_dir=str(self.root), venv_releases_dir=str(self.root / "releases"),
                     venv_path=str(self.venv), service_health_timeout_s=5)
        record = {"release": previous, "fingerprint": "0" * 64} if previous else None
        env = service.gate_environment(s, service.release(s, "r-b"), "f" * 64, record)
        return {**env, "SS_UNIT_PATH": str(self.unit), "SS_UNIT_CANDIDATE": str(self.candidate),
                "SS_STATE_DIR": str(self.state),
                "SS_GOOD_UNIT": str(self.state / "sglang.service.good"),
                "SS_RECORD": str(self.state / "sglang.service.json"), "SS_PYTHON": sys.executable}

    def run(self, previous: str | None = None, stubs: dict | None = None) -> subprocess.CompletedProcess:
        command = script_command(service.GATE_SCRIPT, env=self.env(previous))
        return bash(command, env={"PATH": self.path, "STUB_LOG": str(self.log), **(stubs or {})}, check=False)

    @property
    def good_unit(self) -> Path:
        return self.state / "sglang.service.good"

    def run_after_a_healthy_one(self, good_unit: str, unit: str) -> subprocess.CompletedProcess:
        """Restart onto `unit` where an earlier healthy restart, on release r-a, left `good_unit`."""
        self.state.mkdir()
        self.good_unit.write_text(good_unit)
        self.unit.write_text(good_unit)
        self.source.write_text(unit)
        return self.run(previous="r-a")

    def record(self) -> dict | None:
        path = self.state / "sglang.service.json"
        return parse_record(path.read_text().splitlines()) if path.exists() else None


@pytest.fixture
def gate(tmp_path) -> Gate:
    return Gate(tmp_path)


def test_a_healthy_restart_is_remembered_as_the_last_good_unit(gate):
    gate.source.write_text("ExecStart=release r-b\n")
    proc = gate.run()
    assert proc.returncode == 0, proc.stderr
    assert "sglang.service is healthy on release r-b and answered a generation request" in proc.stdout
    assert gate.unit.read_text() == gate.good_unit.read_text() == "ExecStart=release r-b\n"
    record = gate.record()
    assert (record["fingerprint"], record["release"], record["unit"]) == ("f" * 64, "r-b", str(gate.unit))
    assert record["invocation"] == "0123abcd"   # the start it verified (the stand-in's InvocationID)
    assert "systemctl restart -- sglang.service" in gate.log.read_text()


def test_a_failed_release_is_rolled_back_to_the_last_good_release_and_unit(gate):
    proc = gate.run_after_a_healthy_one("ExecStart=release r-a\n", "ExecStart=release r-b BROKEN\n")
    assert proc.returncode == 1
    assert "sglang.service on release r-b failed: the server exited before /health answered " \
           "(exit-code, exit status 1)" in proc.stderr
    assert "Traceback: the stand-in's last words" in proc.stderr
    assert "rolled back to release r-a, which is healthy and answering again; release r-b stays in" in proc.stderr
    assert gate.unit.read_text() == "ExecStart=release r-a\n"
    assert os.readlink(gate.venv) == str(gate.root / "releases" / "r-a" / "venv")
    last = json.loads(gate.history.read_text())["activations"][-1]
    assert (last["release"], last["previous"], last["by"]) == ("r-a", "r-b", "service-rollback")
    assert (gate.root / "releases" / "r-b" / "venv" / "bin" / "python").exists()  # kept for inspection
    record = gate.record()   # the failed unit is never recorded as healthy: the good one is, with its new start
    assert (record["fingerprint"], record["release"], record["invocation"]) == ("0" * 64, "r-a", "0123abcd")


def test_restarts_the_unit_had_before_the_gates_restart_are_not_taken_for_a_crash(gate):
    """systemctl restart does not reset NRestarts: after a crash loop a healthy server that takes a
    moment to answer still shows the old count."""
    gate.source.write_text("ExecStart=release r-b\n")
    proc = gate.run(stubs={"STUB_NRESTARTS": "3", "STUB_HEALTH_FAILS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "is healthy on release r-b" in proc.stdout


def test_a_rollback_where_the_venv_step_keeps_no_history_writes_none(gate):
    gate.history.unlink()
    proc = gate.run_after_a_healthy_one("ExecStart=release r-a\n", "ExecStart=release r-b BROKEN\n")
    assert proc.returncode == 1
    assert "rolled back to release r-a" in proc.stderr and "could not record" not in proc.stderr
    assert os.readlink(gate.venv) == str(gate.root / "releases" / "r-a" / "venv")
    assert not gate.history.exists()


def test_the_gate_records_its_rollback_with_the_venv_steps_tool():
    """One writer of the activation history (files/scripts/ml_env.py): the gate runs no Python
    of its own."""
    text = (SCRIPTS / service.GATE_SCRIPT).read_text()
    assert "<<" not in text and '-c "$ml_env_tool" record "$SS_ROLLBACK_RECORD"' in text
    tool = script_text(TOOL).rstrip("\n")
    assert f"\nml_env_tool={shlex.quote(tool)}\n" in script_text(service.GATE_SCRIPT)  # in the command
    env = service.gate_environment(settings(), service.release(settings(), "r-0123456789ab"), "f" * 64,
                                   {"release": "r-ba9876543210"})
    assert json.loads(base64.b64decode(env["SS_ROLLBACK_RECORD"])) == {
        "state_dir": "/var/lib/servestack", "release": "r-ba9876543210", "previous": "r-0123456789ab",
        "by": "service-rollback", "only_where_kept": True}


def test_the_gate_reads_the_units_state_in_one_systemctl_call_per_poll(gate):
    gate.run_after_a_healthy_one("ExecStart=release r-a\n", "ExecStart=release r-b BROKEN\n")
    shows = [line for line in gate.log.read_text().splitlines() if line.startswith("systemctl show")]
    state = "systemctl show --property=ActiveState,SubState,NRestarts,Result,ExecMainStatus -- sglang.service"
    assert shows and set(shows) == {state, "systemctl show --property=InvocationID --value -- sglang.service"}


def test_a_failure_with_no_earlier_healthy_unit_stops_the_service(gate):
    gate.source.write_text("BROKEN\n")
    proc = gate.run()
    assert proc.returncode == 1
    assert "no earlier healthy unit to roll back to, so sglang.service was stopped" in proc.stderr
    assert "systemctl stop -- sglang.service" in gate.log.read_text()
    assert os.readlink(gate.venv) == str(gate.root / "releases" / "r-b" / "venv")


def test_the_gate_installs_the_unit_it_starts_just_before_the_restart(gate):
    """Issue 32 §2: the unit file was written (and daemon-reloaded) a step before the gate; a run killed in
    between left an ungated unit loaded. The gate installs it, then restarts. Issue 32 §4: until it is
    verified it is a runtime unit only, which a reboot forgets; verified, it is the service's unit, enabled."""
    gate.source.write_text("ExecStart=release r-b\n")
    assert gate.run().returncode == 0
    calls = gate.log.read_text().splitlines()
    enable, restart = "systemctl enable --quiet -- sglang.service", "systemctl restart -- sglang.service"
    assert calls.index(restart) < calls.index(enable)
    assert gate.unit.read_text() == "ExecStart=release r-b\n" and not gate.candidate.exists()


def test_a_unit_that_fails_its_gate_is_never_the_units_file_a_boot_starts(gate):
    proc = gate.run_after_a_healthy_one("ExecStart=release r-a\n", "BROKEN\n")
    assert proc.returncode == 1 and "rolled back to release r-a" in proc.stderr
    assert gate.unit.read_text() == "ExecStart=release r-a\n" and not gate.candidate.exists()
    assert "systemctl enable --quiet -- sglang.service" not in gate.log.read_text()


def test_a_unit_the_gate_cannot_install_is_never_started(gate):
    gate.state.mkdir()
    gate.good_unit.write_text("ExecStart=release r-a\n")
    gate.unit.write_text("ExecStart=release r-a\n")
    proc = gate.run(previous="r-a")                      # no release copy to install
    assert proc.returncode == 1
    assert f"could not install {gate.source} as {gate.candidate}" in proc.stderr
    assert gate.unit.read_text() == "ExecStart=release r-a\n"
    assert "rolled back to release r-a" in proc.stderr


def test_a_rollback_that_fails_too_exits_3(gate):
    proc = gate.run_after_a_healthy_one("BROKEN as well\n", "BROKEN\n")
    assert proc.returncode == 3
    assert "the rollback to release r-a failed too: the server exited before /health answered" in proc.stderr


def test_a_rollback_to_a_release_whose_venv_is_gone_says_so(gate):
    (gate.root / "releases" / "r-a" / "venv" / "bin" / "python").unlink()
    proc = gate.run_after_a_healthy_one("ExecStart=release r-a\n", "BROKEN\n")
    assert proc.returncode == 3
    assert f"the previous release's venv {gate.root}/releases/r-a/venv is gone" in proc.stderr
    assert os.readlink(gate.venv) == str(gate.root / "releases" / "r-b" / "venv")
