"""The SGLang service step on sandbox hosts with real systemd, through pyinfra's CLI over SSH.

Sandbox hosts cannot run SGLang: each test builds small releases by hand (a venv per release
under the releases dir, as the venv step lays them out) holding the stand-in server
`sandbox/standins/fake_sglang_server.py`, and sets `service_launch_module` to it. A release is made
broken by a mode file in its venv, which the stand-in reads. The deploy run is the service step
alone (`service.sglang_service(release)`, as deploy.py calls it), given the release the test activated.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox import SUDO_USER, Sandbox, cgroups
from sandbox import hosts as sandbox_hosts
from tests.integration.pyinfra_run import apply, dry_run

REPO = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")
STANDIN = REPO / "sandbox" / "standins" / "fake_sglang_server.py"
RELEASES = "/opt/servestack/releases"
UNIT = "/etc/systemd/system/sglang.service"
PORT = 30000
BASE_DATA = {"service_launch_module": "fake_sglang_server", "service_health_timeout_s": 20, "service_port": PORT}
DEPLOY = """\
from pyinfra import host
from pyinfra.operations import server

from facts.venv import MlEnvState
from operations import service
from operations.venv import mlenv_fact_arguments
from servestack import reads
from servestack.settings import host_settings

settings = host_settings(host)
if host.data.get("test_activate_during_deploy"):
    # Stand-in for venv.activate() on a first deploy: adopt the hand-made venv, switch to the new release.
    server.shell(name="adopt and activate (test stand-in for the venv step)",
                 commands=[host.data.get("test_activate_during_deploy")])
    release_id = host.data.get("test_release")
else:  # the release the test activated, as the venv step would have
    release_id = reads.fact(host, MlEnvState, **mlenv_fact_arguments(settings))["venv_path"]["release"]
