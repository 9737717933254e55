"""Service profiles (issue 17): every profile's command line, with speculation and without, parsed by
the REAL argument declarations of the SGLang version the manifest pins, and the combinations
settings refuse before connecting.

The declarations come from the real sglang wheel on PyPI (the sandbox's cache; fetched with pip on
first use): `ServerArgs.add_cli_args` in `sglang/srt/server_args.py` is read with `ast` (importing it
needs torch) and replayed into a plain `argparse.ArgumentParser`, as `prepare_server_args` builds
it: so argparse's own rules apply, prefixes (`--tp` for `--tp-size`) and choices included.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest

from operations import service
from sandbox.standins import fake_sglang_server
from servestack import profiles, serving
from servestack.errors import ConfigError, ManifestError
from servestack.manifest import DEFAULT_MANIFEST, load_manifest
from servestack.keys import host_keys
from servestack.settings import MANAGED_FLAGS, settings_from_data
from tests.unit.sglang_venv import sglang_python

MANIFEST = load_manifest()
PROFILES = sorted(MANIFEST.service["profiles"])
# Each profile is checked against the sglang of its own stack.
PROFILE_SGLANG = {name: MANIFEST.stacks[profile["stack"]].package("sglang").version
                  for name, profile in MANIFEST.service["profiles"].items()}
SGLANG = PROFILE_SGLANG[MANIFEST.service["profile"]]
GLM_SGLANG = PROFILE_SGLANG["glm-5-mtp"]
SERVER_ARGS = "sglang/srt/server_args.py"


# -- the real declarations --------------------------------------------------------------------------

class Refused(Exception):
    """What SGLang's parser would print before exiting 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)


class Unresolved(Exception):
    pass


@lru_cache(maxsize=4)
def server_args_source(version: str = SGLANG) -> str:
    from sandbox.standins.pypi import fetch_wheel
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        return wheel.read(SERVER_ARGS).decode()


@lru_cache(maxsize=4)
def server_args_tree(version: str = SGLANG) -> ast.Module:
    return ast.parse(server_args_source(version), SERVER_ARGS)


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name]
    assert len(found) == 1, f"{SERVER_ARGS}: expected one function {name}, found {len(found)}"
    return found[0]


