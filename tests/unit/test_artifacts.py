"""The artifact server serves files like a download mirror (Range, resume) and breaks them on request."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.artifacts import ArtifactControl, ArtifactServer, Fault, parse_range
from sandbox.standins.index import write_simple_index
from sandbox.standins.wheels import build_wheel, standin_wheel
from tests.unit.standin_closure import build_with_requirements

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = bytes(range(256)) * 1200  # 307200 bytes
FILE = "/mirror/cuda/cuda_13.0.1_580.82.07_linux.run"


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "root" / FILE.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD)
    (tmp_path / "root" / "simple" / "pkg").mkdir(parents=True)
    (tmp_path / "root" / "simple" / "pkg" / "index.html").write_text("<html>pkg</html>\n")
    return tmp_path / "root"


@pytest.fixture
def server(root, tmp_path):
    with ArtifactServer(root, log_path=tmp_path / "requests.log") as server:
        yield server


def get(server: ArtifactServer, path: str, headers: dict | None = None, method: str = "GET"):
    """(status, headers, body) of one request on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_serves_whole_files_with_length_and_ranges_advertised(server):
    status, headers, body = get(server, FILE)
    assert (status, body) == (200, PAYLOAD)
    assert headers["Content-Length"] == str(len(PAYLOAD)) and headers["Accept-Ranges"] == "bytes"
    status, headers, body = get(server, FILE, method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, str(len(PAYLOAD)), b"")


@pytest.mark.parametrize("header, first, last", [
    ("bytes=100-199", 100, 199), ("bytes=307000-", 307000, 307199), ("bytes=-50", 307150, 307199),
    ("bytes=307100-999999", 307100, 307199),
])
def test_range_requests_get_206(server, header, first, last):
    status, headers, body = get(server, FILE, {"Range": header})
    assert status == 206 and body == PAYLOAD[first:last + 1]
    assert headers["Content-Range"] == f"bytes {first}-{last}/{len(PAYLOAD)}"
    assert headers["Content-Length"] == str(last - first + 1)


