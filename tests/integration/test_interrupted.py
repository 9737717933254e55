"""A run that is interrupted, refused or repeated leaves every host consistent, and says so (issue 16).

The interrupted run is the real pyinfra CLI with the real deploy.py, stopped by SIGTERM or SIGINT
(Ctrl-C) while a long host-side step runs (files/scripts/busy.sh records it in lock.activity).
That step is held on the host by a stand-in's knob file until the test removes it (the stand-in
server's FAKE_SGLANG_HOLD_FILE, the stand-in runfile's install-hold, the stand-in flashinfer's import
hold in the venv build's release checks): the re-run meets it still running however slow the machine
is, and nothing waits on a clock but the safety-net timeouts.
"""

import json
import re
import signal
import subprocess
import threading
import time

import pytest

from pyinfra_run import PYINFRA, ROOT, apply, run_pyinfra
from sandbox.lab import STANDIN_SERVER_DIR
from sandbox.standins.wheels import FLASHINFER_IMPORT_HOLD

pytestmark = pytest.mark.integration

ACTIVITY = "/var/lib/servestack/lock.activity"
INSTALL_HOLD = "/etc/servestack-sandbox/install-hold"      # read by the stand-in runfile's installer
SERVER_HOLD = "/etc/servestack-sandbox/sglang-hold"        # FAKE_SGLANG_HOLD_FILE: /health 503 while it exists
# The preflight's warning when the lock's run is gone (operations/preflight.py check_lock).
STALE_LOCK_WARNING = ("the previous run did not finish on this host: stale lock in /var/lib/servestack/lock "
                      "(run {run_id} ")


class Started:
    """The real pyinfra CLI running, its output (stdout and stderr) read as it comes, line by line."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.arrived = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.arrived:
                self.lines.append(line)
                self.arrived.notify_all()
        with self.arrived:
            self.arrived.notify_all()

    def output(self) -> str:
        with self.arrived:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> None:
        """Until the run prints a line matching `pattern` (`timeout`: a safety net, not a window)."""
        def printed() -> bool:
            return any(re.search(pattern, line) for line in self.lines)
        with self.arrived:
            self.arrived.wait_for(lambda: printed() or not self.reader.is_alive(), timeout)
            if printed():
                return
        raise AssertionError(f"the run printed no line matching {pattern!r}:\n{self.output()[-4000:]}")

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def start(lab, *args: str) -> Started:
    return Started(lab.controller_argv([PYINFRA, str(lab.inventory_path), "deploy.py", "-y", *args]))


def hold(lab, host, path: str) -> None:
    lab.exec(host, f"mkdir -p {path.rsplit('/', 1)[0]} && touch {path}", check=True)


def release(lab, host, path: str) -> None:
    lab.exec(host, f"rm {path}", check=True)


def wait_for_step(lab, host, words: str, timeout: float = 240) -> dict:
    """The host's lock.activity once it names a step containing `words`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = lab.exec(host, f"cat {ACTIVITY} 2>/dev/null").stdout.strip()
        if words in text:
            return json.loads(text)
        time.sleep(0.2)
    raise AssertionError(f"no step with {words!r} started on {host.name} within {timeout} s")