service.sglang_service(service.release(settings, release_id))
"""

integration = pytest.mark.integration


@dataclass
class Run:
    rc: int
    log: str       # pyinfra's progress output (stderr in --json mode)
    result: dict   # pyinfra's --json document ({} when it printed none)

    @property
    def changed(self) -> int:
        return self.result["results"]["totals"]["success"]

    def changed_hosts(self, operation: str) -> list[str]:
        for op in self.result["results"]["operations"]:
            if op["name"].endswith(operation):
                return op["success"]
        raise KeyError(operation)


class ServiceLab:
    """A sandbox plus what these tests do to it: releases, converges, requests."""

    def __init__(self, sb: Sandbox, tmp_path: Path):
        self.sb = sb
        self.workdir = tmp_path  # pyinfra writes pyinfra-debug.log into its cwd on failures
        self.deploy = tmp_path / "deploy_service.py"
        self.deploy.write_text(DEPLOY)

    def sh(self, host, command: str, check: bool = True, user: str = "root") -> str:
        proc = self.sb.exec(host, command, user=user)
        if check and proc.returncode != 0:
            raise AssertionError(f"{host}: {command!r} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def make_release(self, release_id: str, mode: str = "ok", hosts=None) -> None:
        """A release dir with a venv holding the stand-in, told to behave as `mode`."""
        venv = f"{RELEASES}/{release_id}/venv"
        for host in hosts or self.sb.hosts:
            purelib = self.sh(host, f"python3 -m venv --without-pip {venv} && echo {mode} > {venv}/fake-sglang-mode && "
                                    f"{venv}/bin/python -c "
                                    "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'")
            (host.root_path / purelib.strip().lstrip("/") / STANDIN.name).write_text(STANDIN.read_text())

    def activate(self, release_id: str, hosts=None) -> None:
        """Switch /opt/ml-env to a release the way the venv step does (symlink + rename)."""
        for host in hosts or self.sb.hosts:
            self.sh(host, f"ln -sfn {RELEASES}/{release_id}/venv /opt/ml-env.new && mv -T /opt/ml-env.new /opt/ml-env")

    def install(self, release_id: str, mode: str = "ok", hosts=None) -> None:
        """`make_release` and `activate`: the release as the venv step leaves it for the service step."""
        self.make_release(release_id, mode, hosts)
        self.activate(release_id, hosts)

    def serve(self, release_id: str, data: dict | None = None) -> None:
        """Install a release on every host and converge onto it (`-y`), which must succeed."""
        self.install(release_id)
        run = self.converge(data, "-y")
        assert run.rc == 0, run.log

    def converge(self, data: dict | None = None, *args: str, user: str = "root", env: dict | None = None) -> Run:
        inventory = self.sb.write_inventory({**BASE_DATA, **(data or {})}, user=user)
        argv = [str(PYINFRA), *args, "--json", "--config", str(REPO / "config.py"), str(inventory), str(self.deploy)]
        proc = subprocess.run(
            self.sb.controller_cmd(argv), capture_output=True, text=True, cwd=self.workdir, timeout=300,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)},
        )
        try:
            result = json.loads(proc.stdout)
        except ValueError:
            result = {}
        return Run(proc.returncode, proc.stderr, result)

    def main_pid(self, host) -> int:
        return int(self.sh(host, "systemctl show --property=MainPID --value sglang.service").strip())

    def starts(self, host) -> int:
        """How many times the stand-in started on `host` (one journal line per start)."""
        return int(self.sh(host, "journalctl -u sglang.service -o cat --no-pager"
                                 " | grep -c 'fake sglang (stand-in) listening' || true").strip())

    def http(self, host, path: str, body: dict | None = None) -> dict:
        """A request from the controller to the host's address, as a client of the fleet would send it."""
        script = textwrap.dedent(f"""
            import json, sys, urllib.request
            body = {json.dumps(body)!r}
            request = urllib.request.Request("http://{host.address}:{PORT}{path}",
                                             data=body.encode() if body != "null" else None,
                                             headers={{"Content-Type": "application/json"}})
            print(urllib.request.urlopen(request, timeout=5).read().decode())
        """)
        proc = subprocess.run(self.sb.controller_cmd([sys.executable, "-c", script]), capture_output=True, text=True)
        assert proc.returncode == 0, f"{host.name} {path}: {proc.stderr[-500:]}"
        return json.loads(proc.stdout)

    def generate(self, host) -> str:
        return self.http(host, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})["text"]

    def server_args(self, host) -> dict:
        return self.http(host, "/server_info")["server_args"]


@pytest.fixture
def service_lab(sandbox, tmp_path):
    def make(n: int = 1) -> ServiceLab:
        return ServiceLab(sandbox(n), tmp_path)
    return make


# -- one host ---------------------------------------------------------------------------------------

