"""Each profile's stack resolved against the REAL PyPI, and SGLang's start rules checked on the result.

PyPI is reachable from every machine of this project, CI included. The resolution is the one a host
makes (sandbox/standins/closure.py): the release's own pyproject.toml and overrides.txt
(servestack/releases.py), the same uv, the stack's upload-time bound, for CPython 3.12 on x86_64
(Ubuntu 24.04, the GPU hosts' system). Only the wheels PyPI does not host (download.pytorch.org's
torch 2.9.1+cu130 family, the GitHub release of sgl-kernel +cu130, flashinfer.ai's jit cache) are
metadata-only stand-ins built from their kept Requires-Dist (kept_metadata.toml), served on loopback.

The start rules, each checked in the real artifact:
- sglang 0.5.9 refuses a multimodal model on torch 2.9.1 with cuDNN < 9.15
  (srt/server_args.py check_torch_2_9_1_cudnn_compatibility); Kimi-K2.5 is multimodal.
- the model's config type must be known where SGLang loads it: to the resolved transformers (GLM-5's
  glm_moe_dsa, loaded here with the real transformers wheel) or to sglang's own config registry
  (Kimi-K2.5's kimi_k25, srt/utils/hf_transformers_utils.py _CONFIG_REGISTRY).
"""

from __future__ import annotations

import ast
import atexit
import json
import shutil
import subprocess
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.version import Version

from sandbox.standins import closure
from sandbox.standins.pypi import fetch_wheel
from servestack.manifest import SERVER_CHOICES, load_manifest

MANIFEST = load_manifest()
PYTHON = "3.12"   # the GPU hosts' (Ubuntu 24.04)

# The config type each profile's model declares (config.json "model_type"): KimiK25Config.model_type
# in sglang 0.5.9 (srt/configs/kimi_k25.py); GLM-5's is transformers' glm_moe_dsa
# (models/auto/configuration_auto.py from 5.2.0; zai-org/GLM-5 #22: KeyError 'glm_moe_dsa' on 4.57.1).
MODEL_TYPES = {"kimi-k2.5-eagle3": "kimi_k25", "glm-5-mtp": "glm_moe_dsa", "kimi-k2.5-eagle3-0.5.14": "kimi_k25"}
# sglang's multimodal architectures (srt/configs/model_config.py multimodal_model_archs).
MULTIMODAL = {"KimiK25ForConditionalGeneration"}


@lru_cache(maxsize=4)
def resolution(profile: str, manifest: str | None = None) -> dict[str, str]:
    """{project: version} of `profile`'s stack, resolved as a host on Python 3.12 resolves it, on the
    real PyPI (the default manifest's stack, or that of the manifest file `manifest`)."""
    stacks = (load_manifest(manifest) if manifest else MANIFEST).stacks
    return closure.resolve(stacks[MANIFEST.service["profiles"][profile]["stack"]], PYTHON, manifest)


@pytest.mark.parametrize("profile", sorted(MANIFEST.service["profiles"]))
def test_every_stack_resolves_on_real_pypi_within_its_bound(profile):
    lock = resolution(profile)
    stack = MANIFEST.stacks[MANIFEST.service["profiles"][profile]["stack"]]
    for package in stack.packages:
        if package.wheel:
            continue   # a direct file: its version is its METADATA's
        assert lock[package.name] == package.version, f"{package.name}: {lock.get(package.name)}"
    print(f"{profile} ({stack.name}): {len(lock)} packages; cuDNN {lock.get('nvidia-cudnn-cu13')}, "
          f"transformers {lock['transformers']}, cuda-python {lock.get('cuda-python')}, "
          f"cuda-bindings {lock.get('cuda-bindings')}, numpy {lock.get('numpy')}")


@pytest.mark.parametrize("profile", sorted(MANIFEST.service["profiles"]))
def test_a_multimodal_model_on_torch_2_9_1_gets_cudnn_9_15_or_later(profile):
    lock = resolution(profile)
    architecture = MANIFEST.service["profiles"][profile]["model_architecture"]
    if not (Version(lock["torch"]).release[:3] == (2, 9, 1) and architecture in MULTIMODAL):
        assert Version(lock["torch"]).release[:3] != (2, 9, 1) or architecture not in MULTIMODAL
        return   # sglang's rule does not apply: nothing to hold
    assert Version(lock["nvidia-cudnn-cu13"]) >= Version("9.15"), lock["nvidia-cudnn-cu13"]


def test_without_the_cudnn_override_the_kimi_stack_gets_torchs_own_cudnn_9_13(tmp_path):
    """The negative control: the fix is what makes the rule hold."""
    text = MANIFEST.path.read_text()
    block = ('[[stacks."sglang-0.5.9".packages]]\nname = "nvidia-cudnn-cu13"\nversion = "9.16.0.29"\n'
             'index = "pypi"\nstep = 1\n\n')
    assert block in text
    (tmp_path / "stack.toml").write_text(text.replace(block, ""))
    assert resolution("kimi-k2.5-eagle3", str(tmp_path / "stack.toml"))["nvidia-cudnn-cu13"] == "9.13.0.50"


