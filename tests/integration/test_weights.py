"""The weights step on sandbox hosts: the profile's model and draft staged from the STAND-IN Hub
(sandbox/standins/hub.py, served by the lab's artifact server under /hub) by the release's real
huggingface_hub, before the service step; the unit names the staged directories; a converged host
changes nothing and fetches nothing; a cut download resumes on the next run; a controller killed during
the download leaves it going on on the host, under the lock; old revisions (the stand-in Hub's second commit
of each repository) are pruned after the service step, never one that a unit of the service names.
"""

from __future__ import annotations

import json
import signal

import pytest

from pyinfra_run import apply, dry_run, run_pyinfra
from sandbox.standins import hub
from test_interrupted import interrupt, start, wait_for_step, wait_until_idle
from weights_lab import (BIG, DRAFT, GOOD_UNIT, KIMI, MODELS_DIR, UNIT, control, download_process, hub_requests,
                         staged_dir)

pytestmark = pytest.mark.integration

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


def test_old_revisions_are_pruned_after_the_service_step_but_never_one_a_unit_of_the_service_names(lab):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    old, new, draft = staged_dir(KIMI), staged_dir(KIMI, "v2"), staged_dir(DRAFT)
    label = f"{KIMI}@{hub.commits()[KIMI][:12]}"
    apply(the_lab)   # the manifest's pins: the first commit of the model and of the draft
    newer = ("--data", f"service_model_revision={hub.commits('v2')[KIMI]}")
    apply(the_lab, "deploy.py", *newer)   # the newer commit; 2 kept (the manifest's models_keep)
    assert the_lab.exec(host, f"test -d {old} && test -d {new} && test -d {draft}").returncode == 0
    assert f"--model-path {new} " in the_lab.exec(host, f"cat {UNIT}", check=True).stdout

    # the known-good unit names the older revision, as the unit a rollback returns to does until a gate passes
    # (here by hand: the gate that passed made it the active unit's copy)
    the_lab.exec(host, f"sed -i 's|{new}|{old}|' {GOOD_UNIT}", check=True)
    keep_one = (*newer, "--data", "service_models_keep=1")
    before = the_lab.fingerprints()
    dry = dry_run(the_lab, "deploy.py", *keep_one)
    assert f"prune the model weights {label} (13.6 MB) in {MODELS_DIR}: past the newest 1 of its repository " \
           "(service_models_keep), unless the active or the known-good unit serves it" in dry.output, \
        dry.output[-6000:]
    assert draft not in dry.output.split("prune the model weights", 1)[1]   # the draft's one revision is served
    assert the_lab.fingerprints() == before, "a dry run changed the host"
    apply(the_lab, "deploy.py", *keep_one)   # chosen while pyinfra prepared the run; kept on the host
    assert the_lab.exec(host, f"test -d {old} && test -f {old}.verified.json").returncode == 0

    # the known-good unit as the gate left it: the older revision goes, after the service step
    the_lab.exec(host, f"cp {UNIT} {GOOD_UNIT}", check=True)
    pruned = apply(the_lab, "deploy.py", *keep_one)
    assert pruned.totals["success"] == 1, pruned.output[-6000:]   # the prune, the one change
    assert the_lab.exec(host, f"test ! -e {old} && test ! -e {old}.verified.json").returncode == 0
    assert the_lab.exec(host, f"test -f {new}.verified.json && test -f {draft}.verified.json").returncode == 0

    # back to the first commit, 1 kept: the revision it pushes out is listed before the download, and pruned
    back = ("--data", "service_models_keep=1")
    listed = dry_run(the_lab, "deploy.py", *back)
    assert f"prune the model weights {KIMI}@{hub.commits('v2')[KIMI][:12]} (13.6 MB)" in listed.output, \
        listed.output[-6000:]
    apply(the_lab, "deploy.py", *back)
    assert the_lab.exec(host, f"test ! -e {new} && test ! -e {new}.verified.json").returncode == 0
    assert the_lab.exec(host, f"test -f {old}.verified.json && test -f {draft}.verified.json").returncode == 0
    again = apply(the_lab, "deploy.py", *back)
    assert again.totals["success"] == 0 and again.totals["error"] == 0   # nothing pruned, nothing else changed
    assert the_lab.exec(host, f"test -d {old} && test -d {draft}").returncode == 0
