"""A host that reboots in the middle of a long step (issue 32 §4).

test_interrupted.py kills the CONTROLLER mid-step; here the HOST's machine restarts instead
(`Lab.reboot`: a power loss, every process of the host SIGKILLed, then a boot from the same disk).
The step is held on the host by a stand-in's knob file (as in test_interrupted.py; the model download:
its process stopped), so the reboot meets it running however slow the machine is. After the reboot
the host must boot with what it had before the step (toolkit, environment, service), and the next run
must say what was interrupted, clean up only what that step made (the model download: resume it), and
converge; the run after it changes nothing.
"""

import json
import time

import pytest

from pyinfra_run import apply
from sandbox.hosts import BOOTED_STATES
from sandbox.lab import STANDIN_SERVER_DIR
from sandbox.standins.wheels import FLASHINFER_IMPORT_HOLD
from sandbox.standins import hub
from test_interrupted import INSTALL_HOLD, SERVER_HOLD, STALE_LOCK_WARNING, hold, release, start, wait_for_step
from weights_lab import BIG, KIMI, control, download_process, hub_requests

pytestmark = pytest.mark.integration

BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
VENV = "/opt/ml-env"
RELEASES = "/opt/servestack/releases"
UNIT = "/etc/systemd/system/sglang.service"
HEALTH = "curl -fsS -o /dev/null --max-time 5 http://127.0.0.1:30000/health"


# -- the sandbox's reboot itself ---------------------------------------------------------------------

@pytest.mark.parametrize("hard", [True, False], ids=["power-loss", "systemctl-reboot"])
def test_a_reboot_keeps_the_disk_and_identity_and_loses_processes_run_and_tmp(sandbox, hard):
    sb = sandbox(1)
    host = sb.hosts[0]
    before = sb.exec(host, f"{BOOT_ID}; echo kept > /var/lib/kept; touch /run/gone /tmp/gone; "
                           "setsid sleep 1000 </dev/null >/dev/null 2>&1 &", check=True).stdout.strip()
    sb.reboot(host, hard=hard)
    after = sb.exec(host, f"{BOOT_ID}; cat /var/lib/kept; ls /run/gone /tmp/gone 2>&1; pgrep -x sleep; "
                          "systemctl is-system-running || true", check=True, user="ubuntu")   # strict host key: same
    boot_id, kept, *rest = after.stdout.splitlines()
    assert boot_id != before and kept == "kept", after.stdout
    assert rest[-1] in BOOTED_STATES and "No such file" in rest[0] and "No such file" in rest[1], after.stdout
    assert len(rest) == 3, f"a process outlived the reboot: {after.stdout}"


def test_a_power_loss_leaves_no_process_a_moment_to_act(sandbox):
    """Every process stops at once: no shell outlives the command it waits on and runs its next line (as
    busy.sh would remove lock.activity). One SIGKILL after another let some do so (seen: 2 of 3 tries)."""
    sb = sandbox(1)
    host = sb.hosts[0]
    shells = ("mkdir /var/lib/after; for i in $(seq 100); do "
              "setsid bash -c \"sleep 1000; touch /var/lib/after/$i\" </dev/null >/dev/null 2>&1 & done; "
              "while [ $(pgrep -cx sleep) -lt 100 ]; do sleep 0.1; done")
    sb.exec(host, shells, check=True)
    sb.reboot(host)
    assert sb.exec(host, "ls /var/lib/after", check=True).stdout == ""


# -- a reboot in a long step of a deploy -------------------------------------------------------------

def reboot_during(the_lab, host, run) -> str:
    """Reboot `host` under `run` (its step held), let the run end; the run's output."""
    booted = the_lab.exec(host, BOOT_ID, check=True).stdout
    the_lab.reboot(host)
    run.process.wait(timeout=240)
    run.reader.join(timeout=60)
    assert run.returncode != 0, run.output()[-4000:]
    assert the_lab.exec(host, BOOT_ID, check=True).stdout != booted
    return run.output()


def wait_on(the_lab, host, command: str, what: str, timeout: float = 240) -> None:
    """Until `command` succeeds on `host` (`timeout`: a safety net, not a window)."""
    deadline = time.monotonic() + timeout
    while the_lab.exec(host, command).returncode != 0:
        assert time.monotonic() < deadline, f"{host.name}: {what} did not happen within {timeout} s"
        time.sleep(0.5)


