"""Both service profiles on sandbox hosts (issue 17): the whole deploy converges a host of each,
the verification suite passes, a second converge changes nothing, and each host's server was
started with its own profile's command line and environment. Each profile builds its own stack
(issue 28): the release a host builds is its profile's stack as a real host resolves it. A host that
changes profile gets the new unit through the health-gated restart, and nothing else changes.

One lab of two hosts, one of each profile, converged once for the module (`two_profiles`): what the
tests read of it is read right after the converges, before the one test that changes the hosts' profiles."""

import json
import shlex
from dataclasses import dataclass

import pytest

from pyinfra_run import PyinfraRun, apply, dry_run
from sandbox.rehearse import Outcome, assign_profiles, profile_names, server_info, verify
from sandbox.standins import closure, hub
from servestack.manifest import load_manifest
from test_stacks import GLM, KIMI, active_release

pytestmark = pytest.mark.integration

SERVICE_OPERATIONS = ("Unit sglang.service", "Health-gated restart of sglang.service", "Stage model weights")
STACK_OPERATIONS = ("Back up the ML environment", "Build release", "Apply SGLang source patches",
                    "SGLang pre-start check", "Activate release", "Prune old releases", "Service JIT cache directory")


# The command line each profile's server must be started with, written out from files/stack.toml's
# [service] and [service.profiles.*] text in SGLang's own flag spellings (shared/notes/serving-facts.md;
# `--tp` is argparse's prefix of sglang's `--tp-size`, as tests/unit/test_profiles.py checks with sglang's
# parser). The lab's hosts have 8 stand-in GPUs, so tp stays the manifest's 8. Booleans are flags, given
# when true; left out: what a profile does not set (GLM-5's draft model: it drafts with its own layers).
SERVICE = ["--host", "0.0.0.0", "--port", "30000"]
SPECULATION = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "4"]
MODELS = "/var/lib/servestack/models"   # each repository staged at the stand-in Hub's commit (the weights step)
COMMITS = hub.commits()
ARGV = {
    "kimi-k2.5-eagle3": ["--model-path", f"{MODELS}/nvidia--Kimi-K2.5-NVFP4/{COMMITS['nvidia/Kimi-K2.5-NVFP4']}",
                         "--tp", "8", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                         f"{MODELS}/lightseekorg--kimi-k2.5-eagle3/{COMMITS['lightseekorg/kimi-k2.5-eagle3']}",
                         *SPECULATION,
                         "--attention-backend", "flashinfer", "--trust-remote-code", "--enable-torch-symm-mem",
                         *SERVICE],
    "glm-5-mtp": ["--model-path", f"{MODELS}/festr2--GLM-5-NVFP4-MTP/{COMMITS['festr2/GLM-5-NVFP4-MTP']}",
                  "--tp", "8", "--speculative-algorithm", "NEXTN",
                  *SPECULATION, "--attention-backend", "flashinfer", "--quantization", "modelopt_fp4",
                  "--kv-cache-dtype", "bf16", *SERVICE, "--disable-custom-all-reduce"],   # extra_args last
}
# Kimi-K2.5 on the current stack: the same, but symmetric memory (it does nothing on SM120 in sglang 0.5.14)
ARGV["kimi-k2.5-eagle3-0.5.14"] = [word for word in ARGV["kimi-k2.5-eagle3"] if word != "--enable-torch-symm-mem"]


def changed_operations(run) -> list[str]:
    return [op["name"] for op in json.loads(run.stdout)["results"]["operations"] if op["success"]]


def assert_serves(served: dict[str, dict], chosen: dict[str, str]) -> None:
    """`served`: each host's /server_info."""
    for name, info in served.items():
        assert info["argv"] == ARGV[chosen[name]], name
        assert "SGLANG_ENABLE_SPEC_V2" not in info["environment"], name   # gone from 0.5.14 (GLM-5's stack)


def served_by(lab) -> dict[str, dict]:
    return {host.name: server_info(lab, host) for host in lab.hosts}


# GLM-5's config type, loaded with its release's own (real) transformers
LOAD_GLM_CONFIG = ("import json, tempfile; from transformers import AutoConfig; d = tempfile.mkdtemp(); "
                   "json.dump({'model_type': 'glm_moe_dsa', 'architectures': ['GlmMoeDsaForCausalLM']}, "
                   "open(d + '/config.json', 'w')); print(type(AutoConfig.from_pretrained(d)).__name__)")


@dataclass
class TwoProfiles:
    """A lab of two hosts given the profiles in turn, dry-run, converged twice, and what was read of it then."""

    lab: object
    chosen: dict[str, str]
    dry: PyinfraRun
    first: PyinfraRun
    second: PyinfraRun
    releases: list[dict]          # each host's active release.json
    glm_config_type: str          # LOAD_GLM_CONFIG's answer on h2
    outcome: Outcome              # the verification suite's, after the second converge
    served: dict[str, dict]       # each host's /server_info, after the second converge


@pytest.fixture(scope="module")
def two_profiles(lab) -> TwoProfiles:
    """Every read of the converged hosts happens here, before any test changes a host's profile."""
    the_lab = lab(2)
    chosen = assign_profiles(the_lab, profile_names())
    dry = dry_run(the_lab)
    first = apply(the_lab)
    releases = [active_release(the_lab, host) for host in the_lab.hosts]
    said = the_lab.exec(the_lab.hosts[1], f"/opt/ml-env/bin/python -c {shlex.quote(LOAD_GLM_CONFIG)}",
                        check=True).stdout
    second = apply(the_lab)
    outcome = Outcome(hosts=2)
    verify(the_lab, the_lab.inventory_path, outcome)  # raises when a check fails
    return TwoProfiles(the_lab, chosen, dry, first, second, releases, said.strip(), outcome, served_by(the_lab))


