"""One output framing (docs/design.md "One way to do each thing"): what host code prints for the
controller to read comes in facts/framing.py sections, and only facts/framing.py reads the markers.

The producers folded into it: the verify probes' report (files/scripts/verify-python.py,
verify-http.py, verify-http.sh), the venv tool's result (files/scripts/ml_env.py), the lock's
lines (files/scripts/lock.sh, tested in test_core_scripts.py), the benchmark client's measurement
(files/scripts/bench-client.py, against the stand-in server here), the patch check's answer
(files/scripts/patch-check.sh and servestack/patchlib.py), stage-weights.py's plan and the pre-start
check's result (files/scripts/sglang-prestart.py). Each is run here and read with `split`; the
controller's modules (and the pre-start check's tests, its only reader) are searched for the readers
they replaced.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from facts.framing import BEGIN, Section, printed, split
from facts.patches import remote_command
from facts.venv import RESULT, tool_result
from facts.verify import REPORT
from facts.weights import PLAN, WeightsPlan
from operations import speculation
from sandbox.standins import fake_sglang_server as standin
from servestack import hostcode, patchlib
from servestack.checks.parse import patch_report
from servestack.patchsets import PATCH_ROOT
from servestack.releases import TOOL, encode
from servestack.scripts import SCRIPTS, python_script_command, script_text

ROOT = Path(__file__).resolve().parents[2]
# the Python tools sent to a host print sections with servestack/hostcode.py's `section`, which they bring when sent
HOSTCODE = ROOT / "servestack" / "hostcode.py"
HOST_TOOLS = [HOSTCODE]
PYTHON_TOOLS = sorted(SCRIPTS.glob("*.py")) + [ROOT / "servestack" / "patchlib.py"]
CONTROLLER = sorted({*ROOT.glob("facts/*.py"), *ROOT.glob("operations/*.py"), *ROOT.glob("servestack/**/*.py"),
                     ROOT / "deploy.py", ROOT / "rollback.py", ROOT / "config.py"} - set(HOST_TOOLS))
# What the readers of the framings folded into sections looked like, and where they were (None: anywhere).
FOLDED_READERS = {
    "the verify probes' report line mark": (None, re.compile(r"servestack-verify|\bMARK\b")),
    "the venv tool's JSON last line": (("facts/venv.py", "operations/venv.py"),
                                       re.compile(r"json\.loads\(stdout\[-1\]\)|json\.loads\(text\)")),
    "lock.sh's `KEY value` lines": (None, re.compile(r'startswith\("(held|stale|activity|lock|lock_alive) "\)|'
                                                     r'key == "lock')),
    "the benchmark client's JSON line": (("operations/speculation.py",), re.compile(r'startswith\("\{"\)')),
    "the patch check's JSON last line": (("servestack/checks/parse.py", "facts/patches.py"),
                                         re.compile(r'parse_json_object\(lines\[-1\]\)|output\[0\] == SUMS_HOLD|'
                                                    r'json\.loads\("\\n"\.join\(output\)\)')),
    "stage-weights.py's plan JSON last line": (("facts/weights.py",), re.compile(r"json\.loads\(output\[-1\]\)")),
    "the pre-start check's JSON last line": (("tests/unit/test_prestart.py",),
                                             re.compile(r"json\.loads\(out\.stdout\.splitlines\(\)\[-1\]\)")),
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


def test_the_python_host_tools_print_sections_only_through_the_shared_host_code():
    """One printer of sections in host-side Python: servestack/hostcode.py's, which each tool brings when sent."""
    assert {path.name: path.read_text().count("@@servestack") for path in PYTHON_TOOLS} == \
        dict.fromkeys((path.name for path in PYTHON_TOOLS), 0)
    assert HOSTCODE.read_text().count("@@servestack") == 2
    assert hostcode.section_text("n", "a\n\nb").splitlines() == list(printed("n", "a\n\nb"))


def test_the_benchmark_client_prints_its_measurement_as_a_section():
    argv = ["--model-path", "m", "--host", "127.0.0.1", "--port", "0"]
    server = standin.FakeServer(standin.parse(argv), "ok", 0, argv, standin.Throughput.parse("win,jitter=0"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    params = {"url": f"http://127.0.0.1:{server.server_address[1]}", "prompt": "p", "max_new_tokens": 4, "runs": 1,
              "warmup": 0, "concurrency": [1], "request_timeout_s": 30}
    try:
        run = subprocess.run(["bash", "-c", speculation.client_command(sys.executable, params)],
                             capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    sections = split(run.stdout.splitlines())
    assert run.returncode == 0 and list(sections) == [speculation.RESULT], run.stderr
    assert json.loads(sections[speculation.RESULT].text)["runs"][0]["output_tokens"] == 4


@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/bin/python"])
def test_the_patch_check_prints_its_answer_as_a_section(python):
    """Here the engine runs in a python without sglang; without a python patch-check.sh answers itself."""
    run = subprocess.run(["bash", "-c", remote_command(python, "check", "sglang", None, PATCH_ROOT)],
                         capture_output=True, text=True, timeout=120)
    lines = tuple(run.stdout.splitlines())
    assert run.returncode == 0 and list(split(lines)) == [patchlib.RESULT], run.stderr
    found = patch_report(Section(0, lines))
    assert found is not None and (found["python"], found["installed"]) == (python, False)


def test_stage_weights_prints_its_plan_as_a_section(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    params = json.dumps({"endpoint": endpoint, "models_dir": str(tmp_path),
                         "models": [{"repo": "org/name", "revision": "0" * 40, "dir": str(tmp_path / "m"),
                                     "record": str(tmp_path / "m.verified.json"), "prestaged": False}]})
    run = subprocess.run(["bash", "-c", WeightsPlan().command(sys.executable, params)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and list(split(run.stdout.splitlines())) == [PLAN], run.stderr
    plan = WeightsPlan().process(run.stdout.splitlines())
    assert plan["free_bytes"] > 0 and plan["models"][0]["problem"].startswith(f"cannot read org/name's file list from "
                                                                            f"{endpoint}")


def test_the_prestart_check_prints_its_result_as_a_section_and_its_refusal_on_stderr():
    params = json.dumps({"release": "r-0123456789ab", "profile": "p", "argv": [], "env": {}})
    run = subprocess.run(["bash", "-c", python_script_command(sys.executable, "sglang-prestart.py", params)],
                         capture_output=True, text=True, timeout=120)
    result = json.loads(split(run.stdout.splitlines())["result"].text)   # its section `result`
    assert run.returncode == 1 and result["refused"] == "ModuleNotFoundError: No module named 'sglang'"
    assert run.stderr.startswith("servestack: SGLang refuses release r-0123456789ab (profile p): ")