def serving(the_lab, host, timeout: float = 120) -> bool:
    """Whether sglang.service is active and answers /health 200 on the host (waiting for its boot start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if the_lab.exec(host, f"systemctl is-active -q sglang.service && {HEALTH}").returncode == 0:
            return True
        time.sleep(1)
    return False


def releases(the_lab, host) -> dict[str, str]:
    """Every release directory and its release.json."""
    listing = the_lab.exec(host, f"for r in {RELEASES}/*/; do echo \"$r $(cat $r/release.json 2>/dev/null | "
                                 "sha256sum)\"; done", check=True).stdout
    return dict(line.split(" ", 1) for line in listing.splitlines())


def next_runs_converge(the_lab, interrupted: dict, *args: str):
    """The run after the reboot names the stale lock and its step, and succeeds; the one after changes nothing."""
    final = apply(the_lab, "deploy.py", *args)
    stale = STALE_LOCK_WARNING.format(run_id=interrupted["run_id"])
    said = "\n".join(line for line in final.output.splitlines() if "lock" in line and "{" not in line)
    assert stale in final.output and f"interrupted during '{interrupted['step']}'" in final.output, said
    assert "the host rebooted since: that run and every step it started are gone" in final.output, said
    assert apply(the_lab, "deploy.py", *args).totals["success"] == 0
    return final


def test_a_reboot_during_the_venv_build_boots_the_previous_environment_and_the_next_run_rebuilds(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    active, unit = (the_lab.exec(host, command, check=True).stdout for command in (f"readlink {VENV}",
                                                                                  f"sha256sum {UNIT}"))
    before = releases(the_lab, host)
    # a new stack: the same files from another (mirror) URL are other inputs, so another release
    wheel = the_lab.artifacts.host_data(the_lab.server_url(host))["wheel_url_sgl_kernel"] + "?copy=reboot"
    changed = ("--data", f"wheel_url_sgl_kernel={wheel}")
    hold(the_lab, host, FLASHINFER_IMPORT_HOLD)   # the build waits in its release checks
    run = start(the_lab, *changed)
    building = wait_for_step(the_lab, host, "venv build")
    new = building["step"].split()[-1]
    wait_on(the_lab, host, "pgrep -f check_release", "the build reaching its release checks")
    reboot_during(the_lab, host, run)

    assert the_lab.exec(host, f"readlink {VENV}", check=True).stdout == active
    assert the_lab.exec(host, f"sha256sum {UNIT}", check=True).stdout == unit
    assert serving(the_lab, host), the_lab.exec(host, "systemctl status sglang.service").stdout
    left = json.loads(the_lab.exec(host, f"cat {RELEASES}/{new}/release.json", check=True).stdout)
    assert left["status"] == "building"

    release(the_lab, host, FLASHINFER_IMPORT_HOLD)
    final = next_runs_converge(the_lab, building, *changed)
    assert f"Rebuilding release {new} (it was left building" in final.output, final.output[-4000:]
    assert the_lab.exec(host, f"readlink {VENV}", check=True).stdout.strip() == f"{RELEASES}/{new}/venv"
    log = the_lab.exec(host, f"cat {RELEASES}/{new}/build.log", check=True).stdout
    assert log.count("pip compile") == 1
    after = releases(the_lab, host)
    assert {path: after[path] for path in before} == before, "the run touched a release the build did not make"
    assert set(after) - set(before) == {f"{RELEASES}/{new}/"}
    assert serving(the_lab, host, timeout=10)


def test_a_reboot_during_the_health_gated_restart_boots_the_verified_unit_and_the_next_run_gates_again(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    unit = the_lab.exec(host, f"sha256sum {UNIT}", check=True).stdout
    env = json.dumps({"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_HOLD_FILE": SERVER_HOLD})
    held = ("--data", f"service_env={env}", "--data", "service_health_timeout_s=600")
    hold(the_lab, host, SERVER_HOLD)   # the new unit's server answers /health 503 until released
    run = start(the_lab, *held)
    gating = wait_for_step(the_lab, host, "health-gated restart")
    run.wait_for(r"^\s*\[h1\] servestack: waiting for sglang.service to become ready \(\d+ s of 600 s\)$")
    reboot_during(the_lab, host, run)

    booted_unit = the_lab.exec(host, f"sha256sum {UNIT}", check=True).stdout
    booted_serving = serving(the_lab, host, timeout=30)
    release(the_lab, host, SERVER_HOLD)
    final = next_runs_converge(the_lab, gating, *held)
    assert "restarting sglang.service" in final.output or "will restart sglang.service" in final.output
    assert serving(the_lab, host, timeout=10)
    # what the host booted with: the unit the gate verified last (the gate's unit was a runtime unit only), serving
    assert (booted_unit, booted_serving) == (unit, True), "the host booted a unit no gate verified"


def test_a_reboot_during_the_runfile_install_boots_the_previous_toolkit_and_the_next_run_installs_once(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    toolkit = "readlink /usr/local/cuda; /usr/local/cuda/bin/nvcc --version | tail -1"
    previous, env = (the_lab.exec(host, command, check=True).stdout for command in (toolkit, f"readlink -f {VENV}"))
    hold(the_lab, host, INSTALL_HOLD)   # the installer waits before it copies the toolkit
    run = start(the_lab)
    installing = wait_for_step(the_lab, host, "install")
    wait_on(the_lab, host, "grep -q 'STAND-IN: holding' /var/log/cuda-installer.log", "the installer's hold")
    the_lab.exec(host, "test -f /var/lib/servestack/toolkit-install.json", check=True)
    reboot_during(the_lab, host, run)

    assert the_lab.exec(host, toolkit, check=True).stdout == previous
    assert the_lab.exec(host, f"readlink -f {VENV}", check=True).stdout == env
    release(the_lab, host, INSTALL_HOLD)
    next_runs_converge(the_lab, installing)
    log = the_lab.exec(host, "cat /var/log/cuda-installer.log", check=True).stdout
    assert log.count("Installed: CUDA Toolkit") == 1, "the toolkit was installed more than once"
    assert "release 13.0" in the_lab.exec(host, "/usr/local/cuda-13.0/bin/nvcc --version", check=True).stdout
    assert "release 12.8" in the_lab.exec(host, "/usr/local/cuda-12.8/bin/nvcc --version", check=True).stdout
    the_lab.exec(host, "test ! -e /var/lib/servestack/toolkit-install.json", check=True)
    assert serving(the_lab, host, timeout=10)


def test_a_reboot_during_the_model_download_boots_the_previous_service_and_the_next_run_resumes_the_download(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    unit = the_lab.exec(host, f"sha256sum {UNIT}", check=True).stdout
    moved = ("--data", "service_models_dir=/srv/models")   # the weights are staged again elsewhere: a new download
    staged = f"/srv/models/{KIMI.replace('/', '--')}/{hub.commits()[KIMI]}"
    partial = f"{staged}/.cache/huggingface/download"       # where huggingface_hub keeps a file being downloaded
    control(the_lab, "add_fault", f"{hub.PREFIX}/{KIMI}/resolve/*/{BIG}", "slow", after=hub.MIB // 2)   # ~25 s
    run = start(the_lab, *moved)
    downloading = wait_for_step(the_lab, host, "model weights download")
    python = download_process(the_lab, host, downloading["pid"])
    # held once part of the big file is on disk: the host waits for it itself, no round trip races the download
    the_lab.exec(host, f"until [ -n \"$(find {partial} -name '*.incomplete' -size +1024k 2>/dev/null)\" ]; do "
                       f"sleep 0.05; done; kill -STOP {python}", check=True, timeout=240)
    reboot_during(the_lab, host, run)

    assert the_lab.exec(host, f"sha256sum {UNIT}", check=True).stdout == unit
    assert serving(the_lab, host), the_lab.exec(host, "systemctl status sglang.service").stdout
    have = int(the_lab.exec(host, f"stat -c %s {partial}/*.incomplete", check=True).stdout)
    assert 0 < have < hub.WEIGHT_SIZES[0]
    control(the_lab, "reset")
    next_runs_converge(the_lab, downloading, *moved)
    big = [(record["method"], record["range"]) for record in hub_requests(the_lab)
           if record["path"].endswith(f"/{KIMI}/resolve/{hub.commits()[KIMI]}/{BIG}")]
    assert big == [("HEAD", None), ("GET", f"bytes={have}-")], "the download started over"
    assert hub.served_bytes(hub_requests(the_lab), KIMI, BIG) == hub.WEIGHT_SIZES[0] - have
    assert f"--model-path {staged} " in the_lab.exec(host, f"cat {UNIT}", check=True).stdout
    assert serving(the_lab, host, timeout=10)
