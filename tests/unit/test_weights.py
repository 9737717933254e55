"""Model weights (issue 31): the manifest's pinned models, the host-data keys, the refusals, the staged
directories the unit names, and the weights step's decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from facts.batch import FactRequest
from facts.framing import Section
from facts.weights import SCRIPT, StagedRevisions
from operations.service import render_unit
from operations.weights import (TOKEN_FILE, disk_needed, fetch_command, plan_lines, plan_problems, prune_line,
                                served_dirs)
from sandbox.lab import sandbox_manifest
from sandbox.standins import hub
from sandbox.standins.runfile import RunfileInfo
from servestack.errors import ConfigError
from servestack.keys import check_manifest_defaults, manifest_models
from servestack.manifest import DEFAULT_MANIFEST, load_manifest, parse_manifest
from servestack import status
from servestack.checks.outcome import Fail, Skip
from servestack.checks.weights import served_weights
from servestack.releases import release_at
from servestack.scripts import script_text
from servestack.serving import launch_arguments
from servestack.settings import settings_from_data
from servestack.weights import (is_current, pin_problems, pinned_models, revisions_to_prune, served_path,
                                staged_models, token_problems)

try:
    import tomllib
except ImportError:   # Python 3.10
    import tomli as tomllib

KIMI, DRAFT, GLM = "nvidia/Kimi-K2.5-NVFP4", "lightseekorg/kimi-k2.5-eagle3", "festr2/GLM-5-NVFP4-MTP"
A, B = "a" * 40, "b" * 40
# What each model's config.json declares (shared/notes; sglang 0.5.9 srt/configs/kimi_k25.py; transformers
# >= 5.2 configuration_auto.py); the EAGLE-3 draft's is marked unverified in the manifest.
REAL = {KIMI: ("kimi_k25", ["KimiK25ForConditionalGeneration"]),
        GLM: ("glm_moe_dsa", ["GlmMoeDsaForCausalLM"])}


def settings(**data):
    return settings_from_data("h1", data)


def manifest_with(edit) -> Path:
    """The manifest as TOML data, changed by `edit`, parsed and checked as a host's would be."""
    data = tomllib.loads(DEFAULT_MANIFEST.read_text())
    edit(data)
    manifest = parse_manifest(DEFAULT_MANIFEST, data)
    check_manifest_defaults(manifest)
    return manifest


# --- the manifest ------------------------------------------------------------------------------------

def test_every_profiles_model_and_draft_is_a_model_of_the_manifest_with_its_real_config_type():
    manifest = load_manifest()
    models = manifest_models(manifest)
    for profile in manifest.service["profiles"].values():
        assert profile["model_path"] in models and profile.get("draft_model_path", KIMI) in models
        assert profile["model_architecture"] in models[profile["model_path"]]["architectures"]
    for repo, (model_type, architectures) in REAL.items():
        assert (models[repo]["model_type"], models[repo]["architectures"]) == (model_type, architectures)


def test_no_revision_is_pinned_that_nobody_checked():
    """The Hub could not be reached where the manifest was written: no commit is invented."""
    assert all("revision" not in model for model in manifest_models(load_manifest()).values())


def test_a_revision_in_the_manifest_must_be_a_commit_and_a_profiles_model_must_be_listed():
    def branch(data):
        data["service"]["models"][KIMI]["revision"] = "main"
    with pytest.raises(ConfigError, match=r"service.models.\"nvidia/Kimi-K2.5-NVFP4\".revision': expected a commit"):
        manifest_with(branch)

    def unlisted(data):
        data["service"]["profiles"]["glm-5-mtp"]["model_path"] = "zai-org/GLM-5"
    with pytest.raises(ConfigError, match=r"glm-5-mtp\"\.model_path': expected a model of the manifest's "
                                          r"\[service.models\].*got 'zai-org/GLM-5'"):
        manifest_with(unlisted)

    def wrong_architecture(data):
        data["service"]["profiles"]["glm-5-mtp"]["model_architecture"] = "DeepseekV3ForCausalLM"
    with pytest.raises(ConfigError, match="expected an architecture festr2/GLM-5-NVFP4-MTP's config.json declares "
                                          r"\(GlmMoeDsaForCausalLM"):
        manifest_with(wrong_architecture)


