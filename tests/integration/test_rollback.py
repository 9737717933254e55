"""Rollback on sandbox hosts.

The venv steps alone (deploys/venv_rollback.py, a VenvLab host): refuse with nothing to return to, back
to the adopted env, idempotent, roll forward without a rebuild, and to an explicit release.

The real rollback.py after the real deploy.py (a dressed lab host under service_speculation = "auto",
whose stand-in server loses with speculation: the deploy keeps the baseline), as docs/operating.md's "Rollback"
says: refused unchanged with nothing to return to; the unit re-rendered for the re-activated release
(its ExecStart), restarted through the health gate, serving the profile as written under "auto" without
a benchmark; a second rollback changes nothing; deploy.py rolls forward without a benchmark; a release
that fails the gate is rolled back from.
"""

from __future__ import annotations

import json
import re

import pytest

from pyinfra_run import apply, dry_run, run_pyinfra, small_benchmark_manifest
from venv_lab import MANIFEST, RELEASES, ROLLBACK, STACK, UPGRADE, VENV, start_lab

pytestmark = pytest.mark.integration

UNIT = "/etc/systemd/system/sglang.service"
GATE_RECORD = "/var/lib/servestack/service/sglang.service.json"   # operations/service.py record_path
SPECULATION_RECORD = "/var/lib/servestack/speculation.json"
STANDIN_DIR = "/opt/servestack-sandbox-standins"                  # sandbox/lab.py STANDIN_SERVER_DIR
PORT = MANIFEST.service["port"]


@pytest.fixture(scope="module")
def venv_lab(sandbox):
    with start_lab(sandbox) as lab:
        yield lab


def torch_of(lab, host) -> str:
    return lab.sh(host, f"{VENV}/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'").strip()


def link(lab, host) -> str:
    return lab.sh(host, f"readlink {VENV} || echo not-a-link").strip()


def changes(report) -> int:
    return report["results"]["totals"]["success"]


def test_rollback_refuses_when_there_is_nothing_to_roll_back_to(venv_lab):
    host = venv_lab.sandbox.hosts[0]
    result, _ = venv_lab.pyinfra(ROLLBACK)
    assert result.returncode != 0
    assert "refused: nothing to roll back to" in result.stdout + result.stderr
    assert link(venv_lab, host) == "not-a-link" and torch_of(venv_lab, host).endswith("+cu128 12.8")


