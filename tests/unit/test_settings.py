"""The manifest and host data are validated before any connection, with one clear line per problem."""

import copy
import dataclasses
import re
import subprocess
import sys
import tomllib
import types
import typing
from pathlib import Path

import pytest

from servestack.errors import ConfigError
from servestack.keys import host_keys, index_key, wheel_key
from servestack.manifest import DEFAULT_MANIFEST, load_manifest, parse_manifest
from servestack.settings import Settings, settings_from_data, validate_inventory
from servestack.targets import refuse_local_targets

ROOT = Path(__file__).resolve().parents[2]
RAW = tomllib.loads(DEFAULT_MANIFEST.read_text())


def broken(edit) -> dict:
    data = copy.deepcopy(RAW)
    edit(data)
    return data


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as error:
        parse_manifest(Path("stack.toml"), data)
    return str(error.value)


def test_the_shipped_manifest_holds_every_pin():
    manifest = load_manifest()
    runfile = manifest.runfiles["x86_64"]
    assert runfile.size == 4302469087
    assert runfile.file == "cuda_13.0.1_580.82.07_linux.run"
    assert manifest.runfiles["aarch64"].file.endswith("_linux_sbsa.run")
    assert manifest.cuda["nvcc_version"] == "13.0.88"
    assert manifest.cuda["min_driver"] == "580.82.07"
    assert manifest.cuda["keep"] == ["12.8"]
    reference, current = manifest.stacks["sglang-0.5.9"], manifest.stacks["sglang-0.5.14"]
    assert reference.package("torch").version == "2.9.1+cu130"
    assert reference.package("flashinfer-jit-cache").index == "flashinfer"
    assert reference.package("nvidia-cudnn-cu13").version == "9.16.0.29"
    assert (current.package("torch").version, current.package("transformers").version) == ("2.11.0", "5.8.1")
    assert (reference.torch_cuda, current.torch_cuda) == ("13.0", "13.0")
    for stack in (reference, current):
        assert [package.step for package in stack.packages] == sorted(p.step for p in stack.packages)


def REF(data):
    return data["stacks"]["sglang-0.5.9"]


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["cuda"]["runfile"]["x86_64"].update(md5="xyz"),
     "'cuda.runfile.x86_64.md5': expected 32 lowercase hex"),
    (lambda d: d["cuda"]["runfile"]["x86_64"].update(sha256="A" * 64), "'cuda.runfile.x86_64.sha256': expected 64"),
    (lambda d: d["cuda"]["runfile"]["x86_64"].update(size="4302469087"),
     "'cuda.runfile.x86_64.size': expected a positive integer"),
    (lambda d: d["cuda"]["runfile"]["x86_64"].update(url="ftp://x/y.run"),
     "'cuda.runfile.x86_64.url': expected an http(s) URL"),
    (lambda d: d["cuda"]["runfile"]["x86_64"].update(url="https://h/other.run"),
     "expected a URL ending in /cuda_13.0.1"),
    (lambda d: d["cuda"]["runfile"].update(ppc64le=d["cuda"]["runfile"]["x86_64"]),
     "'cuda.runfile.ppc64le': expected one of the known keys"),
    (lambda d: d["cuda"].update(version="13.x"), "'cuda.version': expected a PEP 440 version"),
    (lambda d: d["cuda"].update(nvcc_version="12.8.93"),
     "'cuda.nvcc_version': expected a version of the 13.0.1 toolkit"),
    (lambda d: d["cuda"].update(keep=["12"]), "'cuda.keep': expected toolkit versions like '12.8'"),
    (lambda d: d["cuda"].update(install_path="usr/local/cuda-13.0"), "'cuda.install_path': expected an absolute path"),
    (lambda d: d["cuda"].pop("min_driver"), "'cuda.min_driver': expected a version string like '13.0.1' (missing)"),
    (lambda d: d["cuda"].update(colour="blue"), "'cuda.colour': expected one of the known keys"),
    (lambda d: d.update(extra={}), "'extra': expected one of the known keys"),
    (lambda d: REF(d)["packages"][0].update(version="2.9.1+cu 130"),
     "'stacks.sglang-0.5.9.packages[0].version': expected a PEP 440 version"),
    (lambda d: REF(d)["packages"][0].update(index="nowhere"),
     "'stacks.sglang-0.5.9.packages[0].index': expected one of the [indexes] names"),
    (lambda d: REF(d)["packages"].append(dict(REF(d)["packages"][0])),
     "'stacks.sglang-0.5.9.packages': expected each package once"),
    (lambda d: REF(d).update(exclude_newer="2026-02-24"),
     "'stacks.sglang-0.5.9.exclude_newer': expected an RFC 3339 UTC time"),
    (lambda d: REF(d).update(torch_cuda="12.8"),
     "'stacks.sglang-0.5.9.packages': expected torch's local label to name the stack's torch_cuda 12.8"),
    (lambda d: REF(d).update(adaptive_speculation="yes"),
     "'stacks.sglang-0.5.9.adaptive_speculation': expected true or false, got 'yes'"),
    (lambda d: d.update(stacks={}), "'stacks': expected at least one stack table"),
    (lambda d: d["gpu"].update(count=0), "'gpu.count': expected a positive integer"),
    (lambda d: d.update(schema=2), "'schema': expected the schema number 1"),
])
def test_each_kind_of_bad_manifest_is_refused_naming_the_key(edit, expected):
    assert expected in refused(broken(edit))


