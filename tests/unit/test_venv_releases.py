"""Release ids, resolution inputs, diffs and rollback/prune decisions (control machine, no host)."""

import base64
import json
import re
import inspect
import shlex
import subprocess
import sys

import pytest

from servestack.errors import ConfigError
from servestack.manifest import load_manifest
from facts.venv import guarded_tool_command, tool_command
from operations import venv as venv_step
from servestack.releases import (
    CHECK, TOOL, NoRollbackTarget, encode, format_diff,
    package_diff, python_series, release_plan, releases_to_prune, rollback_target, upload_bound,
)
from servestack.scripts import script_text
from servestack.settings import settings_from_data


def settings(**data):
    return settings_from_data("gpu-1", data)


def plan(arch="x86_64", python="3.11.2", **data):
    return release_plan(settings(**data), arch, python)


def test_release_id_is_r_and_12_hex_and_deterministic():
    first, second = plan(), plan()
    assert re.fullmatch(r"r-[0-9a-f]{12}", first.id)
    assert first.id == second.id
    assert first.dir == f"{load_manifest().venv['releases_dir']}/{first.id}"
    assert first.python == f"{first.dir}/venv/bin/python"


def test_release_id_ignores_python_patch_level_but_not_series_or_arch():
    assert plan(python="3.11.2").id == plan(python="3.11.9").id
    assert plan(python="3.11.2").id != plan(python="3.12.3").id
    assert plan(arch="x86_64").id != plan(arch="aarch64").id


def test_release_id_follows_sources_so_a_mirror_is_a_new_release():
    assert plan().id != plan(index_torch_url="https://mirror.internal/torch/cu130").id
    assert plan().id == plan(venv_keep_releases=7).id  # not an input


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ConfigError, match="gpu-1.*sgl-kernel.*'ppc64le'"):
        plan(arch="ppc64le")


def reference():
    return settings().stack


def test_pyproject_pins_explicit_indexes_to_their_packages_only():
    text = plan().files["pyproject.toml"]
    manifest = load_manifest()
    for package in reference().packages:
        assert json.dumps(f"{package.name}=={package.version}") in text
        if package.index and package.index != "pypi":
            assert f'{package.name} = {{ index = "{package.index}" }}' in text
        if package.wheel:
            assert f'{package.name} = {{ url = "{package.wheel["x86_64"]}" }}' in text
    assert text.count("explicit = true") == 2  # torch and flashinfer, never the default index
    assert f'url = "{manifest.indexes["pypi"]}"\ndefault = true' in text
    assert "unsafe" not in text


def test_overrides_make_flashinfer_064_win_over_sglangs_pin():
    lines = [line for line in plan().files["overrides.txt"].splitlines() if not line.startswith("#")]
    stack = reference()
    assert f"flashinfer-python=={stack.package('flashinfer-python').version}" in lines
    assert f"flashinfer-cubin=={stack.package('flashinfer-cubin').version}" in lines
    assert f"sgl-kernel @ {stack.package('sgl-kernel').wheel['x86_64']}" in lines
    # the cuDNN sglang 0.5.9 needs for a multimodal model on torch 2.9.1 wins over torch's own pin
    assert "nvidia-cudnn-cu13==9.16.0.29" in lines
    # overriding a package drops its index source in uv: explicit-index pins are not overridden
    assert not any(line.startswith(("torch", "flashinfer-jit-cache")) for line in lines)


def test_every_url_comes_from_settings():
    mirrored = plan(index_pypi_url="https://m.internal/pypi/simple", index_torch_url="https://m.internal/t",
                    index_flashinfer_url="https://m.internal/f",
                    wheel_url_sgl_kernel="https://m.internal/sgl_kernel-0.3.21+cu130-cp310-abi3-manylinux2014_x86_64.whl")
    text = mirrored.files["pyproject.toml"] + mirrored.files["overrides.txt"]
    assert re.findall(r"https?://[^\s\"]+", text) and all(
        url.startswith("https://m.internal/") for url in re.findall(r"https?://[^\s\"]+", text))


