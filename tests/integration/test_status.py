"""`servestack status` on dressed sandbox hosts over SSH, as users run it: before any deploy, then on a
converged host and on a rolled-back one; it changes nothing on either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_run import apply

ROOT = Path(__file__).resolve().parents[2]
RELEASES = "/opt/servestack/releases"
pytestmark = pytest.mark.integration


def servestack_status(lab, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "servestack.cli", "status", str(lab.inventory_path), *args]
    return subprocess.run(lab.controller_argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=300)


def status_json(lab) -> dict:
    run = servestack_status(lab, "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout)["hosts"]


def sh(lab, host, command: str) -> str:
    return lab.exec(host, command, check=True).stdout.strip()


def test_status_on_a_converged_and_a_rolled_back_host(lab):
    the_lab = lab(2)
    converged, rolled_back = the_lab.hosts
    before = status_json(the_lab)
    for name in (converged.name, rolled_back.name):
        host = before[name]
        assert host["reachable"] and host["active"]["kind"] == "venv" and host["active"]["release"] is None
        assert host["releases"] == [] and host["rollback"]["target"] is None
        assert host["rollback"]["why"].startswith("nothing to roll back to")
        assert host["last_deploy"] is None and host["service"]["active"] != "active"
        assert host["speculation"] == "n/a"

    apply(the_lab)
    apply(the_lab, "rollback.py", "--limit", rolled_back.name)
    release = sh(the_lab, converged, "readlink /opt/ml-env").removeprefix(f"{RELEASES}/").removesuffix("/venv")
    adopted = sh(the_lab, rolled_back, "readlink /opt/ml-env").removeprefix(f"{RELEASES}/").removesuffix("/venv")
    assert release.startswith("r-") and adopted.startswith("adopted-")

    fingerprints = the_lab.fingerprints()
    table = servestack_status(the_lab)
    hosts = status_json(the_lab)
    assert the_lab.fingerprints() == fingerprints, "status changed a host"
    print(f"\n--- servestack status (table) ---\n{table.stdout}{table.stderr}")
    print(f"--- servestack status --json ---\n{json.dumps({'hosts': hosts}, indent=2)}")

    one = hosts[converged.name]
    assert one["active"]["release"] == release and one["active"]["activated_by"] == "deploy"
    assert one["active"]["age_s"] is not None and one["active"]["created"]
    assert [kept["id"] for kept in one["releases"] if kept["rollback_target"]] == [one["rollback"]["target"]]
    assert one["rollback"]["target"].startswith("adopted-")
    assert one["rollback"]["why"] == f"the release active before the deploy of {release}"
    assert one["last_deploy"]["release"] == release
    assert one["last_run"] == {"run_id": "not recorded", "result": "not recorded", "source": None}
    assert one["service"]["active"] == "active" and one["service"]["sub"] == "running"
    assert one["service"]["since"] and one["service"]["health"] == 200

    two = hosts[rolled_back.name]
    assert two["active"]["release"] == adopted and two["active"]["activated_by"] == "rollback"
    assert two["rollback"]["target"] == adopted  # a second rollback picks the same release: changes nothing
    assert "a rollback changes nothing" in two["rollback"]["why"]
    assert two["last_deploy"]["release"] == two["last_activation"]["previous"] != adopted
    assert {kept["id"] for kept in two["releases"]} == {adopted, two["last_deploy"]["release"]}
    assert two["last_activation"]["by"] == "rollback"
    assert two["service"]["active"] == "active" and two["service"]["health"] == 200

    assert table.returncode == 0, table.stderr[-3000:]
    text = table.stdout
    assert "servestack status (nothing was changed)" in text and "…" not in text
    assert converged.name in text and rolled_back.name in text
    assert f"{release} <- active" in text and f"{adopted} <- active, rollback" in text
    assert f"rollback -> {adopted}" in text and "run: not recorded" in text
    assert text.count("/health: 200") == 2 and "active (running) since" in text
