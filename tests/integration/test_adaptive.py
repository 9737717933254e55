"""service_speculation = "adaptive" on a sandbox host, through the real deploy (issue 33).

One host serving the GLM-5 profile (sglang 0.5.14, NEXTN with topk 1: SGLang runs adaptive speculation
for it), whose stand-in server's speculation is faster below 8 requests in flight and slower above
(`crossover=8`). The first converge measures both configurations at concurrency 1, 4, 16 and 64,
writes SGLang's adaptive config with speculation off from 16 (the first level measured to lose; between
4 and 16 the crossover is not measured) and SGLang's own slots 1 and 8 below, starts the unit with
`--speculative-adaptive --speculative-adaptive-config <file>` and measures it too; the record holds the
numbers and the config. A second converge measures nothing, changes nothing and costs no remote
command more than any other host's (tests/integration/test_probe.py). The numbers are the
stand-in's simulation (SIMULATED): at 16 and 64 the simulated speculation is some 15% and 30% slower.
"""

from __future__ import annotations

import json

import pytest

from pyinfra_run import apply, dry_run, small_benchmark_manifest
from sandbox.lab import STANDIN_SERVER_DIR
from sandbox.rehearse import server_info
from test_probe import MAX_NOOP_COMMANDS, counted_run

RECORD = "/var/lib/servestack/speculation.json"
UNIT = "/etc/systemd/system/sglang.service"
pytestmark = pytest.mark.integration


def sh(lab, host, command: str) -> str:
    return lab.exec(host, command, check=True).stdout


def starts(lab, host) -> int:
    return int(sh(lab, host, "journalctl -u sglang.service -o cat --no-pager | "
                             "grep -c 'fake sglang (stand-in) listening' || true").strip())


@pytest.fixture(scope="module")
def adaptive(lab):
    the_lab = lab(1)
    manifest = small_benchmark_manifest(the_lab, max_new_tokens=24, runs=3)
    the_lab.sandbox.write_inventory(lambda host: the_lab.host_data(host, manifest, {
        "service_profile": "glm-5-mtp", "service_speculation": "adaptive",
        "service_env": {"PYTHONPATH": STANDIN_SERVER_DIR, "FAKE_SGLANG_THROUGHPUT": "crossover=8"}}))
    return the_lab, apply(the_lab)


def test_adaptive_measures_each_level_and_serves_speculation_off_from_where_it_stops_paying(adaptive):
    lab, first = adaptive
    host = lab.hosts[0]
    log = first.stderr
    assert ("benchmarking sglang.service with and without speculation, then with SGLang's adaptive speculation "
            "configured from those numbers (3 runs of 24 tokens, concurrency 1, 4, 16, 64") in log
    record = json.loads(sh(lab, host, f"cat {RECORD}"))
    assert record["policy"] == "adaptive" and record["decision"] == "adaptive" and record["simulated"] is True
    plan = record["adaptive"]
    assert plan["off_from"] == 16, plan["why"]
    assert list(plan["config"]) == ["1", "8", "16"] and plan["config"]["16"]["candidate_steps"] == [0]
    gains = {level["concurrency"]: level["gain"] for level in plan["levels"]}
    assert gains[1] > 0.1 and gains[4] > 0 and gains[64] < gains[16] < 0, gains
    assert set(record["configurations"]) == {"speculation", "baseline", "adaptive"}
    adaptive_levels = {level["concurrency"]: level["tok_s"]["mean"]
                       for level in record["configurations"]["adaptive"]["concurrency"]}
    assert sorted(adaptive_levels) == [1, 4, 16, 64]
    assert "speculation off from 16 running requests, where it stops paying" in log

    unit = sh(lab, host, f"cat {UNIT}")
    path = unit.split("--speculative-adaptive-config ")[1].split()[0]
    assert "--speculative-adaptive \\" in unit and path.startswith("/opt/servestack/releases/")
    assert json.loads(sh(lab, host, f"cat {path}")) == plan["config"]
    info = server_info(lab, host)
    assert info["server_args"]["speculative_adaptive"] is True
    assert info["server_args"]["speculative_adaptive_config"] == path
    assert info["servestack_simulation"]["adaptive_slots"] == {"1": [1, 3, 7], "8": [0, 1, 3], "16": [0]}
    assert sh(lab, host, "cat $(readlink -f /opt/ml-env)/../sglang.service") == unit


def test_a_second_converge_neither_measures_nor_changes_anything(adaptive):
    lab, _ = adaptive
    host = lab.hosts[0]
    before = (sh(lab, host, f"cat {RECORD}"), starts(lab, host), sh(lab, host, f"cat {UNIT}"))
    dry = dry_run(lab)
    assert "will benchmark" not in dry.output
    assert "no change: measured for what the service runs (by deploy at " in dry.output
    second, counts = counted_run(lab, "-y", "--json")   # as `apply`, counting the remote commands
    assert second.returncode == 0, second.stderr[-6000:]
    totals = json.loads(second.stdout)["results"]["totals"]
    assert totals["success"] == 0 and totals["error"] == 0
    assert "benchmarking" not in second.stderr
    # no command more than a host of any other policy: the adaptive config is read in the step's batch
    assert counts["h1"]["commands"] <= MAX_NOOP_COMMANDS and counts["h1"]["transfers"] == 0, counts
    assert (sh(lab, host, f"cat {RECORD}"), starts(lab, host), sh(lab, host, f"cat {UNIT}")) == before