def test_a_manifest_that_is_not_toml_names_the_file(tmp_path):
    bad = tmp_path / "stack.toml"
    bad.write_text("[cuda\nversion = 1")
    load_manifest.cache_clear()
    with pytest.raises(ConfigError, match="stack.toml: not valid TOML"):
        load_manifest(bad)


def refused_host(data: dict) -> str:
    with pytest.raises(ConfigError) as error:
        settings_from_data("gpu-7", data)
    return str(error.value)


@pytest.mark.parametrize("data, expected", [
    ({"gpu_count": "8"}, "host gpu-7: 'gpu_count': expected an integer from 1 to 64, got '8'"),
    ({"service_port": 70000}, "'service_port': expected an integer from 1 to 65535, got 70000"),
    ({"service_tp": True}, "'service_tp': expected an integer from 1 to 64, got True"),
    ({"cuda_mirorr": "http://m/"}, "'cuda_mirorr': unknown servestack key (did you mean 'cuda_mirror'?)"),
    ({"cuda_mirror": "mirror.internal/cuda"}, "'cuda_mirror': expected an http(s):// or file:// URL"),
    ({"cuda_link_policy": "latest"}, "'cuda_link_policy': expected one of 'keep', 'new'"),
    ({"gpu_compute_capability": "sm120"}, "'gpu_compute_capability': expected a compute capability string like '12.0'"),
    ({"service_tp": 3}, "'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 3"),
    ({"gpu_count": 4}, "'service_tp': expected a tensor-parallel size that divides gpu_count=4, got 8"),
    ({"service_speculative_num_draft_tokens": 5},
     "expected speculative_num_steps + 1 = 4 when speculative_eagle_topk is 1, got 5"),
    ({"cuda_version": "13.1.0"}, "'cuda_version': no runfile entry for CUDA 13.1.0 in stack.toml (it has 13.0.1)"),
    ({"service_env": {"NCCL P2P": "1"}}, "'service_env': expected a dict of environment variable names"),
    ({"service_name": "sglang"}, "'service_name': expected a systemd unit name ending in .service"),
    ({"servestack_manifest": "/nonexistent/stack.toml"},
     "host gpu-7: /nonexistent/stack.toml: manifest file not found"),
    ({"cuda_mirror": "http://m/", "cuda_runfile_url": "http://m/x.run"}, "set either cuda_runfile_url or cuda_mirror"),
])
def test_each_kind_of_bad_host_data_is_refused_naming_host_and_key(data, expected):
    assert expected in refused_host(data)


def test_every_problem_is_reported_at_once():
    message = refused_host({"gpu_count": "x", "service_port": -1, "venv_path": "relative"})
    assert message.count("host gpu-7:") == 3


def test_three_bad_values_give_three_lines():
    """A wrong type does not hide a consistency problem (issue 16: only two of these showed)."""
    message = refused_host({"service_tp": 3, "service_port": -1, "rollout_batch": 0})
    assert message.splitlines() == [
        "host gpu-7: 'rollout_batch': expected an integer from 1 to 1000, got 0",
        "host gpu-7: 'service_port': expected an integer from 1 to 65535, got -1",
        "host gpu-7: 'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 3",
    ]


def test_a_consistency_check_waits_only_for_the_keys_it_reads():
    message = refused_host({"gpu_count": "eight", "service_speculative_num_draft_tokens": 9})
    assert "'gpu_count': expected an integer from 1 to 64, got 'eight'" in message
    assert "expected speculative_num_steps + 1 = 4 when speculative_eagle_topk is 1, got 9" in message
    assert "divides gpu_count" not in message  # gpu_count is wrong: no verdict on service_tp


def test_a_manifest_error_names_the_whole_path_of_the_file(tmp_path):
    manifest = tmp_path / "stack.toml"
    text = DEFAULT_MANIFEST.read_text()
    manifest.write_text(re.sub(r"(?m)^(\[uv\]\n)version = .*\n", r"\1", text))
    with pytest.raises(ConfigError) as error:
        load_manifest(manifest)
    assert str(error.value) == f"{manifest}: key 'uv.version': expected a version string like '13.0.1' (missing)"