# --- host data ---------------------------------------------------------------------------------------

def test_the_new_keys_defaults_and_a_branch_is_refused_as_a_revision():
    defaults = settings()
    assert (defaults.service_models_dir, defaults.service_hub_endpoint) == ("/var/lib/servestack/models",
                                                                           "https://huggingface.co")
    assert defaults.service_model_revision is None and defaults.service_draft_model_revision is None
    with pytest.raises(ConfigError, match="'service_model_revision': expected a commit of the model's repository: "
                                          r"40 lowercase hex digits \(never a branch such as 'main'\), got 'main'"):
        settings(service_model_revision="main")
    with pytest.raises(ConfigError, match="'service_hub_endpoint': expected"):
        settings(service_hub_endpoint="mirror.local")


def test_a_model_pinned_nowhere_is_refused_naming_the_profile_the_model_and_the_key_to_set():
    problems = pin_problems(settings())
    assert problems == [
        f"profile 'kimi-k2.5-eagle3' serves {KIMI} (model), whose revision is pinned neither by the manifest "
        f"([service.models.\"{KIMI}\"] revision: its commit has not been checked) nor by host data: set "
        "'service_model_revision' to the 40-hex commit to serve (never a branch)",
        f"profile 'kimi-k2.5-eagle3' serves {DRAFT} (draft), whose revision is pinned neither by the manifest "
        f"([service.models.\"{DRAFT}\"] revision: its commit has not been checked) nor by host data: set "
        "'service_draft_model_revision' to the 40-hex commit to serve (never a branch)"]
    assert pin_problems(settings(service_model_revision=A, service_draft_model_revision=B)) == []
    glm = pin_problems(settings(service_profile="glm-5-mtp"))
    assert len(glm) == 1 and GLM in glm[0] and "'glm-5-mtp'" in glm[0]   # no draft: its own MTP layers


def test_a_model_on_a_local_path_is_served_as_it_is_and_never_staged():
    local = settings(service_model_path="/models/kimi", service_draft_model_path="/models/draft")
    assert staged_models(local) == () and pin_problems(local) == []
    assert launch_arguments(local)[:2] == ["--model-path", "/models/kimi"]


# --- what the unit names -----------------------------------------------------------------------------

def test_the_unit_names_the_staged_directories_one_per_repository_and_revision():
    pinned = settings(service_model_revision=A, service_draft_model_revision=B, service_models_dir="/srv/models/")
    argv = launch_arguments(pinned)
    assert argv[argv.index("--model-path") + 1] == f"/srv/models/nvidia--Kimi-K2.5-NVFP4/{A}"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == f"/srv/models/lightseekorg--kimi-k2.5-eagle3/{B}"
    assert [model.record(pinned) for model in pinned_models(pinned)] == [
        f"/srv/models/nvidia--Kimi-K2.5-NVFP4/{A}.verified.json",
        f"/srv/models/lightseekorg--kimi-k2.5-eagle3/{B}.verified.json"]
    # unpinned (a host the deploy refuses): as before, the repository ids
    assert served_path(settings(), "model") == KIMI and served_path(settings(), "draft") == DRAFT


# --- the weights step's decisions ---------------------------------------------------------------------

def test_a_record_is_current_only_for_its_repository_revision_and_directory():
    host = settings(service_model_revision=A, service_draft_model_revision=B)
    model = pinned_models(host)[0]
    where = f"/var/lib/servestack/models/nvidia--Kimi-K2.5-NVFP4/{A}"
    assert is_current({"schema": 1, "repo": KIMI, "revision": A, "dir": where}, model, host)
    assert not is_current({"schema": 1, "repo": KIMI, "revision": B, "dir": where}, model, host)
    assert not is_current({"schema": 1, "repo": GLM, "revision": A, "dir": where}, model, host)
    assert not is_current({"schema": 1, "repo": KIMI, "revision": A, "dir": "/srv/copy"}, model, host)
    assert not is_current(None, model, host) and not is_current({"repo": KIMI, "revision": A, "dir": where}, model,
                                                                host)


