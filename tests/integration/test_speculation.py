"""The speculation policy and `servestack bench` on sandbox hosts (issue 17), through the real deploy.

Two hosts under service_speculation = "auto": the stand-in server's speculation wins on h1 (below 2
concurrent requests: a crossover at 2) and loses on h2. The first converge benchmarks both and keeps
speculation on h1 only; a second converge benchmarks nothing and changes nothing; `servestack bench`
re-measures on demand (with higher concurrencies: h1's crossover) and writes its JSON and chart; a
benchmark whose baseline never becomes healthy leaves the unit that served before it serving.
The benchmark's request is made small (a copy of the lab's manifest): 5 runs of 24 tokens.

The numbers are the stand-in's simulation, measured by the real client over real sleeps: each request
takes its simulated time plus the machine's delay (one wake-up, not one per token: the stand-in's
docstring). The assertions keep far from where that delay could matter: the simulated gains at
concurrency 1 are about +18% (h1) and -17% (h2), and a delay both configurations get only pulls a gain
toward 0 (it takes some 0.2 s per request to reach +-10%); at concurrency 4, twice h1's crossover,
speculation is simulated some 25% slower (with a crossover at 3, just below the level measured: 8%).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pyinfra_run import PYINFRA, PyinfraRun, apply, dry_run, run_pyinfra, small_benchmark_manifest
from sandbox.lab import STANDIN_SERVER_DIR
from sandbox.rehearse import server_info

ROOT = Path(__file__).resolve().parents[2]
RECORD = "/var/lib/servestack/speculation.json"
UNIT = "/etc/systemd/system/sglang.service"
CROSSOVER = 2   # h1's: the stand-in's speculation is faster below 2 requests in flight, slower above
THROUGHPUT = {"h1": f"crossover={CROSSOVER}", "h2": "lose"}
BENCH_LEVELS = (1, 4, 8)
pytestmark = pytest.mark.integration


@dataclass
class Fleet:
    lab: object
    manifest: Path
    first: PyinfraRun

    def configure(self, **extra_by_host) -> None:
        """Rewrite the inventory: every host "auto" with its stand-in throughput, plus `extra_by_host`."""
        def data(host):
            extra = {"service_speculation": "auto",
                     "service_env": {"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_THROUGHPUT": THROUGHPUT[host.name]},
                     **extra_by_host.get(host.name, {})}
            return self.lab.host_data(host, self.manifest, extra)
        self.lab.sandbox.write_inventory(data)


def sh(lab, host, command: str) -> str:
    return lab.exec(host, command, check=True).stdout


def record(lab, host) -> dict:
    return json.loads(sh(lab, host, f"cat {RECORD}"))


def starts(lab, host) -> int:
    """How many times the stand-in server started on the host (one journal line per start)."""
    return int(sh(lab, host, "journalctl -u sglang.service -o cat --no-pager | "
                             "grep -c 'fake sglang (stand-in) listening' || true").strip())


@pytest.fixture(scope="module")
def fleet(lab):
    the_lab = lab(2)
    made = Fleet(the_lab, small_benchmark_manifest(the_lab, max_new_tokens=24, runs=5), None)
    made.configure()
    made.first = apply(the_lab)
    return made


def test_auto_keeps_speculation_where_it_wins_and_serves_the_baseline_where_it_loses(fleet):
    lab = fleet.lab
    h1, h2 = lab.hosts
    log = fleet.first.stderr
    assert "benchmarking sglang.service with and without speculation (5 runs of 24 tokens, concurrency 1" in log
    assert "no speculation decision is recorded on the host yet" in log
    wins, loses = record(lab, h1), record(lab, h2)
    assert (wins["decision"], loses["decision"]) == ("speculation", "baseline")
    for found in (wins, loses):
        assert found["by"] == "deploy" and found["policy"] == "auto" and found["simulated"] is True
        assert len(found["configurations"]["speculation"]["runs"]) == 5
        assert found["configurations"]["speculation"]["accept_length"] > 1
        assert found["configurations"]["baseline"]["accept_length"] is None
    assert wins["gain"] > 0.1 and loses["gain"] < -0.1, (wins["why"], loses["why"])   # simulated: +18%, -17%
    assert "speculation kept: " in log and "speculation off: " in log and "tok/s with speculation vs" in log
    assert server_info(lab, h1)["server_args"]["speculative_algorithm"] == "EAGLE3"
    assert server_info(lab, h2)["server_args"]["speculative_algorithm"] is None
    assert "--speculative-algorithm" in sh(lab, h1, f"cat {UNIT}")
    assert "--speculative" not in sh(lab, h2, f"cat {UNIT}")
    # the unit the release keeps is the one it runs: the next converge has nothing to write
    release_unit = sh(lab, h2, "cat $(readlink -f /opt/ml-env)/../sglang.service")
    assert release_unit == sh(lab, h2, f"cat {UNIT}")


def test_a_second_converge_neither_benchmarks_nor_changes_anything(fleet):
    lab = fleet.lab
    before = {host.name: (record(lab, host), starts(lab, host)) for host in lab.hosts}
    dry = dry_run(lab)
    assert "will benchmark" not in dry.output
    assert dry.output.count("no change: measured for what the service runs (by deploy at ") == 2
    second = apply(lab)
    assert second.totals["success"] == 0 and second.totals["error"] == 0
    assert "benchmarking" not in second.stderr
    assert {host.name: (record(lab, host), starts(lab, host)) for host in lab.hosts} == before

    run = subprocess.run(lab.controller_argv([sys.executable, "-m", "servestack.cli", "status", str(lab.inventory_path),
                                              "--json"]), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    hosts = json.loads(run.stdout)["hosts"]
    assert hosts["h1"]["speculation"]["decision"] == "speculation" and hosts["h1"]["speculation"]["for_active_release"]
    assert hosts["h2"]["speculation"]["decision"] == "baseline" and hosts["h2"]["speculation"]["simulated"]


def test_servestack_bench_dry_shows_the_plan_and_restarts_nothing(fleet):
    lab = fleet.lab
    before = {host.name: (record(lab, host), starts(lab, host)) for host in lab.hosts}
    argv = [sys.executable, "-m", "servestack.cli", "bench", str(lab.inventory_path), "--dry"]
    run = subprocess.run(lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stderr.count("will benchmark sglang.service with and without speculation") == len(lab.hosts)
    assert "each restart waits up to" in run.stderr and "nothing was restarted or measured" in run.stderr
    assert {host.name: (record(lab, host), starts(lab, host)) for host in lab.hosts} == before
    without_terminal = subprocess.run(lab.controller_argv(argv[:-1]), cwd=ROOT, capture_output=True, text=True,
                                      timeout=600, stdin=subprocess.DEVNULL)
    assert without_terminal.returncode == 2 and "pass -y to run without asking" in without_terminal.stderr


def test_servestack_bench_measures_on_demand_and_writes_json_and_a_chart(fleet, tmp_path):
    lab = fleet.lab
    output, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [sys.executable, "-m", "servestack.cli", "bench", str(lab.inventory_path), "-y", "--runs", "5",
            "--concurrency", ",".join(map(str, BENCH_LEVELS)), "--json", str(output), "--plot", str(chart)]
    first_beyond = min(level for level in BENCH_LEVELS if level >= CROSSOVER)   # 4
    run = subprocess.run(lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(f"\n--- servestack bench (table) ---\n{run.stdout}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "SIMULATED" in run.stdout and "gain over baseline" in run.stdout and "accept length" in run.stdout
    assert f"h1: speculation stops paying at concurrency {first_beyond}" in run.stdout
    document = json.loads(output.read_text())
    assert document["simulated"] is True and set(document["hosts"]) == {"h1", "h2"}
    h1, h2 = document["hosts"]["h1"], document["hosts"]["h2"]
    assert h1["measured"] and h2["measured"] and h1["crossover"] == first_beyond and h2["crossover"] == 1
    assert [level["concurrency"] for level in h1["configurations"]["speculation"]["concurrency"]] == [*BENCH_LEVELS]
    assert (h1["decision"], h2["decision"]) == ("speculation", "baseline")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for host in lab.hosts:
        assert record(lab, host)["by"] == "bench" and record(lab, host)["request"] == document["request"]
    assert server_info(lab, lab.hosts[0])["server_args"]["speculative_algorithm"] == "EAGLE3"
    assert server_info(lab, lab.hosts[1])["server_args"]["speculative_algorithm"] is None
    # the host was left as a deploy would leave it: the next converge changes nothing
    after = apply(lab)
    assert after.totals["success"] == 0 and "benchmarking" not in after.stderr


def test_a_benchmark_that_fails_midway_leaves_the_previous_unit_serving(fleet):
    lab = fleet.lab
    h1 = lab.hosts[0]
    kept = record(lab, h1)
    sh(lab, h1, "echo never-healthy > /opt/ml-env/fake-sglang-mode-baseline")   # only the baseline fails
    fleet.configure(h1={"service_extra_args": ["--log-level", "info"], "service_health_timeout_s": 15})
    dry = dry_run(lab, "deploy.py", "--limit", "h1")
    assert "will benchmark sglang.service with and without speculation" in dry.output
    assert "what the service runs changed since the last benchmark: the server's command line" in dry.output

    run = run_pyinfra(lab, "-y", "--limit", "h1")
    assert run.returncode != 0
    assert "health-gated start of the baseline configuration of sglang.service failed" in run.output
    assert "rolled back to the last unit that passed the health gate" in run.output
    unit = sh(lab, h1, f"cat {UNIT}")
    assert "--speculative-algorithm" in unit and "--log-level info" in unit   # the service step's unit
    assert sh(lab, h1, "systemctl is-active sglang.service").strip() == "active"
    info = server_info(lab, h1)
    assert info["server_args"]["speculative_algorithm"] == "EAGLE3" and "--log-level" in info["argv"]
    assert record(lab, h1) == kept   # nothing recorded: the next deploy measures again
    assert sh(lab, h1, "cat /var/lib/servestack/lock 2>/dev/null || echo released").strip() == "released"


MARKER = "/var/lib/servestack/speculation.running.json"


def test_a_benchmark_whose_controller_is_killed_is_named_by_the_next_run_which_finishes_the_job(fleet):
    """Issue 32 §3: a SIGKILL of the controller during the benchmark left a configuration serving and no
    decision, and the next run measured again without saying why. It names the unfinished benchmark,
    serves the unit the policy chooses, measures and records, and leaves no marker."""
    lab = fleet.lab
    h2 = lab.hosts[1]
    fleet.configure(h2={"service_extra_args": ["--log-level", "warning"]})   # what h2 runs changed: measure
    argv = lab.controller_argv([PYINFRA, str(lab.inventory_path), "deploy.py", "-y", "--limit", "h2"])
    run = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while lab.exec(h2, f"test -e {MARKER}").returncode != 0:
            assert run.poll() is None and time.monotonic() < deadline, "the benchmark never started"
            time.sleep(0.2)
        marker = json.loads(sh(lab, h2, f"cat {MARKER}"))
        run.kill()                                            # SIGKILL: the controller dies mid-benchmark
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    deadline = time.monotonic() + 300
    while lab.exec(h2, "flock -n /var/lib/servestack/lock.busy true").returncode != 0:   # its gate finishes
        assert time.monotonic() < deadline
        time.sleep(0.5)

    again = run_pyinfra(lab, "-y", "--limit", "h2")
    assert again.returncode == 0, again.output[-6000:]
    assert (f"the speculation benchmark of run {marker['run_id']} (deploy, started {marker['started']}) did not "
            "finish") in again.output, again.output[-6000:]
    assert "speculation off" in again.output                 # h2's stand-in loses: measured and decided
    assert record(lab, h2)["decision"] == "baseline"
    assert "--speculative-algorithm" not in sh(lab, h2, f"cat {UNIT}")
    assert lab.exec(h2, f"test -e {MARKER}").returncode != 0
    apply(lab, "deploy.py", "--limit", "h2")
    assert "did not finish" not in dry_run(lab, "deploy.py", "--limit", "h2").output
