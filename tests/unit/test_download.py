"""Downloads of the runfile, against the sandbox artifact server on loopback (faults: cut, corrupt):
the control machine's fetch_runfile, and the host-side curl command run here into a temp dir."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from operations.toolkit import download_command
from sandbox.artifacts import ArtifactServer, Fault
from servestack import download
from servestack.download import DownloadError, fetch_runfile
from servestack.manifest import Runfile
from servestack.paths import RunfileSource

SIZE = 3 * 1024 * 1024 + 123


@pytest.fixture
def served(tmp_path):
    """An artifact server on 127.0.0.1 serving one 3 MB file; yields (server, Runfile)."""
    root = tmp_path / "served"
    (root / "cuda").mkdir(parents=True)
    data = hashlib.sha256(b"seed").digest() * (SIZE // 32 + 1)
    data = data[:SIZE]
    (root / "cuda" / "x.run").write_bytes(data)
    with ArtifactServer(root) as server:
        runfile = Runfile("x.run", f"{server.url}/cuda/x.run", SIZE, hashlib.md5(data).hexdigest(),
                          hashlib.sha256(data).hexdigest())
        yield server, runfile
    download._VERIFIED.clear()


def gets(server) -> list:
    return [record for record in server.faults.requests() if record.method == "GET"]


def test_download_verifies_and_caches(served, tmp_path):
    server, runfile = served
    path = fetch_runfile(runfile, tmp_path / "cache", show_progress=False)
    assert path == tmp_path / "cache" / "x.run"
    assert path.stat().st_size == SIZE and not (tmp_path / "cache" / "x.run.part").exists()
    assert len(gets(server)) == 1
    download._VERIFIED.clear()          # a new process: the cached copy is re-verified, not re-downloaded
    assert fetch_runfile(runfile, tmp_path / "cache", show_progress=False) == path
    assert len(gets(server)) == 1


def test_cut_download_resumes_with_range(served, tmp_path, monkeypatch):
    server, runfile = served
    monkeypatch.setattr(download.time, "sleep", lambda seconds: None)
    server.faults.add(Fault("/cuda/x.run", "cut", after=1_000_000, times=1))
    path = fetch_runfile(runfile, tmp_path / "cache", show_progress=False)
    assert path.stat().st_size == SIZE
    requests = gets(server)
    assert len(requests) == 2
    assert requests[1].range == "bytes=1000000-"
    assert sum(record.bytes_sent for record in requests) == SIZE      # nothing sent twice


def test_corrupted_download_is_refused_and_moved_aside(served, tmp_path):
    server, runfile = served
    server.faults.add(Fault("/cuda/x.run", "corrupt", length=8))
    with pytest.raises(DownloadError, match="fails verification .md5"):
        fetch_runfile(runfile, tmp_path / "cache", show_progress=False)
    names = sorted(os.listdir(tmp_path / "cache"))
    assert len(names) == 1 and names[0].startswith("x.run.part.rejected-")


def test_bad_cached_copy_is_moved_aside_then_downloaded(served, tmp_path):
    server, runfile = served
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "x.run").write_bytes(b"not the runfile")
    path = fetch_runfile(runfile, cache, show_progress=False)
    assert path.read_bytes()[:32] == hashlib.sha256(b"seed").digest()
    assert any(name.startswith("x.run.rejected-") for name in os.listdir(cache))


def test_server_error_stops_with_a_clear_message(served, tmp_path, monkeypatch):
    server, runfile = served
    monkeypatch.setattr(download.time, "sleep", lambda seconds: None)
    server.faults.add(Fault("/cuda/x.run", "status", status=503))
    with pytest.raises(DownloadError, match="HTTP 503"):
        fetch_runfile(runfile, tmp_path / "cache", show_progress=False)


def test_file_url_is_copied_and_verified(served, tmp_path):
    _, runfile = served
    local = Runfile(runfile.file, f"file://{tmp_path}/served/cuda/x.run", runfile.size, runfile.md5, runfile.sha256)
    assert fetch_runfile(local, tmp_path / "cache", show_progress=False).stat().st_size == SIZE


def test_host_download_command_resumes_a_cut_download(served, tmp_path):
    server, runfile = served
    server.faults.add(Fault("/cuda/x.run", "cut", after=500_000, times=2))
    part = tmp_path / "cache" / "x.run.part"
    source = RunfileSource(runfile, "host", str(tmp_path / "cache" / "x.run"), str(part))
    result = subprocess.run(["sh", "-c", download_command(source)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert part.stat().st_size == SIZE
    assert hashlib.sha256(part.read_bytes()).hexdigest() == runfile.sha256
    ranges = [record.range for record in gets(server)]
    assert ranges == [None, "bytes=500000-", "bytes=1000000-"]


def test_host_download_command_gives_up_keeping_the_partial_file(served, tmp_path):
    server, runfile = served
    server.faults.add(Fault("/cuda/x.run", "cut", after=100_000))
    part = tmp_path / "cache" / "x.run.part"
    source = RunfileSource(runfile, "host", str(tmp_path / "cache" / "x.run"), str(part))
    result = subprocess.run(["sh", "-c", download_command(source, attempts=2)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "resumed by the next run" in result.stderr
    assert part.stat().st_size == 200_000