def test_rollback_returns_to_the_adopted_env_and_is_idempotent(venv_lab):
    lab = venv_lab
    host = lab.sandbox.hosts[0]
    result, _ = lab.pyinfra(UPGRADE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert torch_of(lab, host) == f"{STACK.package('torch').version} 13.0"
    new = link(lab, host)
    result, report = lab.pyinfra(ROLLBACK)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert changes(report) >= 1
    assert link(lab, host).startswith(f"{RELEASES}/adopted-")
    assert torch_of(lab, host).endswith("+cu128 12.8")  # the hand-made env works through /opt/ml-env again
    result, report = lab.pyinfra(ROLLBACK)
    assert result.returncode == 0 and changes(report) == 0, result.stderr[-2000:]
    assert lab.sh(host, f"test -d {new} && echo kept").strip() == "kept"


def test_deploy_rolls_forward_without_rebuilding(venv_lab):
    lab = venv_lab
    host = lab.sandbox.hosts[0]
    built = lab.sh(host, f"cat {RELEASES}/r-*/release.json")
    result, report = lab.pyinfra(UPGRADE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch_of(lab, host) == f"{STACK.package('torch').version} 13.0"
    history = json.loads(lab.sh(host, "cat /var/lib/servestack/releases.json"))["activations"]
    assert [entry["by"] for entry in history] == ["adopt", "deploy", "rollback", "deploy"]
    assert lab.sh(host, f"cat {RELEASES}/r-*/release.json") == built  # re-activated, not rebuilt
    result, report = lab.pyinfra(UPGRADE)
    assert changes(report) == 0


def test_rollback_to_an_explicit_release(venv_lab):
    lab = venv_lab
    host = lab.sandbox.hosts[0]
    adopted = lab.sh(host, f"ls -d {RELEASES}/adopted-*").strip().rsplit("/", 1)[1]
    current = link(lab, host)
    result, _ = lab.pyinfra(ROLLBACK, extra_data={"venv_rollback_to": adopted})
    assert result.returncode == 0, result.stderr[-2000:]
    assert link(lab, host) == f"{RELEASES}/{adopted}/venv"
    result, _ = lab.pyinfra(ROLLBACK, extra_data={"venv_rollback_to": "r-000000000000"})
    assert result.returncode != 0 and "is not kept on the host" in result.stdout + result.stderr
    assert link(lab, host) == f"{RELEASES}/{adopted}/venv"
    lab.pyinfra(UPGRADE)
    assert link(lab, host) == current


# -- the real rollback.py after the real deploy.py ------------------------------------------------------

class Fleet:
    """One dressed lab host under service_speculation = "auto" whose stand-in loses with speculation."""

    def __init__(self, lab):
        self.lab = lab
        self.host = lab.hosts[0]
        self.manifest = small_benchmark_manifest(lab, max_new_tokens=16, runs=3)
        self.configure()

    def configure(self, **extra) -> None:
        data = {"service_speculation": "auto", "service_health_timeout_s": 30,
                "service_env": {"PYTHONPATH": STANDIN_DIR, "FAKE_SGLANG_THROUGHPUT": "lose"}, **extra}
        self.lab.sandbox.write_inventory(lambda host: self.lab.host_data(host, self.manifest, data))

    def sh(self, command: str) -> str:
        return self.lab.exec(self.host, command, check=True).stdout

    def active(self) -> str:
        """The release /opt/ml-env points at."""
        return re.fullmatch(rf"{RELEASES}/([^/]+)/venv", self.sh(f"readlink {VENV}").strip()).group(1)

    def exec_start(self) -> str:
        return next(line for line in self.sh(f"cat {UNIT}").splitlines() if line.startswith("ExecStart="))

    def server_python(self) -> str:
        """The program of the running server's process (its command line's first word)."""
        pid = self.sh("systemctl show -P MainPID sglang.service").strip()
        return self.sh(f"tr '\\0' '\\n' < /proc/{pid}/cmdline | head -n 1").strip()

    def invocation(self) -> str:
        return self.sh("systemctl show -P InvocationID sglang.service").strip()

    def gate_record(self) -> dict:
        return json.loads(self.sh(f"cat {GATE_RECORD}"))

    def starts(self) -> int:
        """How many times the stand-in server started (one journal line per start)."""
        return int(self.sh("journalctl -u sglang.service -o cat --no-pager | "
                           "grep -c 'fake sglang (stand-in) listening' || true").strip())

    def server_args(self) -> dict:
        """What the running server was started with (the stand-in's /server_info, asked on the host)."""
        return json.loads(self.sh(f"curl -fsS http://127.0.0.1:{PORT}/server_info"))["server_args"]


@pytest.fixture(scope="module")
def fleet(lab):
    return Fleet(lab(1))


@pytest.fixture(scope="module")
def deployed(fleet):
    """rollback.py on the fresh host, then its first deploy: (the refused rollback, whether it left the host
    unchanged, the deploy)."""
    before = fleet.lab.fingerprint(fleet.host)
    refused = run_pyinfra(fleet.lab, "-y", target="rollback.py")
    unchanged = fleet.lab.fingerprint(fleet.host) == before
    return refused, unchanged, apply(fleet.lab)


def test_rollback_py_refuses_a_host_with_nothing_to_roll_back_to_unchanged(deployed):
    refused, unchanged, _ = deployed
    assert refused.returncode != 0
    assert "refused: nothing to roll back to" in refused.output, refused.output[-3000:]
    assert unchanged, "rollback.py changed a host it refused"


def test_the_deploy_under_auto_keeps_the_baseline(fleet, deployed):
    _, _, deploy = deployed
    assert "speculation off: " in deploy.stderr
    assert json.loads(fleet.sh(f"cat {SPECULATION_RECORD}"))["decision"] == "baseline"
    assert "--speculative" not in fleet.sh(f"cat {UNIT}")
    assert fleet.active().startswith("r-")


def test_rollback_py_re_renders_the_unit_and_restarts_it_through_the_gate(fleet, deployed):
    deployed_release, measured = fleet.active(), fleet.sh(f"cat {SPECULATION_RECORD}")
    adopted = next(name for name in fleet.sh(f"ls {RELEASES}").split() if name.startswith("adopted-"))
    before = fleet.lab.fingerprint(fleet.host)
    dry = dry_run(fleet.lab, "rollback.py")
    assert f"- ExecStart={RELEASES}/{deployed_release}/venv/bin/python -m fake_sglang_server \\" in dry.output
    assert f"+ ExecStart={RELEASES}/{adopted}/venv/bin/python -m fake_sglang_server \\" in dry.output
    assert fleet.lab.fingerprint(fleet.host) == before, "the dry run changed the host"

    run = apply(fleet.lab, "rollback.py")
    assert fleet.active() == adopted
    assert fleet.exec_start() == f"ExecStart={RELEASES}/{adopted}/venv/bin/python -m fake_sglang_server \\"
    assert fleet.server_python() == f"{RELEASES}/{adopted}/venv/bin/python"
    assert f"restarting sglang.service on release {adopted}" in run.stderr
    verified = fleet.gate_record()     # written by the health gate once /health and /generate answered
    assert (verified["release"], verified["invocation"]) == (adopted, fleet.invocation())
    # under "auto" the re-activated release serves the profile as written, and nothing is measured
    assert "--speculative-algorithm EAGLE3" in fleet.sh(f"cat {UNIT}")
    assert fleet.server_args()["speculative_algorithm"] == "EAGLE3"
    assert "benchmarking" not in run.stderr
    assert fleet.sh(f"cat {SPECULATION_RECORD}") == measured
    history = json.loads(fleet.sh("cat /var/lib/servestack/releases.json"))["activations"]
    assert (history[-1]["release"], history[-1]["previous"], history[-1]["by"]) == (adopted, deployed_release,
                                                                                     "rollback")


def test_a_second_rollback_py_changes_nothing(fleet):
    invocation, starts, unit = fleet.invocation(), fleet.starts(), fleet.sh(f"cat {UNIT}")
    again = apply(fleet.lab, "rollback.py")
    assert again.totals["success"] == 0, again.stderr[-3000:]
    assert (fleet.invocation(), fleet.starts(), fleet.sh(f"cat {UNIT}")) == (invocation, starts, unit)


def test_deploy_py_rolls_forward_to_the_measured_release_without_a_benchmark(fleet):
    adopted, measured = fleet.active(), fleet.sh(f"cat {SPECULATION_RECORD}")
    forward = apply(fleet.lab)
    assert fleet.active() != adopted and fleet.active().startswith("r-")
    assert "benchmarking" not in forward.stderr
    assert fleet.sh(f"cat {SPECULATION_RECORD}") == measured
    assert "--speculative" not in fleet.sh(f"cat {UNIT}")     # the decision recorded for this release
    assert fleet.server_args()["speculative_algorithm"] is None


def test_a_rollback_whose_release_fails_the_gate_goes_back_to_the_running_release(fleet):
    current, invocation = fleet.active(), fleet.invocation()
    unit = fleet.sh(f"cat {UNIT}")
    adopted = next(name for name in fleet.sh(f"ls {RELEASES}").split() if name.startswith("adopted-"))
    fleet.sh(f"echo never-healthy > {RELEASES}/{adopted}/venv/fake-sglang-mode")   # read by the stand-in server
    fleet.configure(service_health_timeout_s=5)
    failed = run_pyinfra(fleet.lab, "-y", target="rollback.py")
    assert failed.returncode != 0
    assert (f"sglang.service on release {adopted} failed: no HTTP 200 from GET /health within 5 s"
            in failed.output), failed.output[-4000:]
    assert f"rolled back to release {current}, which is healthy and answering again" in failed.output
    assert fleet.active() == current and fleet.sh(f"cat {UNIT}") == unit
    assert fleet.invocation() != invocation and fleet.gate_record()["invocation"] == fleet.invocation()
    assert fleet.server_args()["speculative_algorithm"] is None