def test_a_prestaged_copy_is_served_as_it_is_its_record_kept_in_the_models_directory():
    host = settings(service_model_revision=A, service_draft_model_revision=B, service_model_local_copy="/srv/kimi")
    argv = launch_arguments(host)
    assert argv[argv.index("--model-path") + 1] == "/srv/kimi"
    model = pinned_models(host)[0]
    assert model.record(host) == f"/var/lib/servestack/models/nvidia--Kimi-K2.5-NVFP4/{A}.verified.json"
    differs = {"free_bytes": 0, "models": [{"repo": KIMI, "revision": A, "dir": "/srv/kimi", "prestaged": True,
                                            "problem": None, "files": 4, "bytes": 10, "missing_bytes": 7,
                                            "missing_files": ["a", "b"],
                                            "differs": {"a": "absent", "b": "3 bytes, the Hub's file has 5"}}]}
    assert plan_problems(host, differs) == [   # and no disk is needed: nothing is downloaded into a copy
        f"the pre-staged copy /srv/kimi of {KIMI}@{A[:12]} differs from the Hub's file list (it is left as it is): "
        "a (absent); b (3 bytes, the Hub's file has 5)"]
    differs["models"][0].update(differs={}, missing_files=[], missing_bytes=0)
    assert plan_lines(host, differs) == [f"check the pre-staged copy /srv/kimi of {KIMI}@{A[:12]} (4 files, 10 B) "
                                         "against the Hub's sizes and hashes, and serve it as it is"]


def wanted(missing_bytes: int, free: int, problem: str | None = None) -> dict:
    return {"free_bytes": free, "models": [{"repo": KIMI, "revision": A, "problem": problem, "files": 64,
                                            "bytes": 590 * 10**9, "missing_files": ["x"] * 3,
                                            "missing_bytes": missing_bytes}]}


def test_too_little_disk_for_what_is_missing_is_refused_naming_the_shortfall_in_bytes():
    host = settings()
    need = disk_needed(30 * 10**9)
    assert need == 31_500_000_000          # 5% margin (at least 1 GB)
    assert plan_problems(host, wanted(30 * 10**9, need)) == []
    short = plan_problems(host, wanted(30 * 10**9, need - 1234))
    assert short == [f"model weights: /var/lib/servestack/models (service_models_dir) has {need - 1234} bytes free, "
                     f"{KIMI} need {need} (30000000000 missing + margin): short by 1234 bytes"]


def test_the_hubs_refusal_is_the_hosts_and_the_plan_says_files_and_bytes():
    host = settings()
    problem = f"the Hub has no revision {A} of {KIMI} (404 RevisionNotFound)"
    assert plan_problems(host, wanted(0, 10**12, problem)) == [f"model weights {KIMI}@{A}: {problem}"]
    assert plan_lines(host, wanted(3 * 10**9, 10**12)) == [
        f"download 3 of 64 files (3.0 GB of 590.0 GB) of {KIMI}@{A[:12]} into /var/lib/servestack/models, "
        "then verify them against the Hub's sizes and hashes"]


# --- the sandbox pins the stand-in Hub's commits -------------------------------------------------------

def test_the_sandbox_manifest_pins_the_standin_hubs_commits(tmp_path):
    runfile = SimpleNamespace(runfile_info=RunfileInfo("x.run", 1, A[:32], A + A[:24]))
    path = sandbox_manifest(tmp_path / "stack.toml", runfile)
    for profile in ("kimi-k2.5-eagle3", "glm-5-mtp"):
        host = settings(servestack_manifest=str(path), service_profile=profile)
        assert pin_problems(host) == []
        assert {model.repo: model.revision for model in pinned_models(host)} == {
            model.repo: hub.commits()[model.repo] for model in staged_models(host)}


