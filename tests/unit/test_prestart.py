"""SGLang's pre-start check (files/scripts/sglang-prestart.py) and how it is sent: what it says
without SGLang, without arguments, and how it tells a refusal from what the host cannot show.
Its real runs against the real sglang 0.5.9 / 0.5.14 code are tests/integration/test_stacks.py."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest

from facts.framing import split
from sandbox.standins.closure import requirements_closure
from servestack.scripts import SCRIPTS, python_script_command, script_text
from tests.unit.sglang_venv import sglang_python

SCRIPT = SCRIPTS / "sglang-prestart.py"
SENT = script_text("sglang-prestart.py")   # the text the host runs
RESULT = "result"   # the section the script prints its result in (facts/framing.py)


@pytest.fixture(scope="module")
def prestart():
    spec = importlib.util.spec_from_file_location("sglang_prestart", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(params: dict | None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-I", "-c", SENT] + ([json.dumps(params)] if params is not None else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def result_of(out: subprocess.CompletedProcess) -> dict:
    return json.loads(split(out.stdout.splitlines())[RESULT].text)


def test_without_its_parameters_it_exits_2_with_its_usage():
    out = run(None)
    assert out.returncode == 2 and out.stderr.startswith("usage: sglang-prestart.py PARAMS_JSON")


def test_a_python_without_sglang_is_refused_naming_the_release_and_profile():
    """An interpreter where SGLang does not import is one the server cannot start on."""
    out = run({"release": "r-0123456789ab", "profile": "glm-5-mtp", "argv": ["--model-path", "m"], "env": {}})
    assert out.returncode == 1
    assert out.stderr.strip() == ("servestack: SGLang refuses release r-0123456789ab (profile glm-5-mtp): "
                                  "ModuleNotFoundError: No module named 'sglang'")
    result = result_of(out)
    assert result == {"sglang": None, "checked": [], "not_checked": [],
                      "refused": "ModuleNotFoundError: No module named 'sglang'"}


def test_sglangs_framed_coloured_message_is_kept_in_its_words_on_one_line(prestart):
    """sglang 0.5.9's cuDNN refusal: ANSI colours, a line of dashes, then the environment."""
    error = RuntimeError("\033[91m\033[1mCRITICAL WARNING: PyTorch 2.9.1 & CuDNN Compatibility Issue Detected\n"
                         "-----------------------------------------------------------------\n"
                         "Current Environment: PyTorch 2.9.1+cu130 | CuDNN 9.13\n\nIssue: ...\033[0m")
    assert prestart.first_line(error) == ("RuntimeError: CRITICAL WARNING: PyTorch 2.9.1 & CuDNN Compatibility Issue "
                                          "Detected | Current Environment: PyTorch 2.9.1+cu130 | CuDNN 9.13")


@pytest.mark.parametrize("error, needs_gpu, missing", [
    (RuntimeError("Found no NVIDIA driver on your system. Please check ..."), True, False),   # real torch
    (RuntimeError("0 active drivers ([]). There should only be one."), True, False),          # real triton
    (RuntimeError("No accelerator (CUDA, XPU, HPU, NPU, MUSA) is available."), True, False),  # sglang get_device
    # the serving server holds the GPUs: exclusive compute mode, or its memory (real torch's words)
    (RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable"), True, False),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB"), True, False),
    (OSError("/models/k does not appear to have a file named configuration_kimi_k25.py"), False, True),
    (ValueError("The checkpoint you are trying to load has model type `glm_moe_dsa` but Transformers does not "
                "recognize this architecture."), False, False),
    (AssertionError("tp_size must be divisible by number of nodes"), False, False),
])
def test_what_needs_a_gpu_or_a_file_is_told_apart_from_a_refusal(prestart, error, needs_gpu, missing):
    assert (prestart.needs_a_gpu(error), prestart.is_missing_file(error)) == (needs_gpu, missing)


def test_it_travels_in_the_command_to_the_releases_own_python():
    command = python_script_command("/opt/servestack/releases/r-0123456789ab/venv/bin/python", "sglang-prestart.py",
                                    json.dumps({"argv": ["--model-path", "a b"]}))
    assert shlex.split(command) == ["/opt/servestack/releases/r-0123456789ab/venv/bin/python", "-I", "-c",
                                    SENT, '{"argv": ["--model-path", "a b"]}']


