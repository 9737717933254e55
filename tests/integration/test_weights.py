"""The weights step on sandbox hosts: the profile's model and draft staged from the STAND-IN Hub
(sandbox/standins/hub.py, served by the lab's artifact server under /hub) by the release's real
huggingface_hub, before the service step; the unit names the staged directories; a converged host
changes nothing and fetches nothing; a cut download resumes on the next run; a controller killed during
the download leaves it going on on the host, under the lock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from pyinfra_run import apply, dry_run, run_pyinfra
from sandbox.lab import ARTIFACT_PORT
from test_interrupted import interrupt, start, wait_for_step, wait_until_idle
from sandbox.standins import hub
from servestack.manifest import PROJECT_ROOT

pytestmark = pytest.mark.integration

KIMI, DRAFT = "nvidia/Kimi-K2.5-NVFP4", "lightseekorg/kimi-k2.5-eagle3"
BIG = "model-00001-of-00002.safetensors"          # 12 MiB: more than huggingface_hub 0.36.2's 10 MiB chunk
MODELS_DIR = "/var/lib/servestack/models"
UNIT = "/etc/systemd/system/sglang.service"


def control(lab, method: str, *args, **kwargs):
    """A call of the lab's artifact server's control client (sandbox.artifacts.ArtifactControl)."""
    code = (f"import json; from sandbox.artifacts import ArtifactControl as C; "
            f"print(json.dumps(C('http://127.0.0.1:{ARTIFACT_PORT}').{method}(*{args!r}, **{kwargs!r})))")
    out = subprocess.run(lab.controller_argv([sys.executable, "-c", code]), cwd=PROJECT_ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def staged_dir(repo: str) -> str:
    return f"{MODELS_DIR}/{repo.replace('/', '--')}/{hub.commits()[repo]}"


def hub_requests(lab) -> list[dict]:
    return [record for record in control(lab, "requests") if record["path"].startswith(hub.PREFIX + "/")]


def download_process(lab, host, busy_pid: int, timeout: float = 240) -> str:
    """The pid of the download's python: busy.sh (`busy_pid`, its lock.activity's) runs `bash -c`, which runs it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = lab.exec(host, f"pgrep -f -P \"$(pgrep -d, -P {busy_pid})\" stage-weights").stdout.split()
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no download started under busy.sh {busy_pid} on {host.name} within {timeout} s")