def _value(node: ast.AST, names: dict):
    """A literal, a module-level name bound to one, `[*NAME, ...]` or `A + B` of those."""
    if isinstance(node, ast.Name):
        if node.id in names:
            return names[node.id]
        raise Unresolved(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = []
        for element in node.elts:
            items += _value(element.value, names) if isinstance(element, ast.Starred) else [_value(element, names)]
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _value(node.left, names) + _value(node.right, names)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise Unresolved(ast.unparse(node)) from None


def _module_literals(tree: ast.Module) -> dict:
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = _value(node.value, names)
            except Unresolved:
                pass
    return names


def _action_nargs(tree: ast.Module, name: str):
    """The `nargs` default of a custom argparse.Action's __init__ (None when it has none)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and member.name == "__init__":
                    arguments = member.args
                    defaults = dict(zip([a.arg for a in arguments.args][-len(arguments.defaults):],
                                        arguments.defaults)) if arguments.defaults else {}
                    return ast.literal_eval(defaults["nargs"]) if "nargs" in defaults else None
    return None


TYPES = {"int": int, "float": float}


@lru_cache(maxsize=4)
def real_parser(version: str = SGLANG) -> tuple[Parser, frozenset[str]]:
    """The parser `sglang.launch_server` builds, from the wheel's declarations, and the option strings
    whose choices could not be read (their values go unchecked)."""
    tree = server_args_tree(version)
    names = _module_literals(tree)
    parser, unresolved = Parser(prog="sglang.launch_server"), set()
    calls = [node for node in ast.walk(_function(tree, "add_cli_args"))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "add_argument"]
    for call in calls:
        flags = [ast.literal_eval(argument) for argument in call.args]
        declared = {keyword.arg: keyword.value for keyword in call.keywords}
        options: dict = {}
        action = declared.get("action")
        if isinstance(action, ast.Constant):
            options["action"] = action.value
        elif isinstance(action, ast.Name):  # a custom argparse.Action: takes what its nargs says
            nargs = _action_nargs(tree, action.id)
            if nargs == 0:
                options.update(action="store_const", const=None)
        if "nargs" in declared:
            options["nargs"] = ast.literal_eval(declared["nargs"])
        if "dest" in declared:
            options["dest"] = ast.literal_eval(declared["dest"])
        if "required" in declared:
            options["required"] = ast.literal_eval(declared["required"])
        if "type" in declared and options.get("action") not in ("store_true", "store_false", "store_const"):
            options["type"] = TYPES.get(ast.unparse(declared["type"]), str)
        if "choices" in declared:
            try:
                options["choices"] = _value(declared["choices"], names)
            except Unresolved:
                unresolved.update(flags)
        parser.add_argument(*flags, **options)
    assert len(calls) > 100, f"{SERVER_ARGS}: add_cli_args declares only {len(calls)} arguments"
    return parser, frozenset(unresolved)


def replayable(version: str) -> bool:
    """Whether `version` declares its arguments as add_argument calls in add_cli_args (0.5.9); from
    0.5.14 most are dataclass field metadata, read by SGLang's own code imported in a venv."""
    calls = [node for node in ast.walk(_function(server_args_tree(version), "add_cli_args"))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "add_argument"]
    return len(calls) > 100


PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
parser.error = lambda message: (print(json.dumps({"error": message})), sys.exit(0))
print(json.dumps({"parsed": vars(parser.parse_args(json.loads(sys.argv[1])))}, default=str))
"""


def parse_real(argv: list[str], version: str = SGLANG) -> argparse.Namespace:
    if replayable(version):
        parser, _unresolved = real_parser(version)
        return parser.parse_args(argv)
    import json
    import subprocess
    out = subprocess.run([str(sglang_python(version)), "-c", PARSE, json.dumps(argv)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in said:
        raise Refused(said["error"])
    return argparse.Namespace(**said["parsed"])


def profile_settings(profile: str, **data):
    return settings_from_data("gpu-01", {"service_profile": profile, **data})


# -- the parser replayed is the one SGLang builds ----------------------------------------------------

def test_launch_server_parses_with_a_default_argparse_parser_and_the_declarations_replayed():
    """prepare_server_args: `argparse.ArgumentParser()` (prefixes allowed) + ServerArgs.add_cli_args."""
    prepare = _function(server_args_tree(), "prepare_server_args")
    constructed = [node for node in ast.walk(prepare) if isinstance(node, ast.Call)
                   and ast.unparse(node.func) == "argparse.ArgumentParser"]
    assert len(constructed) == 1 and not constructed[0].args and not constructed[0].keywords
    assert "ServerArgs.add_cli_args(parser)" in ast.unparse(prepare)
    parser, _ = real_parser()
    assert parser.allow_abbrev


def test_the_replayed_parser_refuses_a_made_up_flag_a_bad_choice_and_an_ambiguous_prefix():
    base = ["--model-path", "m"]
    with pytest.raises(Refused, match="unrecognized arguments: --no-such-flag"):
        parse_real(base + ["--no-such-flag"])
    with pytest.raises(Refused, match="argument --attention-backend: invalid choice: 'flashinfer3'"):
        parse_real(base + ["--attention-backend", "flashinfer3"])
    with pytest.raises(Refused, match="argument --speculative-algorithm: invalid choice: 'MTP'"):
        parse_real(base + ["--speculative-algorithm", "MTP"])
    with pytest.raises(Refused, match="argument --kv-cache-dtype: invalid choice: 'fp8'"):
        parse_real(base + ["--kv-cache-dtype", "fp8"])
    with pytest.raises(Refused, match="ambiguous option: --speculative-draft"):
        parse_real(base + ["--speculative-draft", "d"])
    with pytest.raises(Refused, match="the following arguments are required: --model-path"):
        parse_real([])


def test_a_profile_command_line_with_a_made_up_flag_fails_the_check():
    with pytest.raises(Refused, match=re.escape("unrecognized arguments: --made-up-flag")):
        parse_real(serving.launch_arguments(profile_settings("glm-5-mtp", service_extra_args=["--made-up-flag"])),
                   GLM_SGLANG)


@pytest.mark.parametrize("key, flag, value", [
    ("service_attention_backend", "--attention-backend", "flashinfr"),
    ("service_quantization", "--quantization", "nvfp4"),
    ("service_kv_cache_dtype", "--kv-cache-dtype", "fp16"),
])
def test_a_choice_the_real_parser_refuses_is_refused_in_host_data_first(key, flag, value):
    """The real sglang's parser refuses the value at start-up; servestack refuses it before connecting
    (files/stack.toml [server_choices])."""
    with pytest.raises(ConfigError, match=re.escape(f"'{key}': expected one of sglang-0.5.14's {flag} choices")):
        profile_settings("glm-5-mtp", **{key: value})
    argv = serving.launch_arguments(profile_settings("glm-5-mtp"))
    argv = [*argv[:argv.index(flag) + 1], value, *argv[argv.index(flag) + 2:]] if flag in argv else [*argv, flag, value]
    with pytest.raises(Refused, match=re.escape(f"{flag}: invalid choice: '{value}'")):
        parse_real(argv, GLM_SGLANG)


# -- every profile, speculation on and off ---------------------------------------------------------

def _expected(s, speculation: bool) -> dict:
    """What SGLang's parser must read from the command line (argparse dests)."""
    expected = {
        "model_path": s.service_model_path, "tensor_parallel_size": s.service_tp,
        "attention_backend": s.service_attention_backend,
        "quantization": s.service_quantization, "kv_cache_dtype": s.service_kv_cache_dtype,
        "enable_torch_symm_mem": s.service_enable_torch_symm_mem, "trust_remote_code": s.service_trust_remote_code,
        "enable_flashinfer_allreduce_fusion": s.service_enable_flashinfer_allreduce_fusion,
        "host": s.service_host, "port": s.service_port,
        "speculative_algorithm": None, "speculative_draft_model_path": None,
        "speculative_num_steps": None, "speculative_eagle_topk": None, "speculative_num_draft_tokens": None,
    }
    if speculation:
        expected.update(speculative_algorithm=s.service_speculative_algorithm,
                        speculative_draft_model_path=s.service_draft_model_path,
                        speculative_num_steps=s.service_speculative_num_steps,
                        speculative_eagle_topk=s.service_speculative_eagle_topk,
                        speculative_num_draft_tokens=s.service_speculative_num_draft_tokens)
    return expected


@pytest.mark.parametrize("speculation", [True, False], ids=["speculation", "baseline"])
@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_command_line_parses_with_the_pinned_sglang(profile, speculation):
    s = profile_settings(profile)
    argv = serving.launch_arguments(s, speculation=speculation)
    parsed = vars(parse_real(argv, PROFILE_SGLANG[profile]))
    expected = _expected(s, speculation)
    if "tensor_parallel_size" not in parsed:   # 0.5.14 names --tp's dest tp_size
        expected["tp_size"] = expected.pop("tensor_parallel_size")
    if s.service_kv_cache_dtype is None:   # not passed: sglang's own default (0.5.9 None, 0.5.14 'auto')
        assert "--kv-cache-dtype" not in argv
        del expected["kv_cache_dtype"]
    assert {dest: parsed[dest] for dest in expected} == expected
    for flag in s.service_extra_args:
        if flag.startswith("--"):
            assert parsed[flag[2:].replace("-", "_")] is not None
    unresolved = real_parser(PROFILE_SGLANG[profile])[1] if replayable(PROFILE_SGLANG[profile]) else frozenset()
    used = {word for word in argv if word.startswith("--")}
    assert not used & unresolved, f"choices of {sorted(used & unresolved)} could not be read from the wheel"
    assert ("--speculative-algorithm" in argv) == (speculation and serving.speculates(s))


@pytest.mark.parametrize("profile", PROFILES)
def test_the_stand_in_server_accepts_every_profile_on_and_off(profile):
    s = profile_settings(profile)
    for speculation in (True, False):
        parsed = fake_sglang_server.parse(serving.launch_arguments(s, speculation=speculation))
        assert parsed.model_path == s.service_model_path
        assert parsed.speculative_algorithm == (s.service_speculative_algorithm if speculation else None)


def test_the_two_reference_deployments_as_profiles():
    kimi = serving.launch_arguments(profile_settings("kimi-k2.5-eagle3"))
    assert " ".join(kimi) == (
        "--model-path nvidia/Kimi-K2.5-NVFP4 --tp 8 --speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path lightseekorg/kimi-k2.5-eagle3 --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --attention-backend flashinfer "
        "--trust-remote-code --enable-torch-symm-mem --host 0.0.0.0 --port 30000")
    glm = profile_settings("glm-5-mtp")
    assert " ".join(serving.launch_arguments(glm)) == (
        "--model-path festr2/GLM-5-NVFP4-MTP --tp 8 --speculative-algorithm NEXTN --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --attention-backend flashinfer "
        "--quantization modelopt_fp4 --kv-cache-dtype bf16 --host 0.0.0.0 --port 30000 --disable-custom-all-reduce")
    assert " ".join(serving.launch_arguments(glm, speculation=False)) == (
        "--model-path festr2/GLM-5-NVFP4-MTP --tp 8 --attention-backend flashinfer --quantization modelopt_fp4 "
        "--kv-cache-dtype bf16 --host 0.0.0.0 --port 30000 --disable-custom-all-reduce")


def test_the_default_profile_is_the_kimi_deployment():
    """A host without service_profile serves Kimi, as before profiles: with test_service's
    `test_launch_arguments_come_from_the_manifest_defaults` (the command line of before, unchanged) and
    no profile environment, its unit is the same bytes, so moving the fields into a profile restarts nothing."""
    assert MANIFEST.service["profile"] == "kimi-k2.5-eagle3"
    assert settings_from_data("gpu-01", {}).values == profile_settings("kimi-k2.5-eagle3").values
    assert profile_settings("kimi-k2.5-eagle3").service_env == {}


def test_the_glm_profile_unit_carries_its_environment_and_a_hosts_is_added():
    s = profile_settings("glm-5-mtp", service_env={"NCCL_P2P_DISABLE": "1"},
                         service_extra_args=["--mem-fraction-static", "0.9"])
    release = service.release(s, "r-0123456789ab")
    text = service.render_unit(s, release, "ab" * 32)
    assert "Environment=NCCL_P2P_DISABLE=1\n" in text
    # sglang 0.5.14 always runs the V2 worker and warns that SGLANG_ENABLE_SPEC_V2 was removed
    assert "SGLANG_ENABLE_SPEC_V2" not in text
    assert serving.launch_arguments(s)[-3:] == ["--disable-custom-all-reduce", "--mem-fraction-static", "0.9"]


def test_a_host_value_beats_its_profiles_and_the_profile_speculation_can_be_turned_off(tmp_path):
    path = manifest_with(tmp_path, lambda t: t.replace(
        '# that the variable was removed (srt/arg_groups/speculative_hook.py L67-74).\nenv = {}',
        'env = { NCCL_P2P_LEVEL = "SYS", NCCL_IB_DISABLE = "1" }'))
    s = profile_settings("glm-5-mtp", servestack_manifest=str(path), service_env={"NCCL_IB_DISABLE": "0"},
                         service_speculative_algorithm="NONE", service_attention_backend="triton")
    assert s.service_env == {"NCCL_P2P_LEVEL": "SYS", "NCCL_IB_DISABLE": "0"}
    argv = serving.launch_arguments(s)
    assert "--speculative-algorithm" not in argv and argv[argv.index("--attention-backend") + 1] == "triton"


@pytest.mark.parametrize("profile", PROFILES)
def test_no_profile_repeats_a_managed_flag(profile):
    s = profile_settings(profile)   # settings_from_data refuses a managed flag in extra args, so this is a check of it
    assert not {arg.split("=", 1)[0] for arg in s.service_extra_args} & set(MANAGED_FLAGS)


def test_allreduce_fusion_is_off_in_every_profile_and_warned_where_a_host_turns_it_on_on_sm120():
    for profile in PROFILES:
        assert profile_settings(profile).service_enable_flashinfer_allreduce_fusion is False
        assert service.ineffective_settings(profile_settings(profile)) == []
    fused = profile_settings("kimi-k2.5-eagle3", service_enable_flashinfer_allreduce_fusion=True)   # sglang 0.5.9
    warnings = service.ineffective_settings(fused)
    assert len(warnings) == 1 and "has no effect on SM120 GPUs with sglang 0.5.9" in warnings[0]


def test_model_paths_on_disk_exclude_a_missing_draft():
    s = profile_settings("glm-5-mtp", service_model_path="/models/glm-5")
    assert service.local_model_paths(s) == ["/models/glm-5"]


# -- what the settings rely on, read in the wheel ------------------------------------------------------

def _list_literals(function: ast.FunctionDef) -> list[list[str]]:
    return [ast.literal_eval(node) for node in ast.walk(function) if isinstance(node, ast.List)
            and node.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)]


