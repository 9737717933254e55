"""Both service profiles on sandbox hosts (issue 17): the whole deploy converges a host of each,
the verification suite passes, a second converge changes nothing, and each host's server was
started with its own profile's command line and environment. A host that changes profile gets the
new unit through the health-gated restart, and nothing else changes."""

import json

import pytest

from operations import service
from pyinfra_run import apply
from servestack.manifest import load_manifest
from servestack.rehearse import Outcome, assign_profiles, profile_names, server_info, verify
from servestack.sandbox.lab import sandbox_manifest
from servestack.settings import settings_from_data

pytestmark = pytest.mark.integration

SERVICE_OPERATIONS = ("Unit sglang.service", "Health-gated restart of sglang.service")
STACK_OPERATIONS = ("Back up the ML environment", "Build release", "Apply SGLang source patches", "SGLang pre-start check",
                    "Activate release", "Prune old releases", "Service JIT cache directory")


def expected_arguments(lab, host, profile: str) -> list[str]:
    """What the unit must start the server with: the host's data with its profile, as the deploy reads it."""
    manifest = sandbox_manifest(lab.state_dir / "stack.toml", lab.artifacts)
    data = lab.host_data(host, manifest, {"service_profile": profile})
    return service.launch_arguments(settings_from_data(host.name, data))


def changed_operations(run) -> list[str]:
    return [op["name"] for op in json.loads(run.stdout)["results"]["operations"] if op["success"]]


def assert_serves(lab, chosen: dict[str, str]) -> None:
    for host in lab.hosts:
        info = server_info(lab, host)
        assert info["argv"] == expected_arguments(lab, host, chosen[host.name]), host.name
        assert "SGLANG_ENABLE_SPEC_V2" not in info["environment"], host.name   # gone from 0.5.14 (GLM-5's stack)


def test_a_host_of_each_profile_converges_verifies_and_then_changes_nothing(lab):
    the_lab = lab(2)
    profiles = profile_names()
    assert profiles == ["kimi-k2.5-eagle3", "glm-5-mtp"]
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
    swapped = assign_profiles(the_lab, list(reversed(profiles)))
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