def test_weights_are_staged_before_the_restart_resume_when_cut_and_are_not_fetched_again(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    kimi_dir, draft_dir = staged_dir(KIMI), staged_dir(DRAFT)

    dry = dry_run(the_lab)
    assert f"download 4 of 4 files (13.6 MB of 13.6 MB) of {KIMI}@{hub.commits()[KIMI][:12]}" in dry.output, \
        dry.output[-6000:]
    assert the_lab.exec(host, f"test -e {MODELS_DIR}").returncode != 0   # the dry run staged nothing

    # the big file's download is cut after 11 MiB (the fault takes the HEAD and the GET): the run fails at
    # the weights step, before the service step installs or starts anything
    control(the_lab, "add_fault", f"{hub.PREFIX}/{KIMI}/resolve/*/{BIG}", "cut", after=11 * hub.MIB, times=2)
    cut = run_pyinfra(the_lab, "-y")
    assert cut.returncode != 0
    assert "model weights download failed" in cut.output and "ChunkedEncodingError" in cut.output, cut.output[-6000:]
    assert the_lab.exec(host, f"test -e {UNIT}").returncode != 0
    assert hub.served_bytes(hub_requests(the_lab), KIMI, BIG) == 11 * hub.MIB

    # the next run resumes the partial file (0.36.2 wrote its first 10 MiB chunk) instead of starting over
    control(the_lab, "reset")
    first = apply(the_lab)
    big = [record for record in hub_requests(the_lab) if record["path"].endswith(f"/{KIMI}/resolve/"
                                                                                 f"{hub.commits()[KIMI]}/{BIG}")]
    assert [(record["method"], record["range"]) for record in big] == [("HEAD", None), ("GET", "bytes=10485760-")]
    assert big[1]["bytes_sent"] == hub.WEIGHT_SIZES[0] - 10 * hub.MIB
    assert "model weights nvidia/Kimi-K2.5-NVFP4@" in first.output and "verified (4 files" in first.output

    # the unit serves the staged directories; the model's config.json is the stand-in of Kimi-K2.5's
    unit = the_lab.exec(host, f"cat {UNIT}", check=True).stdout
    assert f"--model-path {kimi_dir} " in unit and f"--speculative-draft-model-path {draft_dir} " in unit
    config = json.loads(the_lab.exec(host, f"cat {kimi_dir}/config.json", check=True).stdout)
    assert (config["model_type"], config["architectures"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"])
    record = json.loads(the_lab.exec(host, f"cat {kimi_dir}.verified.json", check=True).stdout)
    assert (record["repo"], record["revision"], record["files"][BIG]) == (KIMI, hub.commits()[KIMI],
                                                                         hub.WEIGHT_SIZES[0])
    # SGLang's pre-start check now reads the staged config
    assert f"checked: ServerArgs ({kimi_dir}'s model config" in first.output, first.output[-6000:]

    # converged: nothing changes, the Hub is not asked, not a byte is fetched
    control(the_lab, "reset")
    second = apply(the_lab)
    assert second.totals["success"] == 0 and second.totals["error"] == 0
    assert hub_requests(the_lab) == []
    again = dry_run(the_lab)
    assert f"model weights current: {KIMI}@{hub.commits()[KIMI][:12]}" in again.output
    assert hub_requests(the_lab) == []


def test_a_corrupted_file_is_fetched_again_and_an_unknown_revision_is_refused_before_the_download(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    unknown = "dead" * 10   # (pyinfra's --data reads all digits as a number)
    refused = run_pyinfra(the_lab, "-y", "--data", f"service_draft_model_revision={unknown}")
    assert refused.returncode != 0
    assert f"the Hub has no revision {unknown} of {DRAFT} (404 RevisionNotFound)" in refused.output, \
        refused.output[-6000:]
    assert the_lab.exec(host, f"test -e {UNIT}").returncode != 0

    control(the_lab, "reset")
    control(the_lab, "add_fault", f"{hub.PREFIX}/{KIMI}/resolve/*/{BIG}", "corrupt", times=2)
    run = apply(the_lab)
    assert f"{BIG} differs from the Hub's (sha256 " in run.output and "fetching it again" in run.output
    gets = [record for record in hub_requests(the_lab) if record["method"] == "GET" and record["path"].endswith(BIG)
            and f"/{KIMI}/" in record["path"]]
    assert len(gets) == 2
    digest = the_lab.exec(host, f"sha256sum {staged_dir(KIMI)}/{BIG}", check=True).stdout.split()[0]
    assert digest == hub.repositories()[KIMI].file(BIG).sha256


def test_too_little_disk_and_a_gated_model_without_a_token_are_refused_before_any_change(lab, monkeypatch):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    the_lab.exec(host, "mkdir -p /srv/small && mount -t tmpfs -o size=16m none /srv/small", check=True)
    before = the_lab.fingerprints()
    small = run_pyinfra(the_lab, "-y", "--data", "service_models_dir=/srv/small/models")
    assert small.returncode != 0
    assert "refused: model weights: /srv/small/models (service_models_dir) has 16777216 bytes free, " \
           f"{KIMI}, {DRAFT} need " in small.output and "missing + margin): short by " in small.output, \
        small.output[-6000:]
    assert the_lab.fingerprints() == before, "a refused host was changed"

    control(the_lab, "gate", [DRAFT])
    gated = run_pyinfra(the_lab, "-y")
    assert gated.returncode != 0
    assert f"the Hub will not give {DRAFT} without a token it accepts" in gated.output, gated.output[-6000:]
    assert the_lab.fingerprints() == before, "a refused host was changed"

    token = "hf_standin_secret_4711"
    unset = run_pyinfra(the_lab, "-y", "--data", "service_hub_token_env=HF_TOKEN")
    assert "'service_hub_token_env': HF_TOKEN is not set in the control machine's environment" in unset.output
    monkeypatch.setenv("HF_TOKEN", token)
    run = apply(the_lab, "deploy.py", "--data", "service_hub_token_env=HF_TOKEN")
    assert token not in run.output
    authorized = [record for record in hub_requests(the_lab) if f"/{DRAFT}/resolve/" in record["path"]]
    assert authorized and all(record["status"] in (200, 206) for record in authorized)
    found = the_lab.exec(host, f"grep -rls {token} /etc /var/lib/servestack /opt/servestack/releases/*/sglang.service; "
                               "test ! -e /etc/servestack/hub-token")
    assert (found.stdout, found.returncode) == ("", 0)   # grep found nothing; the token file is gone


def test_a_prestaged_copy_is_served_without_a_transfer_and_one_that_differs_is_refused(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    apply(the_lab)
    copy = "/srv/kimi-copy"
    the_lab.exec(host, f"mkdir -p {copy} && cp -p {staged_dir(KIMI)}/*.json {staged_dir(KIMI)}/*.md "
                       f"{staged_dir(KIMI)}/*.safetensors {copy}/", check=True)
    listing = f"cd {copy} && find . -printf '%p %s %T@\\n' | sort && sha256sum *"
    before = the_lab.exec(host, listing, check=True).stdout
    control(the_lab, "reset")
    data = ("--data", f"service_model_local_copy={copy}")
    run = apply(the_lab, "deploy.py", *data)
    assert f"model weights {KIMI}@{hub.commits()[KIMI][:12]}: checking the pre-staged copy {copy}" in run.output
    assert [record for record in hub_requests(the_lab) if "/resolve/" in record["path"]] == []
    assert f"--model-path {copy} " in the_lab.exec(host, f"cat {UNIT}", check=True).stdout
    assert the_lab.exec(host, listing, check=True).stdout == before   # never modified
    again = apply(the_lab, "deploy.py", *data)
    assert again.totals["success"] == 0 and again.totals["error"] == 0

    other = "/srv/kimi-partial"
    the_lab.exec(host, f"cp -rp {copy} {other} && rm {other}/{BIG}", check=True)
    fingerprints = the_lab.fingerprints()
    refused = run_pyinfra(the_lab, "-y", "--data", f"service_model_local_copy={other}")
    assert refused.returncode != 0
    assert f"the pre-staged copy {other} of {KIMI}@{hub.commits()[KIMI][:12]} differs from the Hub's file list (it " \
           f"is left as it is): {BIG} (absent)" in refused.output, refused.output[-6000:]
    assert the_lab.fingerprints() == fingerprints


def test_sigterm_during_the_download_leaves_it_going_on_under_the_lock_and_an_immediate_rerun_refuses(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    control(the_lab, "add_fault", f"{hub.PREFIX}/{KIMI}/resolve/*/{BIG}", "slow", after=hub.MIB)   # about 12 s
    run = start(the_lab)
    downloading = wait_for_step(the_lab, host, "model weights download")
    python = download_process(the_lab, host, downloading["pid"])
    the_lab.exec(host, f"kill -STOP {python}", check=True)   # held until the test lets it go: no clock to race
    output = interrupt(run, signal.SIGTERM)
    assert run.returncode == 143, output[-4000:]
    assert "[h1] interrupted during 'Model weights | Stage model weights': the download goes on on the host, " \
           "holding the host's lock" in output, output[-4000:]

    again = run_pyinfra(the_lab, "-y")   # the killed run's download is still there, held
    assert again.returncode != 0
    assert f"another servestack run holds /var/lib/servestack/lock: run {downloading['run_id']}" in again.output, \
        again.output[-4000:]
    assert "its connection is gone, but 'model weights download'" in again.output, again.output[-4000:]
    assert the_lab.exec(host, f"test -e {UNIT}").returncode != 0

    the_lab.exec(host, f"kill -CONT {python}", check=True)
    wait_until_idle(the_lab, host)
    # it finished on the host without its run (its output has nowhere to go): verified, recorded, fetched once
    record = json.loads(the_lab.exec(host, f"cat {staged_dir(KIMI)}.verified.json", check=True).stdout)
    assert (record["repo"], record["revision"]) == (KIMI, hub.commits()[KIMI])
    assert hub.served_bytes(hub_requests(the_lab), KIMI, BIG) == hub.WEIGHT_SIZES[0]
    control(the_lab, "reset")
    assert apply(the_lab).totals["error"] == 0
    assert [record for record in hub_requests(the_lab) if "/resolve/" in record["path"]] == []   # none again
    assert apply(the_lab).totals["success"] == 0
