"""Both service profiles on sandbox hosts (issue 17): the whole deploy converges a host of each,
the verification suite passes, a second converge changes nothing, and each host's server was
started with its own profile's command line and environment. A host that changes profile gets the
new unit through the health-gated restart, and nothing else changes."""

import json

import pytest

from pyinfra_run import apply
from sandbox.rehearse import Outcome, assign_profiles, profile_names, server_info, verify
from sandbox.standins import hub
from servestack.manifest import load_manifest

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


def assert_serves(lab, chosen: dict[str, str]) -> None:
    for host in lab.hosts:
        info = server_info(lab, host)
        assert info["argv"] == ARGV[chosen[host.name]], host.name
        assert "SGLANG_ENABLE_SPEC_V2" not in info["environment"], host.name   # gone from 0.5.14 (GLM-5's stack)


def test_a_host_of_each_profile_converges_verifies_and_then_changes_nothing(lab):
    the_lab = lab(2)
    profiles = profile_names()
    assert profiles == ["kimi-k2.5-eagle3", "glm-5-mtp", "kimi-k2.5-eagle3-0.5.14"]
    chosen = assign_profiles(the_lab, profiles)
    assert chosen == {"h1": "kimi-k2.5-eagle3", "h2": "glm-5-mtp"}

    first = apply(the_lab)
    assert first.totals["success"] > 0
    second = apply(the_lab)
    assert second.totals["success"] == 0 and second.totals["error"] == 0, changed_operations(second)
    outcome = Outcome(hosts=2)
    verify(the_lab, the_lab.inventory_path, outcome)  # raises when a check fails
    assert outcome.verify["failed"] == 0 and outcome.verify["passed"] > 0
    assert_serves(the_lab, chosen)
    glm = server_info(the_lab, the_lab.hosts[1])["server_args"]
    assert (glm["speculative_algorithm"], glm["speculative_draft_model_path"], glm["kv_cache_dtype"],
            glm["quantization"], glm["disable_custom_all_reduce"]) == ("NEXTN", None, "bf16", "modelopt_fp4", True)

    # A host changing profile gets its new profile's stack: a release of that stack is built, checked by
    # SGLang, activated, and the unit restarted through the health gate; the toolkit is not touched.
    swapped = assign_profiles(the_lab, ["glm-5-mtp", "kimi-k2.5-eagle3-0.5.14"])   # Kimi moves to 0.5.14
    switch = apply(the_lab)
    changed = changed_operations(switch)
    for step in ("Build release", "SGLang pre-start check", "Activate release"):
        assert any(name.endswith(step) for name in changed), (step, changed)
    assert all(name.endswith(SERVICE_OPERATIONS + STACK_OPERATIONS) for name in changed), changed
    assert_serves(the_lab, swapped)
    for host in the_lab.hosts:
        stack = load_manifest().service["profiles"][swapped[host.name]]["stack"]
        record = the_lab.exec(host, 'cat "$(dirname "$(readlink -f /opt/ml-env)")/release.json"', check=True).stdout
        assert json.loads(record)["inputs"]["stack"] == stack, host.name
