"""The real-wheel artifact set (sandbox/standins/realwheels.py) and the artifact server's byte counts, with which
tests/integration/test_real_release.py proves that a rollback downloads nothing; and the deploy's judgement of
torch's CUDA build on the current stack, whose PyPI torch carries no +cu130 label."""

from __future__ import annotations

import http.client
import json

import pytest

from operations import venv as venv_step
from sandbox.artifacts import ArtifactControl, ArtifactServer
from sandbox.standins import realwheels
from sandbox.standins.index import TIMES_FILE
from sandbox.standins.wheels import build_wheel, standin_wheel
from servestack.manifest import load_manifest
from servestack.releases import format_diff, package_diff, release_plan
from servestack.settings import settings_from_data

CURRENT = load_manifest().stacks["sglang-0.5.14"]
PAYLOAD = bytes(range(256)) * 40   # 10240 bytes


def get(server: ArtifactServer, path: str, headers: dict | None = None, method: str = "GET") -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_the_server_counts_the_bytes_it_sends_of_each_file(tmp_path):
    (tmp_path / "simple" / "pkg").mkdir(parents=True)
    (tmp_path / "simple" / "pkg" / "pkg-1.0-py3-none-any.whl").write_bytes(PAYLOAD)
    (tmp_path / "simple" / "pkg" / "index.html").write_text("<html>pkg</html>\n")
    wheel = "/simple/pkg/pkg-1.0-py3-none-any.whl"
    with ArtifactServer(tmp_path) as server:
        assert get(server, wheel) == 200
        assert get(server, wheel, {"Range": "bytes=-100"}) == 206     # uv reading a wheel's METADATA
        assert get(server, wheel, method="HEAD") == 200
        assert get(server, "/simple/pkg/") == 200
        assert server.faults.served_bytes() == {wheel: len(PAYLOAD) + 100, "/simple/pkg/": 0}
        assert ArtifactControl(server.url).served_bytes() == server.faults.served_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty sandbox cache, a resolution of two packages and a PyPI that counts what is fetched from it."""
    monkeypatch.setenv("SERVESTACK_SANDBOX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(realwheels.closure, "resolve", lambda stack: {"sglang": "0.5.14", "tqdm": "4.68.3"})
    fetched: list[list[str]] = []

    def fetch_wheels(requirements):
        fetched.append(requirements)
        return [build_wheel(standin_wheel(*requirement.split("==")), tmp_path / "pypi")
                for requirement in requirements]

    monkeypatch.setattr(realwheels, "fetch_wheels", fetch_wheels)
    return fetched


def test_the_real_index_serves_every_locked_file_and_uv_before_the_stacks_bound(cache):
    index = realwheels.real_index(CURRENT)
    uv = f"uv=={load_manifest().uv['version']}"
    assert cache == [["sglang==0.5.14", "tqdm==4.68.3"], [uv]]
    assert sorted(path.parent.name for path in index.glob("*/*.whl")) == ["sglang", "tqdm", "uv"]
    served = realwheels.served_files(index)
    assert served == {path.name: path.stat().st_size for path in index.glob("*/*.whl")}
    # uploaded an hour before the stack's bound, so the hosts' bounded resolution takes them
    times = set(json.loads((index / TIMES_FILE).read_text()).values())
    assert times == {"2026-06-26T23:00:00Z"} and CURRENT.exclude_newer == "2026-06-27T00:00:00Z"
    assert 'data-upload-time="2026-06-26T23:00:00Z"' in (index / "tqdm" / "index.html").read_text()


def test_the_real_index_is_laid_out_once_and_keyed_by_what_decides_it(cache, monkeypatch):
    index = realwheels.real_index(CURRENT)
    assert realwheels.real_index(CURRENT) == index and len(cache) == 2   # kept: nothing fetched again
    monkeypatch.setattr(realwheels.closure, "resolve", lambda stack: {"sglang": "0.5.14", "tqdm": "4.68.4"})
    other = realwheels.real_index(CURRENT)
    assert other != index and cache[-2] == ["sglang==0.5.14", "tqdm==4.68.4"]


def test_a_stack_with_files_pypi_does_not_host_is_refused(monkeypatch):
    stack = load_manifest().stacks["sglang-0.5.9"]
    monkeypatch.setattr(realwheels.closure, "resolve",
                        lambda _: {"sglang": "0.5.9", "sgl-kernel": "sgl_kernel-0.3.21+cu130-cp310-abi3.whl"})
    with pytest.raises(RuntimeError, match=r"stack sglang-0\.5\.9 cannot be served from real wheels: PyPI does "
                                           r"not host .*sgl-kernel.*torch"):
        realwheels.real_requirements(stack)


def test_a_hand_made_env_with_torch_2_11_0_cu128_is_replaced_by_the_current_stacks_release():
    """PyPI's torch 2.11.0 is pinned without a label; an installed CUDA 12.8 build of the same version is
    still replaced (the release is decided by its id, never by the installed version) and then judged by
    torch.version.cuda (files/scripts/check_release.py; tests/unit/test_check_release.py)."""
    release = release_plan(settings_from_data("gpu-1", {"service_profile": "glm-5-mtp"}), "x86_64", "3.11.2")
    assert (release.expect["packages"]["torch"], release.expect["torch_cuda"]) == ("2.11.0", "13.0")
    hand_made = {"venv_path": {"kind": "venv", "release": None}}
    assert venv_step._environment_changes(hand_made, release.id)
    assert not venv_step._environment_changes({"venv_path": {"kind": "link", "release": release.id}}, release.id)
    diff = package_diff({"torch": "2.11.0+cu128"}, {"torch": "2.11.0"})
    assert "~ torch 2.11.0+cu128 -> 2.11.0" in format_diff(diff, "a", "b", partial=False)