def test_the_real_wheels_a_sandbox_serves_are_what_its_roots_need_never_past_a_stand_in():
    metadata = {
        "transformers": {"requires_dist": ["huggingface-hub<1.0,>=0.34.0", "numpy>=1.17",
                                           "torch>=2.2; extra == \"torch\"", "tokenizers<=0.23,>=0.22"]},
        "huggingface-hub": {"requires_dist": ["hf-xet<2.0.0,>=1.1.3; platform_machine == \"x86_64\"",
                                              "InquirerPy==0.3.4; extra == \"cli\""]},
        "compressed-tensors": {"requires_dist": ["torch>=1.7.0", "loguru"]},
        "numpy": {"requires_dist": []}, "tokenizers": {"requires_dist": []}, "hf-xet": {"requires_dist": []},
        "loguru": {"requires_dist": ["colorama>=0.3.4; sys_platform == \"win32\""]},
        "colorama": {"requires_dist": []}, "torch": {"requires_dist": ["triton==3.5.1"]},
        "inquirerpy": {"requires_dist": []}, "triton": {"requires_dist": []},
    }
    assert requirements_closure({"transformers", "compressed-tensors"}, metadata, stop={"torch"}) == {
        "transformers", "huggingface-hub", "numpy", "tokenizers", "hf-xet", "compressed-tensors", "loguru"}
    assert "torch" in requirements_closure({"compressed-tensors"}, metadata)   # without the stop, it would follow


# --- SGLang's own code in the release's python (a venv of the stack as the sandbox serves it) ------------

KIMI_CONFIG = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]}
GLM_CONFIG = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"]}
# As a repository whose tokenizer is its own code declares it (transformers' auto_map)
CODE_TOKENIZER = {"tokenizer_class": "TikTokenTokenizer",
                  "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}


def model_dir(tmp_path, config: dict, tokenizer: dict | None = None):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return directory


def check_release(version: str, argv: list[str]) -> tuple[int, dict, str]:
    python = sglang_python(version)
    params = {"release": "r-0123456789ab", "profile": "p", "argv": argv, "env": {}}
    out = subprocess.run([str(python), "-I", "-c", SENT, json.dumps(params)], capture_output=True,
                         text=True, timeout=300)
    return out.returncode, result_of(out), out.stderr


def test_sglang_0_5_9_checks_kimi_with_cudnn_9_16_and_says_what_needs_a_gpu(tmp_path):
    code, result, _ = check_release("0.5.9", ["--model-path", str(model_dir(tmp_path, KIMI_CONFIG)), "--tp", "8",
                                              "--trust-remote-code"])
    assert code == 0 and result["refused"] is None
    assert result["checked"][1:] == [f"ServerArgs ({tmp_path / 'model'}'s model config, every setting)",
                                     "check_server_args"]
    assert any(line.startswith("no GPU is visible here") for line in result["not_checked"])


def test_sglang_0_5_9_refuses_glm_5s_config_in_transformers_words(tmp_path):
    code, result, said = check_release("0.5.9", ["--model-path", str(model_dir(tmp_path, GLM_CONFIG)), "--tp", "8"])
    assert code == 1
    assert result["refused"].startswith("ValueError: The checkpoint you are trying to load has model type "
                                        "`glm_moe_dsa` but Transformers does not recognize this architecture")
    ours = [line for line in said.splitlines() if line.startswith("servestack:")]   # after SGLang's own warnings
    assert ours == [f"servestack: SGLang refuses release r-0123456789ab (profile p): {result['refused']}"]


def test_a_tokenizer_that_is_repository_code_is_refused_without_trust_remote_code(tmp_path):
    directory = model_dir(tmp_path, KIMI_CONFIG, CODE_TOKENIZER)
    code, result, _ = check_release("0.5.9", ["--model-path", str(directory), "--tp", "8"])
    assert code == 1 and "contains custom code which must be executed" in result["refused"], result
    trusted, result, _ = check_release("0.5.9", ["--model-path", str(directory), "--tp", "8", "--trust-remote-code"])
    # trusted, it wants the repository's tokenizer code, which is not on this host: not a refusal
    assert trusted == 0 and any(line.startswith("the tokenizer (") for line in result["not_checked"]), result


def test_sglang_0_5_14_loads_glm_5s_config_and_says_where_it_needs_a_gpu(tmp_path):
    code, result, _ = check_release("0.5.14", ["--model-path", str(model_dir(tmp_path, GLM_CONFIG)), "--tp", "8"])
    assert code == 0 and result["refused"] is None, result
    # GLM-5's DSA set-up asks torch for the GPU's capability (0.5.14 srt/server_args.py L3627)
    assert any(line.startswith("SGLang's checks past where it needs a GPU (RuntimeError: Found no NVIDIA driver")
               for line in result["not_checked"]), result