def test_a_hub_token_comes_from_the_control_machines_environment_and_is_never_on_a_command_line():
    host = settings(service_hub_token_env="HF_TOKEN", service_model_revision=A, service_draft_model_revision=B)
    assert token_problems(host, {}) == ["'service_hub_token_env': HF_TOKEN is not set in the control machine's "
                                        "environment (export it before the run)"]
    assert token_problems(host, {"HF_TOKEN": "hf_secret"}) == []
    with pytest.raises(ConfigError, match="'service_hub_token_env': expected the name of an environment variable"):
        settings(service_hub_token_env="hf token")
    command = fetch_command(host, release_at("/opt/servestack/releases", "r-0123456789ab"), list(pinned_models(host)))
    assert f"HF_TOKEN_PATH={TOKEN_FILE} " in command and command.endswith(f"rm -f -- {TOKEN_FILE}\nexit $status")
    assert "hf_secret" not in command
    # the plan (no token) cannot list a gated repository: with a token configured that is not a refusal
    gated = wanted(0, 10**12, f"the Hub will not give {KIMI} without a token it accepts")
    gated["models"][0]["needs_token"] = True
    assert plan_problems(settings(), gated) and plan_problems(host, gated) == []


# --- pruning old revisions -----------------------------------------------------------------------------

def staged(path: str, verified_at: str | None = None, **record) -> dict:
    repo = path.rsplit("/", 2)[-2].replace("--", "/", 1)
    return {"dir": path, "present": True, "record": None if verified_at is None else
            {"schema": 1, "repo": repo, "revision": path[-40:], "dir": path, "bytes": 10**9,
             "verified_at": verified_at, **record}}


def test_old_revisions_past_the_newest_kept_are_pruned_never_what_the_run_serves_nor_a_prestaged_copy():
    kimi, draft = "/m/nvidia--Kimi-K2.5-NVFP4", "/m/lightseekorg--kimi-k2.5-eagle3"
    C, D = "c" * 40, "d" * 40
    entries = [staged(f"{kimi}/{A}", "20260101T000000Z"), staged(f"{kimi}/{B}", "20260301T000000Z"),
               staged(f"{kimi}/{C}", "20260201T000000Z"), staged(f"{kimi}/{D}"),       # D: never finished
               staged(f"{draft}/{A}", "20260101T000000Z"), staged(f"{draft}/{B}", "20250101T000000Z", prestaged=True)]
    chosen = revisions_to_prune(entries, 1, {f"{kimi}/{A}"})
    assert [entry["dir"] for entry in chosen] == [f"{kimi}/{C}", f"{kimi}/{D}"]   # B newest; A served; draft B copy
    assert [entry["dir"] for entry in revisions_to_prune(entries, 2, set())] == [f"{kimi}/{A}", f"{kimi}/{D}"]
    assert revisions_to_prune(entries, 4, set()) == []
    host = settings(service_model_revision=A, service_draft_model_revision=B, service_models_dir="/m",
                    service_draft_model_local_copy="/srv/draft")
    assert served_dirs(host) == {f"{kimi}/{A}", "/srv/draft"}
    assert prune_line(host, entries[2]) == (
        f"prune the model weights {KIMI}@{C[:12]} (1.0 GB) in /m: past the newest 2 of its repository "
        "(service_models_keep), unless the active or the known-good unit serves it once the service step is done")


def test_what_the_run_downloads_counts_as_the_newest_revision_before_it_is_there():
    kimi = "/m/nvidia--Kimi-K2.5-NVFP4"
    C = "c" * 40
    entries = [staged(f"{kimi}/{A}", "20260101T000000Z"), staged(f"{kimi}/{B}", "20260301T000000Z")]
    # keep 2: B and the revision C this run downloads stay, A goes in this run (not the next one)
    assert [entry["dir"] for entry in revisions_to_prune(entries, 2, {f"{kimi}/{C}"}, {f"{kimi}/{C}"})] == [
        f"{kimi}/{A}"]
    assert revisions_to_prune(entries, 2, {f"{kimi}/{C}"}) == []    # without it, only the next converge would
    # keep 1: only C; a revision staged again (its directory there, its record stale) is the newest too
    assert [entry["dir"] for entry in revisions_to_prune(entries, 1, {f"{kimi}/{A}"}, {f"{kimi}/{A}"})] == [
        f"{kimi}/{B}"]


