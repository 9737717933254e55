"""The STAND-IN Hub (sandbox/standins/hub.py, under the artifact server's /hub) as the REAL huggingface_hub
clients of both stacks use it, and files/scripts/stage-weights.py against it: a plan of what is missing,
a download that resumes where a cut one stopped, a corrupted file fetched again, the Hub's refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from facts.weights import WeightsPlan
from sandbox.artifacts import ArtifactServer, Fault
from sandbox.standins import hub
from servestack.scripts import script_text
from tests.unit.sglang_venv import sglang_python

SCRIPT = script_text("stage-weights.py")   # as it is sent
KIMI, DRAFT, GLM = "nvidia/Kimi-K2.5-NVFP4", "lightseekorg/kimi-k2.5-eagle3", "festr2/GLM-5-NVFP4-MTP"
BIG = "model-00001-of-00002.safetensors"
# sglang 0.5.9's resolution installs huggingface_hub 0.36.2 (requests), 0.5.14's 1.21.0 (httpx)
HUB_OF = {"0.5.9": "0.36.2", "0.5.14": "1.21.0"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ArtifactServer(tmp_path_factory.mktemp("artifacts")) as running:
        yield running


@pytest.fixture(autouse=True)
def clean(server):
    server.faults.reset()
    server.httpd.hub.gated = set()


def params(server, directory: Path, repo: str, revision: str | None = None, copy: Path | None = None) -> str:
    revision = revision or hub.commits()[repo]
    target = directory / repo.replace("/", "--") / revision
    return json.dumps({"endpoint": server.url + hub.PREFIX, "models_dir": str(directory),
                       "models": [{"repo": repo, "revision": revision, "dir": str(copy or target),
                                   "record": f"{target}.verified.json", "prestaged": copy is not None}]})


def stage(python, mode: str, text: str, env: dict | None = None) -> subprocess.CompletedProcess:
    flags = ["-I", "-S"] if mode == "plan" else ["-I"]
    return subprocess.run([str(python), *flags, "-c", SCRIPT, mode, text], capture_output=True, text=True,
                          timeout=300, env=env)


def planned(text: str) -> dict:
    """stage-weights.py `plan` run with the host's python, its answer read as facts/weights.py reads it."""
    return WeightsPlan().process(stage(sys.executable, "plan", text).stdout.splitlines())


def requests_for(server, repo: str, name: str) -> list[dict]:
    return [vars(record) for record in server.faults.requests() if record.path.endswith(f"/{repo}/resolve/"
                                                                                        f"{hub.commits()[repo]}/{name}")]


# --- the stand-in's answers ----------------------------------------------------------------------------