STACK_SGLANGS = sorted(set(PROFILE_SGLANG.values()))


SPECULATIVE_HOOK = "sglang/srt/arg_groups/speculative_hook.py"  # where 0.5.14 moved the speculative set-up


def speculative_setup(version: str) -> ast.AST:
    """The code that sets up speculative decoding: ServerArgs._handle_speculative_decoding (0.5.9),
    or the module it moved to (0.5.14)."""
    found = [node for node in ast.walk(server_args_tree(version)) if isinstance(node, ast.FunctionDef)
             and node.name == "_handle_speculative_decoding"]
    if found:
        return found[0]
    from sandbox.standins.pypi import fetch_wheel
    with zipfile.ZipFile(fetch_wheel("sglang", version)) as wheel:
        return ast.parse(wheel.read(SPECULATIVE_HOOK).decode(), SPECULATIVE_HOOK)


@pytest.mark.parametrize("version", STACK_SGLANGS)
def test_nextn_is_renamed_eagle_before_speculation_is_set_up(version):
    source = ast.unparse(speculative_setup(version))
    assert (re.search(r"if self\.speculative_algorithm == 'NEXTN':\s+self\.speculative_algorithm = 'EAGLE'", source)
            or "if speculative_algorithm == 'NEXTN' or speculative_algorithm == 'EAGLE':" in source)