def test_the_number_kept_is_the_manifests_unless_host_data_says_and_is_bounded():
    assert settings().service_models_keep == 2
    assert settings(service_models_keep=1).service_models_keep == 1
    for wrong in (0, 101):
        with pytest.raises(ConfigError, match="service_models_keep"):
            settings(service_models_keep=wrong)


def test_the_staged_revisions_are_read_with_their_records_by_shell_builtins(tmp_path):
    models = tmp_path / "models"
    kimi, draft = models / "nvidia--Kimi-K2.5-NVFP4", models / "lightseekorg--kimi-k2.5-eagle3"
    (kimi / A).mkdir(parents=True)
    (kimi / B).mkdir()
    (kimi / "not-a-revision").mkdir()
    (kimi / f"{A}.verified.json").write_text('{"repo": "nvidia/Kimi-K2.5-NVFP4", "revision": "%s"}\n' % A)
    draft.mkdir()
    (draft / f"{A}.verified.json").write_text('{"prestaged": true, "dir": "/srv/draft"}\n')   # a copy elsewhere
    fact = StagedRevisions()
    out = subprocess.run(["sh", "-c", fact.command(str(models))], capture_output=True, text=True, check=True)
    assert fact.process(out.stdout.splitlines()) == [
        {"dir": f"{draft}/{A}", "present": False, "record": {"prestaged": True, "dir": "/srv/draft"}},
        {"dir": f"{kimi}/{A}", "present": True, "record": {"repo": KIMI, "revision": A}},
        {"dir": f"{kimi}/{B}", "present": True, "record": None}]
    empty = subprocess.run(["sh", "-c", fact.command(str(tmp_path / "none"))], capture_output=True, text=True)
    assert (empty.returncode, empty.stdout) == (0, "")
    assert FactRequest.of(StagedRevisions, models_dir=str(tmp_path / "none")).value(Section(0, ())) == []


def test_the_host_side_prune_keeps_what_a_unit_serves_then_and_removes_the_record_first(tmp_path):
    kimi = tmp_path / "nvidia--Kimi-K2.5-NVFP4"
    for revision in (A, B):
        (kimi / revision).mkdir(parents=True)
        (kimi / revision / "model.safetensors").write_bytes(b"x" * 1000)
        (kimi / f"{revision}.verified.json").write_text("{}\n")
    unit = tmp_path / "sglang.service"
    unit.write_text(f"[Service]\nExecStart=/r/venv/bin/python -m sglang.launch_server --model-path {kimi}/{B} "
                    "--speculative-draft-model-path /srv/draft --tp 8\n")
    params = json.dumps({"remove": [f"{kimi}/{A}", f"{kimi}/{B}"], "units": [str(unit), str(tmp_path / "absent")]})
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script_text(SCRIPT), "prune", params],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(path.name for path in kimi.iterdir()) == [B, f"{B}.verified.json"]
    assert out.stdout.splitlines() == [f"servestack: model weights {kimi}/{A}: pruned (1.0 kB)",
                                       f"servestack: model weights {kimi}/{B}: kept, a unit of the service serves it"]


# --- status shows what is staged ----------------------------------------------------------------------