def test_foreign_keys_are_left_to_their_owners():
    settings = settings_from_data("gpu-7", {"ssh_user": "ubuntu", "_sudo": True, "my_team": "infra"})
    assert settings.service_port == 30000


def test_overrides_apply_and_defaults_come_from_the_manifest():
    settings = settings_from_data("gpu-7", {"cuda_mirror": "https://mirror.internal/cuda/",
                                            "index_torch_url": "https://mirror.internal/torch/cu130",
                                            "service_tp": 4})
    manifest = load_manifest()
    runfile = settings.runfile("x86_64")
    assert runfile.url == "https://mirror.internal/cuda/" + manifest.runfiles["x86_64"].file
    assert (runfile.size, runfile.sha256) == (manifest.runfiles["x86_64"].size, manifest.runfiles["x86_64"].sha256)
    assert settings.index_url("torch") == "https://mirror.internal/torch/cu130"
    assert settings.index_url("pypi") == manifest.indexes["pypi"]
    kernel = settings.package("sgl-kernel")
    assert settings.wheel_url(kernel, "aarch64") == kernel.wheel["aarch64"]
    assert settings.service_tp == 4
    assert settings.service_model_path == manifest.service["profiles"][manifest.service["profile"]]["model_path"]


# Settings fields that hold the URL keys of the manifest's indexes and wheels, one per index or wheel.
URL_MAPS = {"index_urls": lambda manifest: {index_key(name) for name in manifest.indexes},
            "wheel_urls": lambda manifest: {wheel_key(p.name) for p in manifest.all_packages() if p.wheel}}


def field_of(key: str, manifest) -> str:
    return next((field for field, keys in URL_MAPS.items() if key in keys(manifest)), key)


def test_settings_declare_a_typed_field_for_every_host_data_key():
    """Issue 34: a reader and mypy follow declared fields, not a dict behind __getattr__. Every key
    host_keys declares has its field and every field but the host's name and manifest is a key's."""
    manifest = load_manifest()
    declared = {field.name for field in dataclasses.fields(Settings)} - {"host_name", "manifest"}
    assert declared == {field_of(key, manifest) for key in host_keys(manifest)}
    assert "__getattr__" not in vars(Settings)


def conforms(value, hint) -> bool:
    """Whether `value` is of the type `hint` declares (exactly: a bool is no int here)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:
        return any(conforms(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1])
                                               for k, v in value.items())
    return type(value) is hint


@pytest.mark.parametrize("profile", sorted(load_manifest().service["profiles"]))
def test_every_value_has_its_fields_type(profile):
    settings = settings_from_data("gpu-7", {"service_profile": profile, "cuda_mirror": "https://mirror.internal/",
                                            "service_env": {"NCCL_DEBUG": 1}, "servestack_user_keys": ["cpu_count"]})
    hints = typing.get_type_hints(Settings)
    for key, value in settings.values.items():
        field = field_of(key, settings.manifest)
        hint = hints[field] if field == key else typing.get_args(hints[field])[1]
        assert conforms(value, hint), (key, value, hint)


class FakeHost:
    def __init__(self, name, data):
        self.name = name
        self.data = FakeData(data)


class FakeData(dict):
    def dict(self):
        return dict(self)


def test_inventory_validation_lists_every_bad_host():
    hosts = [FakeHost("a", {"gpu_count": 0}), FakeHost("b", {}), FakeHost("c", {"service_port": "x"})]
    with pytest.raises(ConfigError) as error:
        validate_inventory(hosts)
    assert "host a: 'gpu_count'" in str(error.value) and "host c: 'service_port'" in str(error.value)
    assert "host b" not in str(error.value)


@pytest.mark.parametrize("name, data", [
    ("@local", {}), ("localhost", {}), ("box", {"ssh_hostname": "127.0.0.1"}), ("box", {"ssh_hostname": "::1"}),
    ("gpu-node-01.example", {}),
])
def test_the_machine_running_pyinfra_is_never_a_silent_target(name, data):
    with pytest.raises(ConfigError, match="refusing to run"):
        refuse_local_targets([FakeHost(name, data)])


def test_local_target_allowed_when_asked():
    refuse_local_targets([FakeHost("@local", {"servestack_allow_local": True})])


def run_pyinfra(*args):
    return subprocess.run([str(Path(sys.executable).parent / "pyinfra"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_pyinfra_cli_refuses_bad_data_before_connecting():
    result = run_pyinfra("--data", "service_port=0", "inventory.py", "deploy.py", "--dry")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "'service_port': expected an integer from 1 to 65535" in output
    assert "Connecting to hosts" not in output


def test_example_inventory_is_refused_until_edited():
    result = run_pyinfra("inventory.py", "deploy.py", "--dry")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "placeholder from the example inventory: edit inventory.py" in output
    assert "Connecting to hosts" not in output
