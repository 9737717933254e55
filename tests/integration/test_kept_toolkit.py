"""The kept CUDA 12.8 toolkit's fingerprint on a sandbox host (docs/operating.md: "The kept 12.8 toolkit's fingerprint
... recorded first and checked after"): the toolkit step records it, `servestack verify`'s kept_toolkits
check compares. A file rewritten with its size unchanged fails the check; a record written before
fingerprints had the files' modification times passes, and the next converge adds them once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree

import pytest

from toolkit_lab import KEPT, REPO

pytestmark = pytest.mark.integration

DEPLOY = "tests/integration/deploys/toolkit.py"
RECORD = "/var/lib/servestack/toolkits.json"
# Every byte of a file inverted in place: the same size, other content, a new modification time.
INVERT = ("python3 -c 'import sys; f = open(sys.argv[1], \"r+b\"); data = f.read(); f.seek(0); "
          "f.write(bytes(byte ^ 255 for byte in data))'")


@pytest.fixture(scope="module")
def tk(toolkit_lab):
    with toolkit_lab("kept", "kept", hosts=1) as lab:
        converge = lab.pyinfra(DEPLOY)
        assert converge.returncode == 0, converge.output[-6000:]
        yield lab


def kept_toolkits_check(tk, tmp_path) -> tuple[str, str]:
    """(status, message) of the kept_toolkits check of `servestack verify INVENTORY --junit F`."""
    junit = tmp_path / f"verify-{time.monotonic_ns()}.xml"
    argv = [sys.executable, "-m", "servestack.cli", "verify", str(tk.lab.inventory_path), "--junit", str(junit)]
    run = subprocess.run(tk.lab.controller_argv(argv), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert junit.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        if properties.get("servestack_check") == "kept_toolkits":
            failure = case.find("failure")
            return ("failed", failure.get("message", "")) if failure is not None else ("passed", "")
    raise AssertionError(f"no kept_toolkits check in {junit}: {run.stdout[-3000:]}")


def test_a_kept_toolkit_file_rewritten_with_its_size_unchanged_fails_verify(tk, tmp_path):
    host = tk.hosts[0]
    assert kept_toolkits_check(tk, tmp_path) == ("passed", "")
    listing = tk.tree(host)
    path = tk.sh(host, f"find {KEPT}/ -type f -name '*.h' | sort | head -n 1").strip()
    content, mtime = tk.sh(host, f"sha256sum {path}").split()[0], tk.sh(host, f"stat -c %.9Y {path}").strip()
    tk.sh(host, f"{INVERT} {path}")
    assert tk.tree(host) == listing                              # the same names, types, sizes and links
    assert tk.sh(host, f"sha256sum {path}").split()[0] != content
    status, message = kept_toolkits_check(tk, tmp_path)
    assert status == "failed", message
    assert f"{KEPT} changed since it was recorded: a file was rewritten with its size unchanged" in message, message

    tk.sh(host, f"{INVERT} {path} && touch -d @{mtime} {path}")  # its bytes and their time put back
    assert tk.sh(host, f"sha256sum {path}").split()[0] == content
    assert kept_toolkits_check(tk, tmp_path) == ("passed", "")


def test_a_record_made_before_fingerprints_had_times_passes_verify_and_gets_them_once(tk, tmp_path):
    host = tk.hosts[0]
    record = json.loads(tk.sh(host, f"cat {RECORD}"))
    timed = record["toolkits"][KEPT].pop("mtimes_sha256")
    tk.put_file(host, RECORD, json.dumps(record, indent=1, sort_keys=True).encode())   # as servestack wrote it before
    assert "mtimes_sha256" not in tk.sh(host, f"cat {RECORD}")
    assert kept_toolkits_check(tk, tmp_path) == ("passed", "")
    dry = tk.pyinfra(DEPLOY, dry=True)
    assert (f"add the files' modification times to the fingerprint of {KEPT} in {RECORD}"
            in "\n".join(dry.host_lines("h1"))), dry.output[-3000:]
    completing = tk.pyinfra(DEPLOY)
    assert completing.changed("h1") == ["CUDA toolkit | CUDA 13.0.1 at /usr/local/cuda-13.0"], completing.output[-3000:]
    assert json.loads(tk.sh(host, f"cat {RECORD}"))["toolkits"][KEPT]["mtimes_sha256"] == timed
    assert tk.pyinfra(DEPLOY).results["totals"]["success"] == 0