def wait_until_idle(lab, host, timeout: float = 240) -> None:
    """Until no long step of any run holds the host's lock.busy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.exec(host, "flock -n /var/lib/servestack/lock.busy true").returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{host.name} still busy after {timeout} s")


def interrupt(run: Started, signum: int) -> str:
    run.process.send_signal(signum)
    run.process.wait(timeout=120)
    run.reader.join(timeout=60)
    return run.output()


def test_sigterm_during_the_venv_build_then_an_immediate_rerun_leaves_one_release_built_once(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    hold(the_lab, host, FLASHINFER_IMPORT_HOLD)   # the build waits in its release checks until released
    run = start(the_lab)
    building = wait_for_step(the_lab, host, "venv build")
    release_id = building["step"].split()[-1]
    output = interrupt(run, signal.SIGTERM)
    assert run.returncode == 143, output[-4000:]
    assert "[h1] interrupted during 'ML environment: build release | Build release'" in output
    assert "the build goes on on the host, holding the host's lock" in output

    again = run_pyinfra(the_lab, "-y")  # the killed run's build is still running there, held
    assert again.returncode != 0
    assert f"another servestack run holds /var/lib/servestack/lock: run {building['run_id']}" in again.output, \
        again.output[-4000:]
    assert f"its connection is gone, but 'venv build {release_id}'" in again.output, again.output[-4000:]
    assert "SERVESTACK RECAP" in again.output and re.search(r"^h1 +refused +changed=0", again.output, re.M)

    release(the_lab, host, FLASHINFER_IMPORT_HOLD)
    wait_until_idle(the_lab, host)
    final = apply(the_lab)
    assert final.totals["error"] == 0
    releases = f"/opt/servestack/releases/{release_id}"
    record = json.loads(the_lab.exec(host, f"cat {releases}/release.json", check=True).stdout)
    assert record["status"] == "ok"
    log = the_lab.exec(host, f"cat {releases}/build.log", check=True).stdout
    assert log.count("pip compile") == 1, "the release was built more than once"
    assert the_lab.exec(host, "readlink /opt/ml-env", check=True).stdout.strip().endswith(f"{release_id}/venv")
    assert apply(the_lab).totals["success"] == 0


def test_ctrl_c_during_the_health_gated_restart_ends_non_zero_and_the_gate_finishes_on_the_host(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    env = json.dumps({"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_HOLD_FILE": SERVER_HOLD})
    held = ["--data", f"service_env={env}", "--data", "service_health_timeout_s=600"]   # the gate outlasts the test
    hold(the_lab, host, SERVER_HOLD)   # the restarted server stays "loading" until released
    run = start(the_lab, *held)
    gating = wait_for_step(the_lab, host, "health-gated restart")
    run.wait_for(r"^\s*\[h1\] servestack: waiting for sglang.service to become ready \(\d+ s of 600 s\)$")
    output = interrupt(run, signal.SIGINT)
    assert run.returncode == 130, output[-4000:]
    assert "[h1] interrupted during 'SGLang service | Health-gated restart of sglang.service'" in output
    assert "the health gate goes on on the host" in output

    again = run_pyinfra(the_lab, "-y", *held)
    assert again.returncode != 0, again.output[-4000:]
    assert f"another servestack run holds /var/lib/servestack/lock: run {gating['run_id']}" in again.output, \
        again.output[-4000:]
    assert "its connection is gone, but 'health-gated restart of sglang.service'" in again.output, \
        again.output[-4000:]
    release(the_lab, host, SERVER_HOLD)
    wait_until_idle(the_lab, host)
    assert the_lab.exec(host, "systemctl is-active sglang.service").stdout.strip() == "active"
    final = apply(the_lab, "deploy.py", *held)
    assert final.totals["error"] == 0
    assert STALE_LOCK_WARNING.format(run_id=gating["run_id"]) in final.output, final.output[-4000:]
    assert apply(the_lab, "deploy.py", *held).totals["success"] == 0


def test_a_health_gate_killed_on_the_host_names_the_gate_and_what_it_left_and_the_next_run_converges(lab):
    """Issue 32 §3: the gate killed on the host while its controller is still connected was reported as
    "no error output". The failure names the step, the kill and what the next run does; the next run does it."""
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    env = json.dumps({"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_HOLD_FILE": SERVER_HOLD})
    held = ["--data", f"service_env={env}", "--data", "service_health_timeout_s=600"]
    hold(the_lab, host, SERVER_HOLD)
    run = start(the_lab, *held)
    gating = wait_for_step(the_lab, host, "health-gated restart")
    run.wait_for(r"^\s*\[h1\] servestack: waiting for sglang.service to become ready \(\d+ s of 600 s\)$")
    the_lab.exec(host, f"pkill -KILL -P {gating['pid']}", check=True)   # the gate: busy.sh's child
    run.process.wait(timeout=120)
    run.reader.join(timeout=60)
    output = run.output()
    assert run.returncode != 0, output[-4000:]
    said = ("health-gated restart of sglang.service failed: servestack: health-gated restart of sglang.service was "
            "killed on the host by signal 9 before it finished: the unit it was starting may be loaded without a "
            "verified healthy start; the next run finds no healthy start recorded for it and starts it through "
            "the gate again")
    assert said in output and "no error output" not in output, output[-4000:]
    assert re.search(r"^h1 +failed +changed=\d+ .*reason: " + re.escape(said), output, re.M), output[-4000:]
    release(the_lab, host, SERVER_HOLD)
    final = apply(the_lab, "deploy.py", *held)
    assert final.totals["error"] == 0, final.output[-4000:]
    assert "will restart sglang.service" in final.output or "restarting sglang.service" in final.output
    assert the_lab.exec(host, "systemctl is-active sglang.service").stdout.strip() == "active"
    assert apply(the_lab, "deploy.py", *held).totals["success"] == 0


def test_the_recap_names_each_host_changed_unchanged_and_refused(lab):
    the_lab = lab(2)
    first = run_pyinfra(the_lab, "-y")
    assert first.returncode == 0, first.output[-4000:]
    # long steps stream their progress as they go: each uv step of the build as it starts and ends
    assert re.search(r"^\s*\[h1\] servestack: resolving the lock \(uv pip compile\): started$", first.output, re.M)
    assert re.search(r"^\s*\[h1\] servestack: install step 1 \(.*\): done after [\d.]+ s$", first.output, re.M)
    lines = [line for line in first.output.splitlines() if line.startswith(("h1 ", "h2 "))]
    assert len(lines) == 2 and all(" changed " in line and "service=restarted" in line for line in lines), lines
    assert all("release=r-" in line for line in lines)
    second = run_pyinfra(the_lab, "-y", "--json")
    recap = json.loads([line for line in second.stderr.splitlines() if "servestack_recap" in line][-1])
    assert [row["status"] for row in recap["servestack_recap"]] == ["unchanged", "unchanged"]
    assert all(row["changed"] == 0 and not row["service_restarted"] for row in recap["servestack_recap"])
    refused = run_pyinfra(the_lab, "-y", "--limit", "h1", "--data", 'gpu_compute_capability="9.0"')
    assert refused.returncode != 0
    line = [line for line in refused.output.splitlines() if line.startswith("h1 ")][-1]
    assert "refused" in line and "changed=0" in line and "reason: 8 of 8 GPUs are not compute capability 9.0" in line
    assert "pyinfra error" not in refused.output and "No hosts remaining" not in refused.output


def test_the_recap_names_a_failed_host_and_why(lab):
    the_lab = lab(1)
    apply(the_lab)
    crash = json.dumps({"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_MODE": "crash"})
    failed = run_pyinfra(the_lab, "-y", "--data", f"service_env={crash}")
    assert failed.returncode != 0
    line = [line for line in failed.output.splitlines() if line.startswith("h1 ")][-1]
    assert re.search(r"^h1 +failed +changed=\d+", line), line
    assert "reason: health-gated restart of sglang.service failed: servestack:" in line, line


@pytest.fixture(scope="module")
def never_converged(lab):
    """Two lab hosts shared by the tests that never converge them: a run that stops before connecting, and
    dry runs (the one thing they do to a host is h1's lock of another run, which the stopped run never reads)."""
    return lab(2)


def test_a_run_that_would_prompt_with_stdin_closed_stops_with_a_message_before_connecting(never_converged):
    the_lab = never_converged
    before = the_lab.fingerprints()
    run = run_pyinfra(the_lab)  # no -y, standard input /dev/null
    assert run.returncode != 0
    assert "standard input is closed: look with --dry first, then run with -y" in run.output
    assert "Traceback" not in run.output and "EOFError" not in run.output and "Connecting" not in run.output
    assert the_lab.fingerprints() == before


def test_sigterm_during_the_runfile_install_then_an_immediate_rerun_leaves_the_toolkit_installed_once(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    hold(the_lab, host, INSTALL_HOLD)   # the installer waits before it copies the toolkit until released
    run = start(the_lab)
    installing = wait_for_step(the_lab, host, "install")
    output = interrupt(run, signal.SIGTERM)
    assert run.returncode == 143, output[-4000:]
    assert "[h1] interrupted during 'CUDA toolkit | CUDA 13.0.1 at /usr/local/cuda-13.0'" in output
    assert "the download or installer goes on on the host" in output

    again = run_pyinfra(the_lab, "-y")
    assert again.returncode != 0 and f"its connection is gone, but '{installing['step']}'" in again.output, \
        again.output[-4000:]
    release(the_lab, host, INSTALL_HOLD)
    wait_until_idle(the_lab, host)
    final = apply(the_lab)
    assert final.totals["error"] == 0
    log = the_lab.exec(host, "cat /var/log/cuda-installer.log", check=True).stdout
    assert log.count("Installed: CUDA Toolkit") == 1, "the toolkit was installed more than once"
    nvcc = the_lab.exec(host, "/usr/local/cuda-13.0/bin/nvcc --version", check=True).stdout
    assert "release 13.0" in nvcc
    assert apply(the_lab).totals["success"] == 0


def test_a_dry_run_that_refuses_one_host_with_stdin_closed_ends_with_a_message_and_no_ready_line(never_converged):
    """Without -y pyinfra asks whether to go on without a refused host; with stdin closed it stops
    with a message (no EOFError traceback). Under -y the refused host gets no "Ready:" line."""
    the_lab = never_converged
    held = ('mkdir -p /var/lib/servestack && printf \'{"run_id": "other", "pid": null, "boot_id": "%s"}\\n\' '
            '"$(cat /proc/sys/kernel/random/boot_id)" > /var/lib/servestack/lock')
    the_lab.exec(the_lab.hosts[0], held, check=True)
    asked = run_pyinfra(the_lab, "--dry")
    assert asked.returncode != 0 and "Traceback" not in asked.output and "EOFError" not in asked.output
    assert "standard input is closed: stopping here (nothing was changed)" in asked.output, asked.output[-3000:]
    dry = run_pyinfra(the_lab, "--dry", "-y")
    assert "[h1] refused: another servestack run holds" in dry.output
    assert not re.search(r"\[h1\]\s+Ready:", dry.output) and re.search(r"\[h2\]\s+Ready:", dry.output), dry.output
