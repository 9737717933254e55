"""Model weights (issue 31): the manifest's pinned models, the host-data keys, the refusals, the staged
directories the unit names, and the weights step's decisions."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from operations.weights import TOKEN_FILE, disk_needed, fetch_command, is_current, plan_lines, plan_problems
from sandbox.lab import sandbox_manifest
from sandbox.standins import hub
from sandbox.standins.runfile import RunfileInfo
from servestack.errors import ConfigError
from servestack.keys import check_manifest_defaults, manifest_models
from servestack.manifest import DEFAULT_MANIFEST, load_manifest, parse_manifest
from servestack.releases import release_at
from servestack.serving import launch_arguments
from servestack.settings import settings_from_data
from servestack.weights import pin_problems, pinned_models, served_path, staged_models, token_problems

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