def test_expectations_come_from_the_manifest():
    expect = plan().expect
    stack = reference()
    assert expect["packages"] == {p.name: p.version for p in stack.packages}
    assert expect["torch_cuda"] == stack.torch_cuda == "13.0"
    assert expect["imports"] == ["flashinfer", "sglang"]
    # the sgl-kernel file says +cu130, its METADATA 0.3.21: the file is checked by name
    assert expect["packages"]["sgl-kernel"] == "0.3.21"
    assert expect["wheels"] == {"sgl-kernel": "sgl_kernel-0.3.21+cu130-cp310-abi3-manylinux2014_x86_64.whl"}
    assert plan().steps == {p.name: p.step for p in stack.packages}


def test_each_profile_builds_the_release_of_its_own_stack():
    kimi, glm = plan(service_profile="kimi-k2.5-eagle3"), plan(service_profile="glm-5-mtp")
    assert kimi.id != glm.id
    assert (kimi.inputs["stack"], glm.inputs["stack"]) == ("sglang-0.5.9", "sglang-0.5.14")
    assert glm.expect["packages"]["torch"] == "2.11.0" and glm.expect["torch_cuda"] == "13.0"
    assert glm.expect["packages"]["transformers"] == "5.8.1"
    assert kimi.expect["packages"]["transformers"] == "4.57.1"
    # a host may name another stack for its profile; that is a different release
    assert plan(service_profile="kimi-k2.5-eagle3", service_stack="sglang-0.5.14", service_patches=[]).id \
        != kimi.id


def test_the_resolution_is_bounded_by_the_stacks_upload_time_except_other_indexes_exact_pins():
    kimi, glm = plan(), plan(service_profile="glm-5-mtp")
    assert kimi.bound == ["--exclude-newer", "2026-02-24T00:00:00Z",
                          "--exclude-newer-package", "flashinfer-jit-cache=false",
                          "--exclude-newer-package", "torch=false",
                          "--exclude-newer-package", "torchaudio=false",
                          "--exclude-newer-package", "torchvision=false"]
    assert glm.bound == ["--exclude-newer", "2026-06-27T00:00:00Z"]   # all from PyPI
    assert kimi.inputs["exclude_newer"] == "2026-02-24T00:00:00Z"     # an input: it is in the release id
    assert upload_bound({**kimi.inputs, "exclude_newer": "2026-01-01T00:00:00Z"})[1] == "2026-01-01T00:00:00Z"


def test_python_series():
    assert python_series("3.11.2") == "3.11"


def test_tool_command_ships_the_tool_and_its_params():
    command = tool_command("python3", "packages", {"venv_path": "/opt/ml-env"})
    words = shlex.split(command)
    assert words[:5] == ["python3", "-I", "-S", "-c", script_text(TOOL)] and words[5] == "packages"
    assert json.loads(base64.b64decode(words[6])) == {"venv_path": "/opt/ml-env"} and len(words) == 7
    guarded = guarded_tool_command("python3", "state", {})
    assert guarded == f"if command -v python3 >/dev/null 2>&1; then {tool_command('python3', 'state', {})}; fi"