def test_range_past_the_end_is_416(server):
    status, headers, _ = get(server, FILE, {"Range": f"bytes={len(PAYLOAD)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(PAYLOAD)}"


def test_parse_range_ignores_what_it_cannot_serve():
    assert parse_range(None, 10) is None
    assert parse_range("bytes=0-1,5-6", 10) is None
    assert parse_range("items=0-1", 10) is None
    assert parse_range("bytes=5-2", 10) is None
    assert parse_range("bytes=-0", 10) == "unsatisfiable"


def test_cut_response_then_resume_with_range(server):
    server.faults.add(Fault(FILE, "cut", after=100_000, times=1))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", FILE)
    response = connection.getresponse()
    with pytest.raises(http.client.IncompleteRead) as cut:
        response.read()
    connection.close()
    partial = cut.value.partial
    assert len(partial) == 100_000 and partial == PAYLOAD[:100_000]
    status, _, rest = get(server, FILE, {"Range": f"bytes={len(partial)}-"})
    assert status == 206 and partial + rest == PAYLOAD


@pytest.mark.skipif(not shutil.which("curl"), reason="curl not installed")
def test_curl_resumes_a_cut_download(server, tmp_path):
    """What a host does: curl fails on the short body (exit 18), `curl -C -` completes it."""
    server.faults.add(Fault(FILE, "cut", after=65_536, times=1))
    out = tmp_path / "download.run"
    first = subprocess.run(["curl", "-sS", "-f", "-o", out, server.url + FILE], capture_output=True)
    assert first.returncode == 18 and out.stat().st_size == 65_536
    again = subprocess.run(["curl", "-sS", "-f", "-C", "-", "-o", out, server.url + FILE], capture_output=True)
    assert again.returncode == 0 and out.read_bytes() == PAYLOAD
    ranges = [record.range for record in server.faults.requests()]
    assert ranges == [None, "bytes=65536-"]


def test_corruption_keeps_the_length_and_changes_the_checksum(server):
    server.faults.add(Fault(FILE, "corrupt", times=1))
    status, headers, body = get(server, FILE)
    assert status == 200 and len(body) == len(PAYLOAD)
    assert hashlib.sha256(body).digest() != hashlib.sha256(PAYLOAD).digest()
    middle = len(PAYLOAD) // 2
    assert body[:middle] == PAYLOAD[:middle] and body[middle + 16:] == PAYLOAD[middle + 16:]
    assert get(server, FILE)[2] == PAYLOAD


def test_corruption_applies_to_ranges_by_absolute_offset(server):
    server.faults.add(Fault(FILE, "corrupt", at=1000, length=4))
    _, _, body = get(server, FILE, {"Range": "bytes=998-1005"})
    assert body[:2] == PAYLOAD[998:1000] and body[6:] == PAYLOAD[1004:1006]
    assert bytes(b ^ 0xFF for b in body[2:6]) == PAYLOAD[1000:1004]


def test_status_fault_for_a_glob_only(server):
    server.faults.add(Fault("/mirror/*.run", "status", status=500))
    assert get(server, FILE)[0] == 500
    assert get(server, FILE)[0] == 500
    assert get(server, "/simple/pkg/")[0] == 200


def test_counts_and_records_per_path_and_client(server, tmp_path):
    get(server, FILE)
    get(server, FILE, {"Range": "bytes=0-9"})
    get(server, "/simple/pkg/")
    get(server, "/nothing-here")
    assert server.faults.counts() == {FILE: 2, "/simple/pkg/": 1, "/nothing-here": 1}
    records = server.faults.requests()
    assert [(r.status, r.bytes_sent, r.client) for r in records[:2]] == [(200, len(PAYLOAD), "127.0.0.1"),
                                                                          (206, 10, "127.0.0.1")]
    assert records[3].status == 404
    log = (tmp_path / "requests.log").read_text()
    assert f'"GET {FILE} HTTP/1.1" 200' in log and '"GET /nothing-here HTTP/1.1" 404' in log


def test_directories_serve_their_index_and_redirect_without_slash(server):
    assert get(server, "/simple/pkg/")[2] == b"<html>pkg</html>\n"
    status, headers, _ = get(server, "/simple/pkg")
    assert status == 301 and headers["Location"] == "/simple/pkg/"


def test_control_endpoint_over_http(server):
    control = ArtifactControl(server.url)
    control.add_fault(FILE, "status", status=503, times=1)
    assert get(server, FILE)[0] == 503
    assert get(server, FILE)[0] == 200
    assert control.counts() == {FILE: 2} and control.counts(status=503) == {FILE: 1}
    assert [record["status"] for record in control.requests()] == [503, 200]
    control.reset()
    assert control.counts() == {}
    with pytest.raises(Exception, match="400"):
        control.add_fault(FILE, "explode")


def test_uv_installs_through_the_server_once_per_file(server, root, tmp_path):
    """torchvision +cu130 and everything its stand-in requires (torch +cu130, then all torch requires:
    the nvidia libraries, triton, filelock, sympy, ...; numpy and pillow) come through the server,
    each page and each file fetched once."""
    built: dict = {}
    wheels = build_with_requirements("torch", "2.9.1+cu130", tmp_path / "wheels", built)
    wheels += [build_wheel(standin_wheel("torchvision", "0.24.1+cu130"), tmp_path / "wheels")]
    wheels += build_with_requirements("numpy", "2.2.6", tmp_path / "wheels", built)
    wheels += build_with_requirements("pillow", "11.3.0", tmp_path / "wheels", built)
    write_simple_index(root / "whl" / "cu130", wheels)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("UV_", "PIP_"))}
    env.update(UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never")
    subprocess.run(["uv", "venv", "-q", "-p", "/usr/bin/python3", tmp_path / "venv"], env=env, check=True)
    result = subprocess.run(["uv", "pip", "install", "--python", tmp_path / "venv/bin/python",
                             "--index-url", f"{server.url}/whl/cu130", "torchvision==0.24.1+cu130"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    projects = {wheel.name: wheel.name.split("-")[0].replace("_", "-") for wheel in wheels}
    whole = {f"/whl/cu130/{project}/{name}": 1 for name, project in projects.items()}
    pages = {f"/whl/cu130/{project}/": 1 for project in projects.values()}
    assert {"/whl/cu130/numpy/", "/whl/cu130/nvidia-cudnn-cu13/", "/whl/cu130/pillow/", "/whl/cu130/torch/",
            "/whl/cu130/torchvision/", "/whl/cu130/triton/", "/whl/cu130/sympy/"} <= set(pages)
    assert server.faults.counts(status=200) == {**pages, **whole}
    ranged = [record for record in server.faults.requests() if record.status == 206]
    assert {record.path for record in ranged} <= set(whole)  # uv reads wheel metadata with a Range first


def test_runs_as_a_module_and_stops_on_sigterm(root, tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "sandbox.artifacts", "--root", root,
                                "--bind", "127.0.0.1", "--port", "0", "--log", tmp_path / "cli.log"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r":(\d+)$", process.stdout.readline().strip())[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", FILE, headers={"Range": "bytes=0-3"})
        assert connection.getresponse().read() == PAYLOAD[:4]
        connection.close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    assert "GET " + FILE in (tmp_path / "cli.log").read_text()