@pytest.mark.parametrize("version", STACK_SGLANGS)
def test_the_self_drafting_architectures_are_the_pinned_sglangs(version):
    """profiles.SELF_DRAFTING_ARCHITECTURES + OWN_OR_SEPARATE_DRAFT: architectures whose draft defaults
    to the model itself in every pinned sglang; the second may also take a separate draft without a
    warning. A later sglang may add architectures (0.5.14: DeepseekV4, HYV3): profiles names those
    every stack has."""
    setup = speculative_setup(version)
    lists = _list_literals(setup)
    ours = set(profiles.SELF_DRAFTING_ARCHITECTURES + profiles.OWN_OR_SEPARATE_DRAFT)
    assert any(ours <= set(items) for items in lists if "GlmMoeDsaForCausalLM" in items)
    assert list(profiles.OWN_OR_SEPARATE_DRAFT) in lists
    source = ast.unparse(setup)
    assert re.search(r"(self|server_args)\.speculative_draft_model_path = (self|server_args)\.model_path", source)
    assert "DeepSeek MTP does not require setting speculative_draft_model_path." in source


def test_glm_5_gets_the_nsa_backend_when_none_is_set_and_bf16_kv_is_valid_for_it():
    adjust = ast.unparse(_function(server_args_tree(SGLANG), "_handle_model_specific_adjustments"))
    assert "'GlmMoeDsaForCausalLM'" in adjust
    assert re.search(r"if self\.is_attention_backend_not_set\(\):\s+self\.attention_backend = 'nsa'", adjust)
    kv = ast.unparse(_function(server_args_tree(SGLANG), "_set_default_nsa_kv_cache_dtype"))
    assert re.search(r"if self\.kv_cache_dtype == 'bf16':\s+self\.kv_cache_dtype = 'bfloat16'", kv)
    assert "modelopt_fp4" in _module_literals(server_args_tree(SGLANG))["QUANTIZATION_CHOICES"]