def test_status_shows_each_staged_revision_from_the_records_and_which_the_host_serves():
    host = settings(service_model_revision=A, service_draft_model_revision=B, service_models_dir="/m")
    kimi, draft = "/m/nvidia--Kimi-K2.5-NVFP4", "/m/lightseekorg--kimi-k2.5-eagle3"
    entries = [staged(f"{kimi}/{A}", "20260107T090000Z"), staged(f"{kimi}/{B}"),
               {"dir": f"{draft}/{B}", "present": False,
                "record": {"repo": DRAFT, "prestaged": True, "dir": "/srv/draft", "verified_at": "20260107T080000Z"}}]
    found = status.models_status(host, entries)
    assert [(model["repo"], model["revision"], model["state"], model["serves"]) for model in found] == [
        (KIMI, A, "verified", "model"), (KIMI, B, "unfinished", None), (DRAFT, B, "pre-staged", "draft")]
    assert found[0]["verified_at"] == "2026-01-07T09:00:00Z" and found[2]["dir"] == "/srv/draft"
    cell = status.models_cell({"models": found, "host_time": "2026-01-07T10:00:00Z"})
    assert cell.splitlines() == [f"{KIMI}@{A[:12]} <- model", "  1.0 GB, verified 2026-01-07 09:00:00Z (1h ago)",
                                 f"{KIMI}@{B[:12]}", "  a download not finished",
                                 f"{DRAFT}@{B[:12]} <- draft",
                                 "  pre-staged copy /srv/draft, verified 2026-01-07 08:00:00Z (2h ago)"]
    assert status.models_cell({"models": []}) == "none staged"
    # read in the same remote command as the rest of the status
    assert "StagedRevisions" in [request.name for request in status.status_requests(host)]


# --- verify: the unit serves the pinned revision, staged and verified ------------------------------------

def test_verify_passes_only_where_the_unit_serves_the_verified_copy_of_each_pinned_revision(tmp_path):
    host = settings(service_model_revision=A, service_draft_model_revision=B)
    rel = release_at("/opt/servestack/releases", "r-0123456789ab")
    models = pinned_models(host)
    records = [{"schema": 1, "repo": model.repo, "revision": model.revision, "dir": model.directory(host),
                "verified_at": "20260107T090000Z"} for model in models]
    unit = render_unit(host, rel, None).splitlines()     # its ExecStart is continued over lines

    def judged(lines, found, settings_=host):
        return served_weights(settings_, SimpleNamespace(on="on h1", weights=[lines, *found]))

    assert judged(unit, records) == (f"--model-path {models[0].directory(host)}: {KIMI}@{A[:12]}, verified "
                                     f"20260107T090000Z; --speculative-draft-model-path {models[1].directory(host)}: "
                                     f"{DRAFT}@{B[:12]}, verified 20260107T090000Z")
    plain = render_unit(host, rel, None, speculation=False).splitlines()
    assert judged(plain, records).endswith(f"{DRAFT}@{B[:12]} not served (the unit does not speculate)")
    with pytest.raises(Fail, match=rf"is not a verified copy of {KIMI}@{A[:12]}: its record names {KIMI}@{B[:12]}"):
        judged(unit, [{**records[0], "revision": B}, records[1]])
    with pytest.raises(Fail, match=f"{A[:12]}: no record of it"):
        judged(unit, [None, records[1]])
    other = render_unit(settings(service_model_revision=B, service_draft_model_revision=B), rel, None).splitlines()
    with pytest.raises(Fail, match=f"serves --model-path /var/lib/servestack/models/nvidia--Kimi-K2.5-NVFP4/{B}, "
                                   f"expected /var/lib/servestack/models/nvidia--Kimi-K2.5-NVFP4/{A}"):
        judged(other, records)
    with pytest.raises(Skip, match="serves no model staged from the Hub"):
        judged(unit, [], settings(service_model_path="/srv/kimi", service_draft_model_path="/srv/draft"))
    # the host-side prune reads the same continued ExecStart
    (tmp_path / "sglang.service").write_text("\n".join(unit) + "\n")
    staged_dirs = [model.directory(host) for model in models]
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script_text(SCRIPT), "prune",
                          json.dumps({"remove": staged_dirs, "units": [str(tmp_path / "sglang.service")]})],
                         capture_output=True, text=True, check=True)
    assert out.stdout.count("kept, a unit of the service serves it") == 2