def get(url: str, method: str = "GET"):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_standin_answers_model_info_and_files_with_the_headers_the_client_reads(server):
    repo = hub.repositories()[KIMI]
    status, _, body = get(f"{server.url}/hub/api/models/{KIMI}/revision/{repo.commit}?blobs=True")
    info = json.loads(body)
    assert status == 200 and info["sha"] == repo.commit and info["id"] == KIMI
    big = next(sibling for sibling in info["siblings"] if sibling["rfilename"] == BIG)
    assert big["size"] == hub.WEIGHT_SIZES[0] and big["lfs"]["sha256"] == repo.file(BIG).sha256
    config = json.loads(repo.file("config.json").data)
    assert (config["model_type"], config["architectures"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"])
    assert "STAND-IN" in config["_servestack_standin"]
    status, headers, _ = get(f"{server.url}/hub/{KIMI}/resolve/{repo.commit}/{BIG}", "HEAD")
    assert status == 200 and headers["X-Repo-Commit"] == repo.commit
    assert headers["X-Linked-Etag"] == f'"{repo.file(BIG).sha256}"'
    assert headers["X-Linked-Size"] == str(hub.WEIGHT_SIZES[0])
    status, headers, _ = get(f"{server.url}/hub/api/models/{KIMI}/revision/{'0' * 40}")
    assert (status, headers["X-Error-Code"]) == (404, "RevisionNotFound")
    status, headers, _ = get(f"{server.url}/hub/api/models/nobody/nothing/revision/main")
    assert (status, headers["X-Error-Code"]) == (401, "RepoNotFound")
    server.httpd.hub.gated = {KIMI}
    status, headers, _ = get(f"{server.url}/hub/api/models/{KIMI}/revision/main")
    assert (status, headers["X-Error-Code"]) == (401, "GatedRepo")


def test_each_standin_repository_has_a_second_commit_with_other_bytes_and_main_names_the_first(server):
    first, second = hub.repositories()[KIMI], hub.repositories(generation="v2")[KIMI]
    assert hub.commits("v2")[KIMI] == second.commit != first.commit == hub.commits()[KIMI]
    assert second.file(BIG).sha256 != first.file(BIG).sha256 and len(second.file(BIG).data) == hub.WEIGHT_SIZES[0]
    for revision, expected in ((second.commit, second), ("main", first)):
        status, _, body = get(f"{server.url}/hub/api/models/{KIMI}/revision/{revision}?blobs=True")
        info = json.loads(body)
        assert (status, info["sha"]) == (200, expected.commit)
        assert {sibling["rfilename"]: sibling["lfs"]["sha256"] for sibling in info["siblings"] if "lfs" in sibling} \
            == {item.name: item.sha256 for item in expected.files if item.lfs}
    status, headers, body = get(f"{server.url}/hub/{KIMI}/resolve/{second.commit}/{BIG}")
    assert (status, headers["X-Repo-Commit"], body) == (200, second.commit, second.file(BIG).data)
    status, headers, _ = get(f"{server.url}/hub/api/models/{KIMI}/revision/{hub.commits('v2')[DRAFT]}")
    assert (status, headers["X-Error-Code"]) == (404, "RevisionNotFound")   # a commit of another repository


# --- stage-weights.py with the real clients ---------------------------------------------------------------

def test_plan_lists_what_is_missing_and_the_hubs_refusals(server, tmp_path):
    plan = planned(params(server, tmp_path, GLM))
    entry = plan["models"][0]
    assert entry["problem"] is None and entry["files"] == 4 and entry["missing_bytes"] == entry["bytes"] > 13 * 10**6
    assert plan["free_bytes"] > 0
    unknown = planned(params(server, tmp_path, GLM, "0" * 40))
    assert unknown["models"][0]["problem"] == f"the Hub has no revision {'0' * 40} of {GLM} (404 RevisionNotFound)"
    server.httpd.hub.gated = {GLM}
    gated = planned(params(server, tmp_path, GLM))
    assert gated["models"][0]["problem"].startswith(f"the Hub will not give {GLM} without a token it accepts")


@pytest.mark.parametrize("sglang", sorted(HUB_OF))
def test_fetch_stages_verifies_and_records_the_revision(server, tmp_path, sglang):
    python = sglang_python(sglang)
    version = subprocess.run([str(python), "-c", "import huggingface_hub; print(huggingface_hub.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == HUB_OF[sglang]
    out = stage(python, "fetch", params(server, tmp_path, DRAFT))
    assert out.returncode == 0, out.stderr
    target = tmp_path / DRAFT.replace("/", "--") / hub.commits()[DRAFT]
    for item in hub.repositories()[DRAFT].files:
        assert (target / item.name).read_bytes() == item.data
    record = json.loads(Path(f"{target}.verified.json.staged").read_text())   # fetch_command puts it in place
    assert (record["repo"], record["revision"]) == (DRAFT, hub.commits()[DRAFT])
    assert record["files"][BIG] == hub.WEIGHT_SIZES[0] and "token" not in json.dumps(record).lower()
    assert stage(sys.executable, "plan", params(server, tmp_path, DRAFT)).stdout.count('"missing_bytes": 0') == 1


def test_a_cut_download_resumes_on_the_next_run_without_starting_over(server, tmp_path):
    python = sglang_python("0.5.9")   # huggingface_hub 0.36.2: a cut fails the run (requests' ChunkedEncodingError)
    server.faults.add(Fault(path=f"/hub/{KIMI}/resolve/*/{BIG}", kind="cut", after=11 * hub.MIB, times=2))
    cut = stage(python, "fetch", params(server, tmp_path, KIMI))
    assert cut.returncode == 1 and "ChunkedEncodingError" in cut.stderr
    assert not list(tmp_path.rglob("*.verified.json*"))
    resumed = stage(python, "fetch", params(server, tmp_path, KIMI))
    assert resumed.returncode == 0, resumed.stderr
    gets = [(record["range"], record["bytes_sent"]) for record in requests_for(server, KIMI, BIG)
            if record["method"] == "GET"]
    # the first 10 MiB chunk was written before the cut: the second run asks for the rest only
    assert gets == [(None, 11 * hub.MIB), ("bytes=10485760-", hub.WEIGHT_SIZES[0] - 10 * hub.MIB)]
    assert hub.served_bytes([vars(r) for r in server.faults.requests()], KIMI, BIG) < 2 * hub.WEIGHT_SIZES[0]


def test_a_download_streams_bytes_rate_and_eta_per_file_and_in_total_and_says_where_it_resumes(server, tmp_path):
    python = sglang_python("0.5.9")   # huggingface_hub 0.36.2 writes 10 MiB at a time: the big file moves once
    every = {"SS_PROGRESS_EVERY": "0.3", "PATH": "/usr/bin:/bin"}
    server.faults.add(Fault(path=f"/hub/{KIMI}/resolve/*/{BIG}", kind="slow", after=4 * hub.MIB))   # ~3 s
    out = stage(python, "fetch", params(server, tmp_path, KIMI), every)
    assert out.returncode == 0, out.stderr
    label = f"servestack: model weights {KIMI}@{hub.commits()[KIMI][:12]}"
    lines = out.stdout.splitlines()
    rate = r"downloaded [\d.]+ (MB|kB|B) of {} \(\d+%\), [\d.]+ (MB|kB|B)/s, ETA (\d+ s|\?)$"
    per_file = [line for line in lines if re.match(re.escape(f"{label}: {BIG}: ") + rate.format("12.6 MB"), line)]
    total = [line for line in lines if re.match(re.escape(f"{label}: ") + rate.format("13.6 MB"), line)]
    assert per_file and total, out.stdout
    assert any(line.endswith(" s") and not line.endswith(" 0 B/s, ETA ?") for line in per_file), out.stdout
    assert "resuming" not in out.stdout

    server.faults.reset()
    server.faults.add(Fault(path=f"/hub/{GLM}/resolve/*/{BIG}", kind="cut", after=11 * hub.MIB, times=2))
    assert stage(python, "fetch", params(server, tmp_path, GLM), every).returncode == 1   # 10 MiB kept
    resumed = stage(python, "fetch", params(server, tmp_path, GLM), every)
    assert resumed.returncode == 0, resumed.stderr
    # the three small files and the big one's first 10 MiB chunk
    assert f"model weights {GLM}@{hub.commits()[GLM][:12]}: resuming the download at 11.5 MB of 13.6 MB" \
        in resumed.stdout, resumed.stdout


def test_a_corrupted_file_is_fetched_again_and_an_unknown_revision_fails_in_the_hubs_words(server, tmp_path):
    python = sglang_python("0.5.14")
    server.faults.add(Fault(path=f"/hub/{GLM}/resolve/*/{BIG}", kind="corrupt", times=2))
    out = stage(python, "fetch", params(server, tmp_path, GLM))
    assert out.returncode == 0, out.stderr
    assert f"{BIG} differs from the Hub's (sha256 " in out.stdout and "fetching it again" in out.stdout
    assert len([r for r in requests_for(server, GLM, BIG) if r["method"] == "GET"]) == 2
    unknown = stage(python, "fetch", params(server, tmp_path, GLM, "0" * 40))
    assert unknown.returncode == 1
    assert f"servestack: the Hub ({server.url}/hub) has no revision {'0' * 40} of {GLM}: pin a commit it has" \
        in unknown.stderr


def test_a_gated_repository_is_fetched_with_the_token_file_and_refused_without_it(server, tmp_path):
    python = sglang_python("0.5.9")
    server.httpd.hub.gated = {DRAFT}
    refused = stage(python, "fetch", params(server, tmp_path, DRAFT))
    assert refused.returncode == 1
    assert f"servestack: the Hub ({server.url}/hub) will not give {DRAFT}: " in refused.stderr
    token = tmp_path / "hub-token"
    token.write_text("hf_standin_token\n")
    with_token = subprocess.run([str(python), "-I", "-c", SCRIPT, "fetch", params(server, tmp_path, DRAFT)],
                                capture_output=True, text=True, timeout=300,
                                env={"HF_TOKEN_PATH": str(token), "PATH": "/usr/bin:/bin"})
    assert with_token.returncode == 0, with_token.stderr
    assert "hf_standin_token" not in with_token.stdout + with_token.stderr
    record = next(tmp_path.rglob("*.verified.json.staged")).read_text()
    assert "hf_standin_token" not in record


def test_a_prestaged_copy_is_checked_never_written_into_and_refused_naming_what_differs(server, tmp_path):
    python = sglang_python("0.5.14")
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in hub.repositories()[GLM].files:
        (copy / item.name).write_bytes(item.data)
    good = stage(python, "fetch", params(server, tmp_path / "models", GLM, copy=copy))
    assert good.returncode == 0, good.stderr
    assert sorted(path.name for path in copy.iterdir()) == sorted(item.name for item in hub.repositories()[GLM].files)
    record = json.loads(next((tmp_path / "models").rglob("*.verified.json.staged")).read_text())
    assert (record["dir"], record["prestaged"]) == (str(copy), True)
    assert [r for r in server.faults.requests() if "/resolve/" in r.path] == []   # nothing downloaded
    data = bytearray((copy / BIG).read_bytes())
    data[100] ^= 0xFF
    (copy / BIG).write_bytes(bytes(data))
    (copy / "README.md").unlink()
    bad = stage(python, "fetch", params(server, tmp_path / "other", GLM, copy=copy))
    assert bad.returncode == 1
    assert f"the pre-staged copy {copy} of {GLM}@{hub.commits()[GLM][:12]} differs from the Hub's revision (it is " \
           f"left as it is): README.md (missing); {BIG} (sha256 " in bad.stderr
    plan = planned(params(server, tmp_path / "other", GLM, copy=copy))
    assert plan["models"][0]["differs"] == {"README.md": "absent"}   # sizes only: the flipped byte needs a hash