def uv() -> str:
    return shutil.which("uv") or pytest.fail("uv is not on PATH: run the tests through ./servestack.sh test")


@lru_cache(maxsize=4)
def transformers_venv(version: str) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f"transformers-{version}-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)   # the test session made it: it removes it
    venv = work / "venv"
    subprocess.run([uv(), "venv", "--quiet", "--python", "python3", str(venv)], check=True)
    subprocess.run([uv(), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
                    f"transformers=={version}"], check=True, timeout=600)
    return venv


LOAD_CONFIG = """
import json, sys, tempfile, transformers
from transformers import AutoConfig
model = tempfile.mkdtemp()
json.dump({"model_type": sys.argv[1], "architectures": [sys.argv[2]]}, open(model + "/config.json", "w"))
try:
    AutoConfig.from_pretrained(model)
except (KeyError, ValueError) as error:
    print("REFUSED", type(error).__name__, str(error).splitlines()[0])
else:
    print("LOADED", transformers.__version__)
"""


def load_config(transformers_version: str, model_type: str, architecture: str) -> str:
    python = transformers_venv(transformers_version) / "bin" / "python"
    out = subprocess.run([str(python), "-c", LOAD_CONFIG, model_type, architecture],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


REGISTRY_FILES = ("sglang/srt/utils/hf_transformers_utils.py", "sglang/srt/utils/hf_transformers/common.py")


def sglang_registered_config_types(version: str) -> set[str]:
    """The model types sglang `version` registers with transformers itself (its _CONFIG_REGISTRY)."""
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        registries = [path for path in REGISTRY_FILES if path in wheel.namelist()]   # 0.5.14 moved it to common.py
        names = {node.id for path in registries for node in ast.walk(ast.parse(wheel.read(path).decode()))
                 if isinstance(node, ast.Name)}
        types = set()
        for path in wheel.namelist():
            if path.startswith("sglang/srt/configs/") and path.endswith(".py"):
                tree = ast.parse(wheel.read(path).decode())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef) and node.name in names:
                        types |= {json.loads(json.dumps(ast.literal_eval(item.value)))
                                  for item in node.body if isinstance(item, ast.Assign)
                                  and [ast.unparse(t) for t in item.targets] == ["model_type"]}
    return types


@pytest.mark.parametrize("profile", sorted(MANIFEST.service["profiles"]))
def test_each_profiles_model_type_is_known_where_sglang_loads_its_config(profile):
    lock = resolution(profile)
    model_type = MODEL_TYPES[profile]
    if model_type in sglang_registered_config_types(lock["sglang"]):
        return   # sglang registers the config class with transformers before loading
    architecture = MANIFEST.service["profiles"][profile]["model_architecture"]
    assert load_config(lock["transformers"], model_type, architecture).startswith("LOADED")


def test_glm_5s_config_type_is_refused_by_sglang_0_5_9s_transformers():
    """Why GLM-5 is not on the reference stack: the real 4.57.1 does not know glm_moe_dsa."""
    assert "glm_moe_dsa" not in sglang_registered_config_types("0.5.9")
    said = load_config("4.57.1", "glm_moe_dsa", "GlmMoeDsaForCausalLM")
    assert said.startswith("REFUSED") and "glm_moe_dsa" in said, said


# --- the values sglang's argument parser allows (issue 32 §6) ----------------------------------------

def _module_lists(tree: ast.Module) -> dict[str, list]:
    lists = {}
    for node in tree.body:
        literal = isinstance(node, ast.Assign) and isinstance(node.value, ast.List) \
            and not any(isinstance(item, ast.Starred) for item in node.value.elts)   # [*OTHER, "x"]: not needed
        if literal and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            lists[node.targets[0].id] = ast.literal_eval(node.value)
    return lists


def sglang_server_choices(version: str) -> dict[str, list[str]]:
    """{servestack key: choices} of the real sglang `version`'s srt/server_args.py: an
    `add_argument("--flag", choices=...)` (0.5.9), or a ServerArgs field's `Arg(choices=...)` (0.5.14)."""
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        tree = ast.parse(wheel.read("sglang/srt/server_args.py").decode())
    lists, by_flag = _module_lists(tree), {flag: key for key, flag in SERVER_CHOICES.items()}
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in by_flag:
            key, calls = by_flag[node.args[0].value], [node]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SERVER_CHOICES:
            key = node.target.id
            calls = [call for call in ast.walk(node.annotation)
                     if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "Arg"]
        else:
            continue
        for call in calls:
            for keyword in call.keywords:
                if keyword.arg == "choices":
                    value = keyword.value
                    found[key] = lists[value.id] if isinstance(value, ast.Name) else ast.literal_eval(value)
    return found