@integration
def test_unit_verifies_service_answers_and_a_second_converge_changes_nothing(service_lab):
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.install("r-000000000001")
    data = {"service_env": {"SERVESTACK_TEST_VALUE": 'a$b 100% "q"'}}   # reaches the service as written

    first = svc.converge(data, "-y")
    assert first.rc == 0, first.log
    assert svc.sh(host, f"systemd-analyze verify {UNIT} 2>&1; echo rc=$?").strip() == "rc=0"
    assert svc.generate(host)

    unit = svc.sh(host, f"cat {UNIT}")
    assert f"ExecStart={RELEASES}/r-000000000001/venv/bin/python -m fake_sglang_server" in unit
    assert "/usr/local/cuda/" not in unit and "/usr/local/cuda:" not in unit
    pid = svc.main_pid(host)
    environ = dict(line.split("=", 1) for line in
                   svc.sh(host, f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines() if "=" in line)
    assert environ["CUDA_HOME"] == "/usr/local/cuda-13.0"
    assert environ["PATH"].startswith("/usr/local/cuda-13.0/bin:")
    assert environ["LD_LIBRARY_PATH"] == "/usr/local/cuda-13.0/lib64"
    assert environ["CUDA_LIB_PATH"] == "/usr/local/cuda-13.0/lib64"
    assert environ["SERVESTACK_TEST_VALUE"] == 'a$b 100% "q"'
    cache = "/var/cache/servestack/flashinfer/13.0.1-r-000000000001"
    assert environ["FLASHINFER_WORKSPACE_BASE"] == cache
    assert svc.sh(host, f"stat -c '%U %a' {cache}").strip() == "sglang 750"
    assert svc.sh(host, f"ps -o user= -p {pid}").strip() == "sglang"
    uid, shell = svc.sh(host, "getent passwd sglang | cut -d: -f3,7").strip().split(":")
    assert int(uid) < 1000 and shell == "/usr/sbin/nologin"
    assert svc.server_args(host)["speculative_algorithm"] == "EAGLE3"
    assert svc.sh(host, f"cat {RELEASES}/r-000000000001/sglang.service") == unit

    second = svc.converge(data, "-y")
    assert second.rc == 0, second.log
    assert second.changed == 0, second.log
    assert svc.main_pid(host) == pid
    assert svc.starts(host) == 1


@integration
def test_changing_a_flag_restarts_once_and_dry_run_changes_nothing(service_lab):
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.serve("r-000000000001")
    pid = svc.main_pid(host)
    unit = svc.sh(host, f"cat {UNIT}")

    dry = svc.converge({"service_attention_backend": "triton"}, "--dry", "--diff")
    assert dry.rc == 0, dry.log
    assert "-     --attention-backend flashinfer" in dry.log and "+     --attention-backend triton" in dry.log
    assert svc.main_pid(host) == pid and svc.sh(host, f"cat {UNIT}") == unit

    changed = svc.converge({"service_attention_backend": "triton"}, "-y")
    assert changed.rc == 0, changed.log
    assert changed.changed_hosts("Health-gated restart of sglang.service") == ["h1"]
    assert svc.main_pid(host) != pid
    assert svc.starts(host) == 2
    assert svc.server_args(host)["attention_backend"] == "triton"

    again = svc.converge({"service_attention_backend": "triton"}, "-y")
    assert again.changed == 0, again.log
    assert svc.starts(host) == 2

    svc.sh(host, "install -d -m 700 /models/private")
    refused = svc.converge({"service_attention_backend": "triton", "service_model_path": "/models/private"}, "-y")
    assert refused.rc != 0
    assert "the service user sglang cannot read /models/private" in refused.log, refused.log
    assert svc.starts(host) == 2 and svc.generate(host)


@integration
@pytest.mark.parametrize("mode, reason", [
    ("never-healthy", "no HTTP 200 from GET /health within 5 s"),
    ("fail-requests", "POST /generate failed"),
    ("crash", "the server exited before /health answered (exit-code, exit status 1)"),
])
def test_a_release_that_fails_its_health_gate_is_rolled_back(service_lab, mode, reason):
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.serve("r-00000000000a")
    svc.install("r-00000000000b", mode=mode)  # what the venv step does before the service step, recording it:
    history = {"activations": [{"release": "r-00000000000b", "previous": "r-00000000000a", "by": "deploy"}]}
    (host.root_path / "var/lib/servestack/releases.json").write_text(json.dumps(history))

    failed = svc.converge({"service_health_timeout_s": 5}, "-y")
    assert failed.rc != 0
    assert f"sglang.service on release r-00000000000b failed: {reason}" in failed.log, failed.log
    assert "rolled back to release r-00000000000a, which is healthy and answering again" in failed.log
    assert svc.sh(host, "readlink /opt/ml-env").strip() == f"{RELEASES}/r-00000000000a/venv"
    assert f"{RELEASES}/r-00000000000a/venv/bin/python" in svc.sh(host, f"grep ^ExecStart= {UNIT}")
    assert svc.generate(host)
    assert svc.sh(host, f"test -x {RELEASES}/r-00000000000b/venv/bin/python && echo kept").strip() == "kept"
    last = json.loads(svc.sh(host, "cat /var/lib/servestack/releases.json"))["activations"][-1]
    assert (last["release"], last["previous"], last["by"]) == ("r-00000000000a", "r-00000000000b", "service-rollback")

    settled = svc.converge({"service_health_timeout_s": 5}, "-y")
    assert settled.rc == 0 and settled.changed == 0, settled.log


@integration
def test_the_secret_never_appears_in_the_unit_the_output_the_diff_or_the_journal(service_lab):
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.install("r-000000000001")
    token = "hf_" + secrets.token_hex(16)
    data = {"service_secret_env": ["HF_TOKEN"]}

    missing = svc.converge({"service_secret_env": ["SERVESTACK_TEST_UNSET_SECRET"]}, "-y", user=SUDO_USER)
    assert missing.rc != 0
    assert ("'service_secret_env': SERVESTACK_TEST_UNSET_SECRET is not set in the control machine's environment"
            in missing.log)
    assert svc.sh(host, f"test -e {UNIT} || echo absent").strip() == "absent"

    first = svc.converge(data, "-y", "--diff", user=SUDO_USER, env={"HF_TOKEN": token})
    assert first.rc == 0, first.log
    pid = svc.main_pid(host)
    assert svc.sh(host, "stat -c '%U %G %a' /etc/servestack/sglang.service.env").strip() == "root root 600"
    assert f"HF_TOKEN={token}" in svc.sh(host, f"tr '\\0' '\\n' < /proc/{pid}/environ")

    rotated = "hf_" + secrets.token_hex(16)
    dry = svc.converge(data, "--dry", "--diff", user=SUDO_USER, env={"HF_TOKEN": rotated})
    assert "secrets file changed" in dry.log
    changed = svc.converge(data, "-y", "--diff", "-vvv", "--debug", user=SUDO_USER, env={"HF_TOKEN": rotated})
    assert changed.rc == 0, changed.log
    assert svc.main_pid(host) != pid  # the service's environment changed: restarted once

    everything = (first.log + json.dumps(first.result) + dry.log + json.dumps(dry.result) + changed.log
                  + svc.sh(host, f"cat {UNIT} {RELEASES}/r-000000000001/sglang.service")
                  + svc.sh(host, "journalctl --no-pager -o cat") + svc.sh(host, "ls -la /tmp /var/tmp"))
    everything += "".join(path.read_text() for path in svc.workdir.glob("pyinfra-debug.log"))
    assert token not in everything and rotated not in everything
    assert svc.sh(host, "grep -rl hf_ /tmp /var/tmp /home 2>/dev/null || true").strip() == ""


@integration
def test_first_deploy_over_a_hand_made_service_rolls_back_to_it(service_lab):
    """The 12.8-era host: a hand-made venv at /opt/ml-env and a hand-made unit running from it."""
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    purelib = svc.sh(host, "python3 -m venv --without-pip /opt/ml-env && /opt/ml-env/bin/python -c "
                           "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'").strip()
    (host.root_path / purelib.lstrip("/") / STANDIN.name).write_text(STANDIN.read_text())
    (host.root_path / UNIT.lstrip("/")).write_text(textwrap.dedent(f"""\
        [Service]
        ExecStart=/opt/ml-env/bin/python -m fake_sglang_server --model-path /models/old --host 0.0.0.0 --port {PORT}
        [Install]
        WantedBy=multi-user.target
    """))
    svc.sh(host, "systemctl daemon-reload && systemctl enable --now sglang.service")
    hand_made = svc.sh(host, f"cat {UNIT}")
    svc.make_release("r-00000000000b", mode="never-healthy")
    adopted = "adopted-20260101T000000Z"
    activate = (f"mkdir -p {RELEASES}/{adopted} && mv /opt/ml-env {RELEASES}/{adopted}/venv && "
                f"ln -sfn {RELEASES}/r-00000000000b/venv /opt/ml-env")

    run = svc.converge({"service_health_timeout_s": 5, "test_activate_during_deploy": activate,
                        "test_release": "r-00000000000b"}, "-y")
    assert run.rc != 0
    assert "failed: no HTTP 200 from GET /health within 5 s" in run.log, run.log
    assert f"rolled back to release {adopted}, which is healthy and answering again" in run.log, run.log
    assert svc.sh(host, f"cat {UNIT}") == hand_made
    assert svc.sh(host, "readlink /opt/ml-env").strip() == f"{RELEASES}/{adopted}/venv"
    assert svc.server_args(host)["model_path"] == "/models/old"


# -- a fleet ----------------------------------------------------------------------------------------

# One sample per line: {"at": when it began (CLOCK_MONOTONIC, the clock of systemd's *TimestampMonotonic
# on the one kernel of every sandbox host), "up": {address: whether /generate answered}}.
POLLER = """
import json, sys, time, urllib.request
port, addresses = sys.argv[1], sys.argv[2:]
body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()
while True:
    at, up = time.monotonic(), {}
    for address in addresses:
        request = urllib.request.Request(f"http://{address}:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            up[address] = bool(json.loads(urllib.request.urlopen(request, timeout=1).read())["text"])
        except Exception:
            up[address] = False
    print(json.dumps({"at": at, "up": up}), flush=True)
    time.sleep(0.05)
"""


def poll_while(svc: ServiceLab, action, on_sample=lambda sample: None, timeout: float = 120):
    """Run `action()` while a client in the controller namespace sends /generate to every host, from its
    first sample (taken before the action starts) to a sample it began after the action ended; each
    sample is also given to `on_sample` as it comes. `timeout`: a safety net for either wait."""
    argv = [sys.executable, "-u", "-c", POLLER, str(PORT), *(host.address for host in svc.sb.hosts)]
    poller = subprocess.Popen(svc.sb.controller_cmd(argv), stdout=subprocess.PIPE, text=True)
    samples: list[dict] = []
    arrived = threading.Condition()

    def read() -> None:
        for line in poller.stdout:
            sample = json.loads(line)
            on_sample(sample)
            with arrived:
                samples.append(sample)
                arrived.notify_all()
        with arrived:
            arrived.notify_all()

    def until(condition, what: str) -> None:
        with arrived:
            arrived.wait_for(lambda: condition() or not reader.is_alive(), timeout)
            assert condition(), f"{what} (samples: {samples[-5:]})"

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        until(lambda: samples, "the poller took no sample")
        result = action()
        ended = time.monotonic()
        until(lambda: samples[-1]["at"] > ended, "the poller took no sample after the action ended")
    finally:
        poller.terminate()
        poller.wait(timeout=10)
        reader.join(timeout=10)
    with arrived:
        return result, list(samples)


def down_window(svc: ServiceLab, host) -> tuple[float, float]:
    """(when its server stopped answering, when the new one first answered /health) on `host`, in seconds of
    CLOCK_MONOTONIC: systemd's ActiveExitTimestampMonotonic, and the stand-in's own line in the journal."""
    stopped = int(svc.sh(host, "systemctl show --property=ActiveExitTimestampMonotonic --value sglang.service"))
    said = svc.sh(host, "journalctl -u sglang.service -o cat --no-pager | grep 'fake sglang (stand-in) ready: ' | "
                        "tail -n 1")
    return stopped / 1e6, float(said.split()[-1])


@integration
def test_a_crash_looping_service_is_repaired_by_the_next_converge(service_lab):
    """systemd keeps NRestarts across `systemctl restart`: the gate must not take the crash loop's
    count for a crash of the release it starts (which answers /health only after 2 s here)."""
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    data = {"service_env": {"FAKE_SGLANG_STARTUP_S": "2"}}
    svc.serve("r-000000000001", data)
    svc.sh(host, f"sed -i 's|^ExecStart=|ExecStart=/bin/false |' {UNIT} && systemctl daemon-reload && "
                 "systemctl restart sglang.service")   # edited by hand: the server exits at once, systemd restarts it
    deadline = time.monotonic() + 60
    while int(svc.sh(host, "systemctl show --property=NRestarts --value sglang.service").strip() or 0) < 1:
        assert time.monotonic() < deadline, "the hand-made crash loop did not restart"
        time.sleep(1)
    run = svc.converge(data, "-y")
    assert run.rc == 0, run.log
    assert "/bin/false" not in svc.sh(host, f"cat {UNIT}")
    assert svc.sh(host, "systemctl is-active sglang.service").strip() == "active"
    assert svc.generate(host)


@integration
def test_a_server_restarted_by_hand_from_an_edited_unit_is_restarted_from_the_unit_put_back(service_lab):
    """Putting the unit file back is not enough when the running server was started from the edit."""
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.serve("r-000000000001")
    time.sleep(1.1)   # the edit is in a later second than the verified start (both are whole seconds)
    svc.sh(host, f"sed -i 's|--port 30000|--port 30001|' {UNIT} && systemctl daemon-reload && "
                 "systemctl restart sglang.service")
    dry = svc.converge({}, "--dry")
    assert "restart sglang.service on release r-000000000001: it was restarted from a unit edited" in dry.log, dry.log
    run = svc.converge({}, "-y")
    assert run.rc == 0, run.log
    assert svc.generate(host)     # on port 30000 again
    again = svc.converge({}, "-y")
    assert again.rc == 0 and again.changed == 0, again.log


@integration
def test_a_run_that_stops_between_the_unit_and_the_gate_leaves_the_verified_unit_loaded(service_lab):
    """Issue 32 §2: the unit step wrote the new unit and reloaded systemd before the gate ran; a run stopped
    in between left an ungated unit that a crash or a reboot would start. The gate installs what it starts."""
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.serve("r-000000000001")
    verified = svc.sh(host, f"cat {UNIT}")
    unit_only = "service.unit(name='Unit only', release=service.release(settings, release_id))"
    svc.deploy.write_text(DEPLOY.replace("service.sglang_service(service.release(settings, release_id))", unit_only))
    stopped = svc.converge({"service_attention_backend": "triton"}, "-y")     # the run that stopped after it
    assert stopped.rc == 0, stopped.log
    assert svc.sh(host, f"cat {UNIT}") == verified
    assert "--attention-backend triton" in svc.sh(host, f"cat {RELEASES}/r-000000000001/sglang.service")
    assert svc.sh(host, "systemctl show --property=NeedDaemonReload --value sglang.service").strip() == "no"
    svc.sh(host, "systemctl restart sglang.service")   # what a crash or a reboot does: the verified unit starts
    deadline = time.monotonic() + 60
    while svc.sh(host, f"curl -sf -o /dev/null http://127.0.0.1:{PORT}/health; echo $?", check=False).strip() != "0":
        assert time.monotonic() < deadline, "the restarted server never answered"
        time.sleep(0.5)
    assert svc.server_args(host)["attention_backend"] == "flashinfer"
    svc.deploy.write_text(DEPLOY)
    run = svc.converge({"service_attention_backend": "triton"}, "-y")
    assert run.rc == 0, run.log
    assert svc.server_args(host)["attention_backend"] == "triton"
    assert svc.converge({"service_attention_backend": "triton"}, "-y").changed == 0


HOLD = "/etc/servestack-sandbox/sglang-hold"   # FAKE_SGLANG_HOLD_FILE: /health answers 503 while it exists


@integration
def test_rolling_restart_keeps_two_of_three_hosts_answering(service_lab):
    """Each restarted server is held "loading" until the poller has seen its host not answering, so the
    client's view of every restart is an event, not a race between its sampling and a start-up time; the
    hosts' own records (when each server stopped, when the new one first answered /health) show the
    restarts never overlapped, whatever the poller's sampling rate."""
    svc = service_lab(3)
    svc.serve("r-000000000001")
    pids = {host.name: svc.main_pid(host) for host in svc.sb.hosts}
    held_data = {"service_env": {"FAKE_SGLANG_HOLD_FILE": HOLD}, "service_attention_backend": "triton"}
    held = {host.address: host for host in svc.sb.hosts}
    for host in held.values():
        svc.sh(host, f"mkdir -p {HOLD.rsplit('/', 1)[0]} && touch {HOLD}")

    def release_once_seen_down(sample: dict) -> None:
        for address, up in sample["up"].items():
            if not up and address in held:
                svc.sh(held.pop(address), f"rm {HOLD}")

    started = time.monotonic()
    run, samples = poll_while(svc, lambda: svc.converge(held_data, "-y"), release_once_seen_down)
    elapsed = time.monotonic() - started
    assert run.rc == 0, run.log
    windows = sorted(down_window(svc, host) for host in svc.sb.hosts)
    for (_, ready), (next_stopped, _) in zip(windows, windows[1:]):
        assert ready < next_stopped, f"two servers were down at once: {windows}"
    assert samples[0]["at"] < windows[0][0] and samples[-1]["at"] > windows[-1][1]   # it polled all along
    answering = [sum(sample["up"].values()) for sample in samples]
    assert min(answering) >= 2, f"fewer than 2 of 3 hosts answered at some moment: {answering}"
    for host in svc.sb.hosts:
        assert any(not sample["up"][host.address] for sample in samples), f"{host.name} was never seen restarting"
        assert svc.main_pid(host) != pids[host.name]
    assert answering[0] == answering[-1] == 3
    print(f"rolling restart of 3 hosts: {elapsed:.1f} s, {len(samples)} samples, min answering {min(answering)}; "
          "down (s after the first stop): " + ", ".join(f"{stopped - windows[0][0]:.2f}-{ready - windows[0][0]:.2f}"
                                                        for stopped, ready in windows))


def rollout_order(log: str) -> list[tuple[str, str]]:
    """(host, what happened) per host, in the order the restart operation reached them."""
    pattern = r"\[(h\d)\] (restarting|refused: sglang.service not restarted)"
    return [(name, "stopped" if what.startswith("refused") else "restarted")
            for name, what in re.findall(pattern, log)]


@integration
@pytest.mark.parametrize("budget, broken", [(0, ("h1", "h2")), (1, ("h1",))])
def test_a_failed_host_stops_the_rollout_beyond_the_failure_budget(service_lab, budget, broken):
    svc = service_lab(3)
    svc.serve("r-00000000000a")
    pids = {host.name: svc.main_pid(host) for host in svc.sb.hosts}
    bad = [host for host in svc.sb.hosts if host.name in broken]
    good = [host for host in svc.sb.hosts if host.name not in broken]
    svc.install("r-00000000000b", mode="never-healthy", hosts=bad)
    svc.install("r-00000000000c", hosts=good)

    run = svc.converge({"service_health_timeout_s": 3, "rollout_failure_budget": budget}, "-y")
    assert run.rc != 0
    order = rollout_order(run.log)  # pyinfra forms batches in its own (set) order, not the inventory's
    assert sorted(name for name, _ in order) == ["h1", "h2", "h3"], run.log
    assert run.log.count("; rolled back to release r-00000000000a") == 1, run.log
    assert "on release r-00000000000b failed" in run.log and "rolled back to release r-00000000000a" in run.log
    first_failure = next(index for index, (name, _) in enumerate(order) if name in broken)
    after = [what for _, what in order[first_failure + 1:]]
    if budget == 0:
        assert after and set(after) == {"stopped"}, run.log
        failed = order[first_failure][0]
        assert (f"the roll-out stopped after 1 host(s) failed their health gate ({failed}; rollout_failure_budget=0)"
                in run.log)
    else:
        assert "stopped" not in after, run.log
    for host in good:
        was_restarted = svc.main_pid(host) != pids[host.name]
        assert was_restarted == (dict(order)[host.name] == "restarted"), run.log
    for host in svc.sb.hosts:
        assert svc.generate(host)


# -- reboot -----------------------------------------------------------------------------------------

def reboot(sb: Sandbox, host) -> None:
    """Reboot a sandbox host: systemd-nspawn exits when its container reboots, so boot it again.

    The Sandbox has no reboot yet; this reuses its launcher and nspawn arguments on the same overlay
    layers. The upper layer (everything the deploy wrote) is kept, as a disk is across a reboot.
    """
    sb.exec(host, "systemctl reboot")
    assert cgroups.wait_empty(host.machine, 30), f"{host.name} did not shut down"
    layers = [sb.rootfs, host.upper_path, host.dir / "work", host.merged_path]
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", sandbox_hosts.LAUNCHER, "launcher",
            *map(str, layers), *sandbox_hosts._nspawn_argv(host)]
    with open(host.console_log, "ab") as console:
        launcher = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=console,
                                    text=True, start_new_session=True)
    host.pid = launcher.pid
    sb._launchers[host.name] = launcher
    sb._save()
    cgroups.attach(host.machine, launcher.pid)
    assert launcher.stdout.readline().strip() == "ready"
    sb._release(launcher)
    sb._wait_booted(host)