def test_a_host_of_each_profile_converges_verifies_and_then_changes_nothing(two_profiles):
    assert profile_names() == ["kimi-k2.5-eagle3", "glm-5-mtp", "kimi-k2.5-eagle3-0.5.14"]
    chosen = two_profiles.chosen
    assert chosen == {"h1": "kimi-k2.5-eagle3", "h2": "glm-5-mtp"}
    assert two_profiles.first.totals["success"] > 0
    second = two_profiles.second
    assert second.totals["success"] == 0 and second.totals["error"] == 0, changed_operations(second)
    outcome = two_profiles.outcome
    assert outcome.verify["failed"] == 0 and outcome.verify["passed"] > 0
    assert_serves(two_profiles.served, chosen)
    glm = two_profiles.served["h2"]["server_args"]
    assert (glm["speculative_algorithm"], glm["speculative_draft_model_path"], glm["kv_cache_dtype"],
            glm["quantization"], glm["disable_custom_all_reduce"]) == ("NEXTN", None, "bf16", "modelopt_fp4", True)


def test_each_profile_builds_its_own_stack_and_the_models_it_needs_can_start(two_profiles):
    assert two_profiles.chosen == {"h1": KIMI, "h2": GLM}
    # the dry run shows each host the package change its own stack brings
    kimi_diff, glm_diff = (two_profiles.dry.output.split(f"[{name}] package changes:")[1].split("\n\n")[0]
                           for name in ("h1", "h2"))
    assert "+ nvidia-cudnn-cu13==9.16.0.29" in kimi_diff and "+ transformers==4.57.1" in kimi_diff
    assert "~ torch 2.9.1+cu128 -> 2.9.1+cu130" in kimi_diff
    assert "+ transformers==5.8.1" in glm_diff and "~ torch 2.9.1+cu128 -> 2.11.0" in glm_diff
    first = two_profiles.first
    assert "SGLang's pre-start check of release" in first.output
    # the weights step staged the stand-in Hub's model (its config.json the real model's type and architecture)
    # before the check: SGLang's ServerArgs ran with that model config
    staged = f"/var/lib/servestack/models/nvidia--Kimi-K2.5-NVFP4/{hub.commits()['nvidia/Kimi-K2.5-NVFP4']}"
    assert f"checked: ServerArgs ({staged}'s model config, every setting)" in first.output
    assert "checked: SGLang's argument parser accepts the unit's command line" in first.output
    kimi, glm = two_profiles.releases
    assert kimi["id"] != glm["id"]
    assert (kimi["inputs"]["stack"], glm["inputs"]["stack"]) == ("sglang-0.5.9", "sglang-0.5.14")
    # Kimi-K2.5 is multimodal, on torch 2.9.1: cuDNN 9.15 or later, or sglang 0.5.9 refuses to start
    assert kimi["packages"]["torch"] == "2.9.1+cu130"
    assert kimi["packages"]["nvidia-cudnn-cu13"] == "9.16.0.29"
    assert kimi["packages"]["sgl-kernel"] == "0.3.21"   # METADATA's version of the +cu130 file
    assert (glm["packages"]["torch"], glm["packages"]["transformers"]) == ("2.11.0", "5.8.1")
    # each release holds what a real host resolves for its stack, package for package
    for record, stack in ((kimi, "sglang-0.5.9"), (glm, "sglang-0.5.14")):
        resolved = closure.resolve(load_manifest().stacks[stack])
        installed = {closure.normalize_project(name): version for name, version in record["packages"].items()}
        expected = {name: version for name, version in resolved.items() if not version.endswith(".whl")}
        assert {name: installed.get(name) for name in expected} == expected
    # GLM-5's config type loads with its release's own (real) transformers
    assert two_profiles.glm_config_type == "GlmMoeDsaConfig"
    second = two_profiles.second
    assert second.totals["success"] == 0 and second.totals["error"] == 0


def test_a_host_changing_profile_gets_its_stack_through_the_gate_and_nothing_else_changes(two_profiles):
    """A host changing profile gets its new profile's stack: a release of that stack is built, checked by
    SGLang, activated, and the unit restarted through the health gate; the toolkit is not touched."""
    the_lab = two_profiles.lab
    swapped = assign_profiles(the_lab, ["glm-5-mtp", "kimi-k2.5-eagle3-0.5.14"])   # Kimi moves to 0.5.14
    switch = apply(the_lab)
    changed = changed_operations(switch)
    for step in ("Build release", "SGLang pre-start check", "Activate release"):
        assert any(name.endswith(step) for name in changed), (step, changed)
    assert all(name.endswith(SERVICE_OPERATIONS + STACK_OPERATIONS) for name in changed), changed
    assert_serves(served_by(the_lab), swapped)
    for host in the_lab.hosts:
        stack = load_manifest().service["profiles"][swapped[host.name]]["stack"]
        record = the_lab.exec(host, 'cat "$(dirname "$(readlink -f /opt/ml-env)")/release.json"', check=True).stdout
        assert json.loads(record)["inputs"]["stack"] == stack, host.name