@pytest.mark.parametrize("stack", sorted(MANIFEST.stacks))
def test_each_stacks_server_choices_are_its_real_sglangs(stack):
    """The manifest's [server_choices], which host data is checked against before connecting, are the
    lists in the real sglang wheel the stack pins."""
    version = MANIFEST.stacks[stack].package("sglang").version
    real = sglang_server_choices(version)
    assert set(real) == set(SERVER_CHOICES), real
    assert {key: list(values) for key, values in MANIFEST.stacks[stack].server_choices} == real


def _class_of_method(wheel: zipfile.ZipFile, method: str) -> str:
    """The config class sglang's quantization registry names for `method` (srt/layers/quantization/__init__.py)."""
    tree = ast.parse(wheel.read("sglang/srt/layers/quantization/__init__.py").decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == method and isinstance(value, ast.Name):
                    return value.id
    raise AssertionError(f"{method} is not in sglang's quantization registry")


def _min_capability(wheel: zipfile.ZipFile, class_name: str) -> int:
    """What `class_name.get_min_capability()` returns in the wheel's srt/layers/quantization: a constant, or
    another class's get_min_capability() (followed)."""
    for name in wheel.namelist():
        if name.startswith("sglang/srt/layers/quantization/") and name.endswith(".py"):
            for node in ast.walk(ast.parse(wheel.read(name).decode())):
                if isinstance(node, ast.ClassDef) and node.name == class_name:
                    method = next(item for item in node.body
                                  if isinstance(item, ast.FunctionDef) and item.name == "get_min_capability")
                    returned = next(item for item in method.body if isinstance(item, ast.Return)).value
                    if isinstance(returned, ast.Constant):
                        return returned.value
                    assert isinstance(returned, ast.Call) and isinstance(returned.func, ast.Attribute)
                    return _min_capability(wheel, returned.func.value.id)
    raise AssertionError(f"no class {class_name} in the wheel's srt/layers/quantization")


@pytest.mark.parametrize("stack", sorted(MANIFEST.stacks))
def test_each_stacks_min_capabilities_are_what_its_real_sglang_loads_on(stack):
    """Preflight refuses GPUs older than [stacks.<name>.min_capability] says (operations/preflight.py
    check_serving): each entry is its sglang's own get_min_capability for that method."""
    listed = dict(MANIFEST.stacks[stack].min_capability)
    assert listed, "each stack lists the methods of the manifest's models"
    methods = {model["quantization"] for model in MANIFEST.service["models"].values() if "quantization" in model}
    assert methods <= set(listed)
    with zipfile.ZipFile(fetch_wheel("sglang", MANIFEST.stacks[stack].package("sglang").version)) as wheel:
        assert {method: _min_capability(wheel, _class_of_method(wheel, method)) for method in listed} == listed


# --- adaptive speculation (issue 33) -------------------------------------------------------------------

ADAPTIVE_PARAMS = "sglang/srt/speculative/adaptive_spec_params.py"


def _defines_flag(node: ast.AST, flag: str) -> bool:
    """`node` defines `flag`: an `add_argument(flag, ...)` (0.5.9), or the ServerArgs field whose name
    srt/arg_groups/arg_utils.py `_field_to_cli_name` turns into it (0.5.14, L147-149)."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value == flag
    return isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == flag[2:].replace("-", "_")


def sglang_adaptive_speculation(version: str) -> bool:
    """Whether the real sglang `version` runs adaptive speculation as servestack writes its config: its
    srt/server_args.py defines --speculative-adaptive (0.5.14: L1544-1547) and a bucket's candidate steps
    may be 0, speculation off (0.5.14: srt/speculative/adaptive_spec_params.py takes any non-negative
    steps, L106-116, and its own DEFAULT_ADAPTIVE_CONFIG has [0] from 64, L41-43)."""
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        server_args = ast.parse(wheel.read("sglang/srt/server_args.py").decode())
        params = ast.parse(wheel.read(ADAPTIVE_PARAMS).decode() if ADAPTIVE_PARAMS in wheel.namelist() else "")
    if not any(_defines_flag(node, "--speculative-adaptive") for node in ast.walk(server_args)):
        return False
    defaults = next((ast.literal_eval(node.value) for node in params.body if isinstance(node, ast.AnnAssign)
                     and getattr(node.target, "id", "") == "DEFAULT_ADAPTIVE_CONFIG"), {})
    return any(0 in slot["candidate_steps"] for slot in defaults.values())


@pytest.mark.parametrize("stack", sorted(MANIFEST.stacks))
def test_each_stacks_adaptive_speculation_is_what_its_real_sglang_can_do(stack):
    """A host may ask for service_speculation = "adaptive" only on a stack whose table says
    adaptive_speculation = true (profiles.adaptive_unsupported_reason): what its real sglang can do."""
    version = MANIFEST.stacks[stack].package("sglang").version
    assert MANIFEST.stacks[stack].adaptive_speculation is sglang_adaptive_speculation(version)