@integration
def test_a_host_reboot_brings_the_service_back(service_lab):
    svc = service_lab(1)
    host = svc.sb.hosts[0]
    svc.serve("r-000000000001")
    boot_id = svc.sh(host, "cat /proc/sys/kernel/random/boot_id")

    reboot(svc.sb, host)
    assert svc.sh(host, "cat /proc/sys/kernel/random/boot_id") != boot_id
    deadline = time.monotonic() + 30
    while svc.sh(host, f"curl -fsS -o /dev/null http://127.0.0.1:{PORT}/health && echo up || true").strip() != "up":
        assert time.monotonic() < deadline, svc.sh(host, "systemctl status sglang.service --no-pager", check=False)
        time.sleep(0.5)
    assert svc.generate(host)
    after = svc.converge({}, "-y")
    assert after.rc == 0 and after.changed == 0, after.log


# -- with the real venv step -------------------------------------------------------------------------

@integration
def test_after_the_real_venv_step_the_unit_runs_the_release_it_activated(lab):
    """deploy.py's venv steps + the service step on a dressed lab host (hand-made +cu128 /opt/ml-env).

    The stand-in is shipped to a directory on PYTHONPATH (service_env), so the release the venv step
    builds (the cut-down real sglang wheel cannot serve) runs it as its launch module.
    """
    the_lab = lab(1, host_data={**BASE_DATA, "service_env": {"PYTHONPATH": "/opt/servestack-test"}})
    host = the_lab.hosts[0]
    (host.root_path / "opt/servestack-test").mkdir(parents=True)
    (host.root_path / "opt/servestack-test" / STANDIN.name).write_text(STANDIN.read_text())
    deploy = "tests/integration/deploys/venv_service.py"
    before = the_lab.fingerprint(host)

    dry = dry_run(the_lab, deploy)
    planned = re.search(r"Build release (r-[0-9a-f]{12})", dry.output).group(1)
    assert f"+ ExecStart={RELEASES}/{planned}/venv/bin/python -m fake_sglang_server \\" in dry.output, dry.output
    assert the_lab.fingerprint(host) == before

    apply(the_lab, deploy)
    unit = the_lab.exec(host, f"cat {UNIT}", check=True).stdout
    assert f"ExecStart={RELEASES}/{planned}/venv/bin/python -m fake_sglang_server" in unit
    assert the_lab.exec(host, "readlink /opt/ml-env", check=True).stdout.strip() == f"{RELEASES}/{planned}/venv"
    answer = the_lab.exec(host, f"curl -fsS -d '{{\"text\": \"hi\"}}' http://127.0.0.1:{PORT}/generate", check=True)
    assert json.loads(answer.stdout)["text"]
    assert apply(the_lab, deploy).totals["success"] == 0
