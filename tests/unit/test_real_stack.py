"""Each profile's stack resolved against the REAL PyPI, and SGLang's start rules checked on the result.

PyPI is reachable from every machine of this project, CI included. Only the wheels PyPI does not
host (download.pytorch.org's torch 2.9.1+cu130 family, the GitHub release of sgl-kernel +cu130,
flashinfer.ai's jit cache) are metadata-only stand-ins built from their kept Requires-Dist
(servestack/sandbox/standins/kept_metadata.toml), served on loopback. The resolution is the one a
host makes: the release's own pyproject.toml and overrides.txt (operations/releases.py), the same uv,
the stack's upload-time bound, for CPython 3.12 on x86_64 (Ubuntu 24.04, the GPU hosts' system).

The start rules, each checked in the real artifact:
- sglang 0.5.9 refuses a multimodal model on torch 2.9.1 with cuDNN < 9.15
  (srt/server_args.py check_torch_2_9_1_cudnn_compatibility); Kimi-K2.5 is multimodal.
- the model's config type must be known where SGLang loads it: to the resolved transformers (GLM-5's
  glm_moe_dsa, loaded here with the real transformers wheel) or to sglang's own config registry
  (Kimi-K2.5's kimi_k25, srt/utils/hf_transformers_utils.py _CONFIG_REGISTRY).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.version import Version

from operations.releases import release_plan
from servestack.manifest import load_manifest
from servestack.sandbox.artifacts import ArtifactServer
from servestack.sandbox.standins.index import write_simple_index
from servestack.sandbox.standins.pypi import fetch_wheel
from servestack.sandbox.standins.wheels import build_wheel, kept_metadata, standin_wheel
from servestack.settings import settings_from_data

MANIFEST = load_manifest()
PYTHON = "3.12"
PLATFORM = "x86_64-manylinux_2_35"
TAG = "cp312-cp312-manylinux_2_28_x86_64"   # the tag of the real cp312 torch-family wheels

# The config type each profile's model declares (config.json "model_type"): KimiK25Config.model_type
# in sglang 0.5.9 (srt/configs/kimi_k25.py); GLM-5's is transformers' glm_moe_dsa
# (models/auto/configuration_auto.py from 5.2.0; zai-org/GLM-5 #22: KeyError 'glm_moe_dsa' on 4.57.1).
MODEL_TYPES = {"kimi-k2.5-eagle3": "kimi_k25", "glm-5-mtp": "glm_moe_dsa"}
# sglang's multimodal architectures (srt/configs/model_config.py multimodal_model_archs).
MULTIMODAL = {"KimiK25ForConditionalGeneration"}


def uv() -> str:
    found = shutil.which("uv")
    if not found:
        pytest.fail("uv is not on PATH: run the tests through ./servestack.sh test, which installs it")
    return found


def _unreachable_wheels(dest: Path) -> dict[str, Path]:
    """Metadata-only stand-ins, tagged for PYTHON, of every kept wheel PyPI does not host."""
    built = {}
    for key in kept_metadata():
        name, version = key.split("==")
        if "+" not in version:
            continue   # PyPI hosts it: the real one is resolved
        spec = dataclasses.replace(standin_wheel(name, version), requires=tuple(kept_metadata()[key]["requires"]))
        if spec.tag.startswith("cp311"):
            spec = dataclasses.replace(spec, tag=TAG)
        built[name] = build_wheel(spec, dest)
    return built


@lru_cache(maxsize=4)
def resolution(profile: str, manifest: str | None = None) -> dict[str, str]:
    """{project: version} of `profile`'s stack, resolved as a host resolves it, on real PyPI (the
    default manifest's, or that of the manifest file `manifest`)."""
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="real-stack-"))
    wheels = _unreachable_wheels(work / "wheels")
    write_simple_index(work / "torch", [w for n, w in wheels.items() if n.startswith("torch")])
    write_simple_index(work / "flashinfer", [w for n, w in wheels.items() if n.startswith("flashinfer")])
    with ArtifactServer(work) as server:
        data = {"service_profile": profile, "index_torch_url": f"{server.url}/torch",
                "index_flashinfer_url": f"{server.url}/flashinfer", **({"servestack_manifest": manifest} if manifest else {})}
        if "sgl-kernel" in wheels:
            data["wheel_url_sgl_kernel"] = f"{server.url}/wheels/{wheels['sgl-kernel'].name}"
        plan = release_plan(settings_from_data("real-1", data), "x86_64", f"{PYTHON}.3")
        for name, text in plan.files.items():
            (work / name).write_text(text)
        out = subprocess.run(
            [uv(), "pip", "compile", "pyproject.toml", "--quiet", "--no-config", "--overrides", "overrides.txt",
             "--python-version", PYTHON, "--python-platform", PLATFORM, "--no-header", "--index-strategy",
             "first-index", *plan.bound, "-o", "lock.txt"],
            cwd=work, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lock = {}
    for line in (work / "lock.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            lock[name.strip().lower()] = version.strip() or line.split(" @ ")[0]
    shutil.rmtree(work, ignore_errors=True)
    return lock


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
    block = '[[stacks."sglang-0.5.9".packages]]\nname = "nvidia-cudnn-cu13"\nversion = "9.16.0.29"\nindex = "pypi"\nstep = 1\n\n'
    assert block in text
    (tmp_path / "stack.toml").write_text(text.replace(block, ""))
    assert resolution("kimi-k2.5-eagle3", str(tmp_path / "stack.toml"))["nvidia-cudnn-cu13"] == "9.13.0.50"


@lru_cache(maxsize=4)
def transformers_venv(version: str) -> Path:
    import tempfile
    venv = Path(tempfile.mkdtemp(prefix=f"transformers-{version}-")) / "venv"
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


def sglang_registered_config_types(version: str) -> set[str]:
    """The model types sglang `version` registers with transformers itself (its _CONFIG_REGISTRY)."""
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        registry = wheel.read("sglang/srt/utils/hf_transformers_utils.py").decode()
        names = {node.id for node in ast.walk(ast.parse(registry)) if isinstance(node, ast.Name)}
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