def test_the_profile_algorithms_are_sglangs_choices():
    parser, _ = real_parser()
    (declared,) = [action for action in parser._actions if "--speculative-algorithm" in action.option_strings]
    assert set(profiles.SPECULATIVE_ALGORITHMS) - {"NONE"} <= set(declared.choices)


# -- refused before connecting ----------------------------------------------------------------------------

def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as error:
        settings_from_data("gpu-01", data)
    return str(error.value)


@pytest.mark.parametrize("data, line", [
    ({"service_profile": "glm-5"},
     "host gpu-01: 'service_profile': unknown service profile 'glm-5' (did you mean 'glm-5-mtp'?); "
     "the manifest's profiles: glm-5-mtp, kimi-k2.5-eagle3"),
    ({"service_profile": "kimi-k2.5-eagle3", "service_draft_model_path": None},
     "host gpu-01: 'service_draft_model_path': expected a draft model: speculative_algorithm EAGLE3 drafts with a "
     "separate model, got none (profile 'kimi-k2.5-eagle3')"),
    ({"service_profile": "glm-5-mtp", "service_draft_model_path": "org/glm-5-draft"},
     "host gpu-01: 'service_draft_model_path': expected none: with speculative_algorithm NEXTN, GlmMoeDsaForCausalLM "
     "drafts with its own MTP (NextN) layers, got 'org/glm-5-draft' (profile 'glm-5-mtp')"),
    ({"service_profile": "glm-5-mtp", "service_speculative_algorithm": "EAGLE", "service_draft_model_path": "d"},
     "host gpu-01: 'service_draft_model_path': expected none: with speculative_algorithm EAGLE, GlmMoeDsaForCausalLM"),
    ({"service_profile": "glm-5-mtp", "service_speculative_algorithm": "EAGLE3"},
     "host gpu-01: 'service_draft_model_path': expected a draft model: speculative_algorithm EAGLE3 drafts with a "
     "separate model, got none (profile 'glm-5-mtp')"),
    ({"service_profile": "glm-5-mtp", "service_model_architecture": "LlamaForCausalLM"},
     "host gpu-01: 'service_draft_model_path': expected a draft model: LlamaForCausalLM (model_architecture) has no "
     "MTP layers sglang drafts with for speculative_algorithm NEXTN"),
    ({"service_patches": ["0009-made-up"]},
     "host gpu-01: 'service_patches': expected patches of servestack's set for sglang 0.5.9 "
     "(0001-sm120-torch-symm-mem, 0002-kimi-k25-eagle3-hooks), got '0009-made-up' (profile 'kimi-k2.5-eagle3')"),
    ({"service_profile": 5}, "host gpu-01: 'service_profile': expected a non-empty string, got 5"),
])
def test_bad_combinations_are_refused_naming_host_and_key(data, line):
    assert line in refusal(data)


