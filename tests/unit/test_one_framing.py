"""One output framing (docs/design.md "One way to do each thing"): what host code prints for the
controller to read comes in facts/framing.py sections, and only facts/framing.py reads the markers.

The producers folded into it: the verify probes' report (files/scripts/verify-python.py,
verify-http.py, verify-http.sh), the venv tool's result (files/scripts/ml_env.py) and the lock's
lines (files/scripts/lock.sh, tested in test_core_scripts.py). Each is run here and read with
`split`; the controller's modules are searched for the readers they replaced.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from facts.framing import BEGIN, split
from facts.venv import RESULT, tool_result
from facts.verify import REPORT
from servestack.releases import TOOL, encode
from servestack.scripts import SCRIPTS, script_text

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = sorted([*ROOT.glob("facts/*.py"), *ROOT.glob("operations/*.py"), *ROOT.glob("servestack/**/*.py"),
                     ROOT / "deploy.py", ROOT / "rollback.py", ROOT / "config.py"])
# What the readers of the framings folded into sections looked like, and where they were (None: anywhere).
FOLDED_READERS = {
    "the verify probes' report line mark": (None, re.compile(r"servestack-verify|\bMARK\b")),
    "the venv tool's JSON last line": (("facts/venv.py", "operations/venv.py"),
                                       re.compile(r"json\.loads\(stdout\[-1\]\)|json\.loads\(text\)")),
    "lock.sh's `KEY value` lines": (None, re.compile(r'startswith\("(held|stale|activity|lock|lock_alive) "\)|'
                                                     r'key == "lock')),
}


def closed_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]    # closed again when this returns: nothing answers there


def test_only_facts_framing_reads_the_markers():
    markers = re.compile(re.escape(BEGIN.split()[0]) + r"|\bBEGIN\b|\bEND\b")
    readers = [str(path.relative_to(ROOT)) for path in CONTROLLER
               if path != ROOT / "facts" / "framing.py" and markers.search(path.read_text())]
    assert readers == []


@pytest.mark.parametrize("framing", sorted(FOLDED_READERS))
def test_no_controller_module_reads_a_folded_framing(framing):
    where, reader = FOLDED_READERS[framing]
    paths = [ROOT / name for name in where] if where else CONTROLLER
    found = [f"{path.relative_to(ROOT)}:{number}" for path in paths
             for number, line in enumerate(path.read_text().splitlines(), 1) if reader.search(line)]
    assert found == []


def test_the_python_probe_prints_its_report_as_a_section():
    run = subprocess.run([sys.executable, "-I", "-c", script_text("verify-python.py"), json.dumps(["pytest"])],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(split(run.stdout.splitlines())[REPORT].text)
    assert run.returncode == 0 and report["executable"] == sys.executable and report["packages"]["pytest"]


@pytest.mark.parametrize("script", ["verify-http.sh", "verify-http.py"])
def test_the_http_probe_prints_its_report_as_a_section_when_nothing_answers(script):
    url = f"http://127.0.0.1:{closed_port()}"
    if script.endswith(".sh"):
        command = ["bash", "-c", script_text(script), script]
        env = {"URL": url, "PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    else:
        command, env = [sys.executable, "-I", "-c", script_text(script), url, "null"], None
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    report = json.loads(split(run.stdout.splitlines())[REPORT].text)
    assert run.returncode == 0 and report["base"] == url and "health_error" in report, run.stdout


def test_the_venv_tool_prints_its_result_as_a_section(tmp_path):
    sent = [sys.executable, "-I", "-S", "-c", script_text(TOOL), "backups", encode({"state_dir": str(tmp_path)})]
    run = subprocess.run(sent, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and list(split(run.stdout.splitlines())) == [RESULT]
    assert tool_result(run.stdout.splitlines()) == {"backups": []}
    assert (SCRIPTS / "ml_env.py").read_text().count("@@servestack") == 2   # its `section`, nowhere else