def test_the_release_check_travels_in_the_tools_text_not_its_parameters(tmp_path):
    """The venv tool runs files/scripts/check_release.py in the release's python: its text is in the
    tool's text as sent (servestack/scripts.py), so the tool needs no file beside it on the host."""
    sent = script_text(TOOL)
    assert f"\nCHECK_SCRIPT = {CHECK.read_text()!r}\n" in sent and not re.search(r'= text_beside\("', sent)
    run = subprocess.run([sys.executable, "-I", "-S", "-c", sent], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.startswith("usage: ml_env.py"), run.stderr   # not a NameError
    assert "check_script" not in inspect.getsource(venv_step.build_release)


def test_encode_is_shell_safe():
    assert re.fullmatch(r"[A-Za-z0-9+/=]+", encode({"x": "it's \"quoted\" $HOME `x`"}))


def test_package_diff_shows_local_label_changes():
    before = {"torch": "2.9.1+cu128", "numpy": "2.1.0", "old-thing": "1.0"}
    after = {"torch": "2.9.1+cu130", "numpy": "2.1.0", "sglang": "0.5.9"}
    diff = package_diff(before, after)
    assert diff == {"added": [("sglang", "0.5.9")], "removed": [("old-thing", "1.0")],
                    "changed": [("torch", "2.9.1+cu128", "2.9.1+cu130")]}
    text = format_diff(diff, "/opt/ml-env (venv)", "/opt/ml-env (release r-1)", partial=False)
    assert "~ torch 2.9.1+cu128 -> 2.9.1+cu130" in text and "+ sglang==0.5.9" in text
    assert "- old-thing==1.0" in text


def test_package_diff_compares_names_canonically():
    assert package_diff({"Flashinfer_Python": "0.6.3"}, {"flashinfer-python": "0.6.4"})["changed"] == [
        ("flashinfer-python", "0.6.3", "0.6.4")]


def test_package_diff_from_nothing():
    assert package_diff(None, {"torch": "1"})["added"] == [("torch", "1")]


OK = {"status": "ok", "has_venv": True}


def test_rollback_refuses_without_history():
    with pytest.raises(NoRollbackTarget, match="nothing to roll back to"):
        rollback_target([], {"r-aaaaaaaaaaaa": OK}, "r-aaaaaaaaaaaa", None)


def test_rollback_refuses_when_the_first_deploy_had_no_predecessor():
    history = [{"release": "r-new", "previous": None, "by": "deploy"}]
    with pytest.raises(NoRollbackTarget, match="nothing to roll back to"):
        rollback_target(history, {"r-new": OK}, "r-new", None)


def test_rollback_targets_the_release_before_the_last_deploy_and_is_idempotent():
    history = [{"release": "adopted-1", "previous": None, "by": "adopt"},
               {"release": "r-new", "previous": "adopted-1", "by": "deploy"}]
    releases = {"adopted-1": OK, "r-new": OK}
    assert rollback_target(history, releases, "r-new", None) == "adopted-1"
    history.append({"release": "adopted-1", "previous": "r-new", "by": "rollback"})
    assert rollback_target(history, releases, "adopted-1", None) == "adopted-1"  # a second run: no-op


def test_rollback_to_an_explicit_release():
    releases = {"r-a": OK, "r-b": OK}
    assert rollback_target([], releases, "r-b", "r-a") == "r-a"


def test_rollback_refuses_a_pruned_or_failed_target():
    history = [{"release": "r-new", "previous": "r-old", "by": "deploy"}]
    with pytest.raises(NoRollbackTarget, match="not kept on the host"):
        rollback_target(history, {"r-new": OK}, "r-new", None)
    with pytest.raises(NoRollbackTarget, match="'failed'"):
        rollback_target(history, {"r-new": OK, "r-old": {"status": "failed", "has_venv": True}}, "r-new", None)


def test_prune_keeps_active_previous_and_adopted():
    releases = {"adopted-1": {**OK, "adopted": True, "created": "20260101T000000Z"},
                "r-1": {**OK, "created": "20260102T000000Z"}, "r-2": {**OK, "created": "20260103T000000Z"},
                "r-3": {**OK, "created": "20260104T000000Z"}, "r-4": {**OK, "created": "20260105T000000Z"},
                "r-bad": {"status": "failed", "created": "20260101T100000Z"}}
    history = [{"release": "adopted-1", "previous": None, "by": "adopt"},
               {"release": "r-1", "previous": "adopted-1", "by": "deploy"},
               {"release": "r-2", "previous": "r-1", "by": "deploy"},
               {"release": "r-3", "previous": "r-2", "by": "deploy"},
               {"release": "r-4", "previous": "r-3", "by": "deploy"}]
    assert sorted(releases_to_prune(releases, history, "r-4", 2)) == ["r-1", "r-2", "r-bad"]
    assert sorted(releases_to_prune(releases, history, "r-4", 3)) == ["r-1", "r-bad"]
    # after a rollback to r-3 the previous (r-4) is kept as well
    history.append({"release": "r-3", "previous": "r-4", "by": "rollback"})
    assert "r-4" not in releases_to_prune(releases, history, "r-3", 1)
    assert "r-3" not in releases_to_prune(releases, history, "r-3", 1)