@pytest.mark.parametrize("data", [
    {"service_profile": "glm-5-mtp", "service_speculative_algorithm": "NONE", "service_draft_model_path": "d"},
    {"service_profile": "glm-5-mtp", "service_model_architecture": "LlamaForCausalLM", "service_draft_model_path": "d"},
    {"service_profile": "glm-5-mtp", "service_model_architecture": "MistralLarge3ForCausalLM"},
    {"service_profile": "kimi-k2.5-eagle3", "service_speculative_algorithm": "NONE", "service_draft_model_path": None},
])
def test_combinations_sglang_accepts_are_not_refused(data):
    settings_from_data("gpu-01", data)


def test_an_unknown_profile_is_one_line_not_one_per_profile_field():
    lines = refusal({"service_profile": "glm5", "service_draft_model_path": "x"}).splitlines()
    assert lines == ["host gpu-01: 'service_profile': unknown service profile 'glm5' (did you mean 'glm-5-mtp'?); "
                     "the manifest's profiles: glm-5-mtp, kimi-k2.5-eagle3, kimi-k2.5-eagle3-0.5.14"]


def test_servestack_keys_lists_the_profile_keys_with_the_default_profiles_values():
    keys = host_keys(MANIFEST)
    assert keys["service_profile"].default(MANIFEST) == "kimi-k2.5-eagle3"
    assert keys["service_draft_model_path"].default(MANIFEST) == "lightseekorg/kimi-k2.5-eagle3"
    assert keys["service_quantization"].default(MANIFEST) is None
    for name in ("service_model_architecture", "service_quantization", "service_kv_cache_dtype", "service_patches"):
        assert "(default: from the host's service profile)" in keys[name].help


# -- the manifest's profiles ----------------------------------------------------------------------------

def manifest_with(tmp_path: Path, edit) -> Path:
    text = edit(DEFAULT_MANIFEST.read_text())
    path = tmp_path / "stack.toml"
    path.write_text(text)
    tomllib.loads(text)
    return path


def manifest_refusal(path: Path) -> list[str]:
    with pytest.raises(ManifestError) as error:
        host_keys(load_manifest(path))
    return str(error.value).splitlines()


GLM = 'service.profiles."glm-5-mtp"'


@pytest.mark.parametrize("edit, line", [
    (lambda t: t.replace('profile = "kimi-k2.5-eagle3"', 'profile = "kimi"'),
     "key 'service.profile': unknown service profile 'kimi' (did you mean 'kimi-k2.5-eagle3'?)"),
    (lambda t: t.replace('model_path = "festr2/GLM-5-NVFP4-MTP"\n', ""),
     f"key '{GLM}.model_path': expected a non-empty string without whitespace or control characters (missing)"),
    (lambda t: t.replace('kv_cache_dtype = "bf16"', 'kv_cache_type = "bf16"'),
     f"key '{GLM}.kv_cache_type': expected one of the known keys ['attention_backend', "),
    (lambda t: t.replace('speculative_algorithm = "NEXTN"', 'speculative_algorithm = "MTP"'),
     f"key '{GLM}.speculative_algorithm': expected one of 'EAGLE3', 'EAGLE', 'NEXTN', 'STANDALONE', 'NONE', got 'MTP'"),
    (lambda t: t.replace('model_architecture = "GlmMoeDsaForCausalLM"\n',
                         'model_architecture = "GlmMoeDsaForCausalLM"\ndraft_model_path = "org/draft"\n'),
     f"key '{GLM}.draft_model_path': expected none: with speculative_algorithm NEXTN, GlmMoeDsaForCausalLM drafts"),
    (lambda t: t.replace('patches = []', 'patches = ["0002-kimi"]'),
     f"key '{GLM}.patches': expected patches of servestack's set for sglang 0.5.14"),
    (lambda t: t.replace('\n[service.profiles."glm-5-mtp"]', '\n[service.profiles."glm-5-mtp"]\nport = 1'),
     f"key '{GLM}.port': expected one of the known keys"),
])
def test_a_bad_profile_in_the_manifest_is_named_by_its_key_path(tmp_path, edit, line):
    path = manifest_with(tmp_path, edit)
    lines = manifest_refusal(path)
    assert any(found.startswith(f"{path}: {line}") for found in lines), lines


def test_a_manifest_without_profiles_is_refused(tmp_path):
    path = manifest_with(tmp_path, lambda t: t[:t.index('\n[service.profiles."kimi-k2.5-eagle3"]')] + "\n")
    assert manifest_refusal(path) == [f"{path}: key 'service.profiles': expected service profiles, tables like "
                                      '[service.profiles."kimi-k2.5-eagle3"] (missing)']


def test_a_host_picks_a_profile_of_its_own_manifest(tmp_path):
    path = manifest_with(tmp_path, lambda t: t.replace('[service.profiles."glm-5-mtp"]', '[service.profiles."glm-5"]'))
    s = settings_from_data("gpu-01", {"servestack_manifest": str(path), "service_profile": "glm-5"})
    assert s.service_model_architecture == "GlmMoeDsaForCausalLM"
