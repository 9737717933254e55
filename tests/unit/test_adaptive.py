"""service_speculation = "adaptive" (issue 33): the config from the host's crossover, what the unit runs,
the refusal of a configuration SGLang would not run it for, the stand-in's simulation and `servestack
bench`'s third configuration. SGLang's own code (its default config, its config loader, its checks) is
run from the real sglang 0.5.14 wheel where the stand-in or servestack mirrors it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.deploy import add_deploy
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FileContents, Sha256File

from facts.batch import FactRequest
from operations import service
from sandbox.standins import fake_sglang_server as standin
from servestack import bench, serving
from servestack.manifest import load_manifest
from servestack.paths import speculation_record_path, unit_path
from servestack.profiles import adaptive_unsupported_reason, speculation_policy_problems
from servestack.settings import settings_from_data
from servestack.speculation_policy import (
    ADAPTIVE,
    BASELINE,
    SGLANG_DEFAULT_ADAPTIVE_CONFIG,
    SPECULATION,
    Served,
    adaptive_config_text,
    adaptive_plan,
    benchmark_reason,
    identity_fingerprint,
    make_record,
    record_decision,
    served,
)
from tests.unit.fake_host import fake_state, read_keys
from tests.unit.sglang_venv import sglang_python

OFF = SGLANG_DEFAULT_ADAPTIVE_CONFIG["64"]   # SGLang's own off slot
RELEASE_ID = "r-0123456789ab"


def result(level_means: dict[int, float], accept: float | None = None) -> dict:
    """A bench-client result with these aggregate tok/s per level (concurrency 1's runs at its mean)."""
    first = level_means[1]
    stats = {"mean": first, "min": first, "max": first}
    return {"runs": [{"output_tok_s": first}] * 3, "output_tok_s": stats, "decode_tok_s": stats,
            "ttft_s": {"mean": 0.05, "min": 0.05, "max": 0.05},
            "accept_length": accept, "server": {"standin": True},
            "concurrency": [{"concurrency": level, "tok_s": {"mean": tok_s, "min": tok_s, "max": tok_s}}
                            for level, tok_s in sorted(level_means.items())]}


def measured(speculation: dict[int, float], baseline: dict[int, float]) -> dict:
    return {SPECULATION: result(speculation, 2.6), BASELINE: result(baseline)}


# -- the decision -------------------------------------------------------------------------------------

def test_a_crossover_between_levels_turns_speculation_off_from_the_first_level_measured_to_lose():
    plan = adaptive_plan(0.02, measured({1: 110, 4: 400, 16: 1200, 64: 2500}, {1: 90, 4: 340, 16: 1300, 64: 3600}))
    assert plan.off_from == 16
    assert plan.config == {"1": SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"], "8": SGLANG_DEFAULT_ADAPTIVE_CONFIG["8"],
                           "16": OFF}
    assert [level["concurrency"] for level in plan.levels] == [1, 4, 16, 64]
    assert plan.decision(0.22).configuration == ADAPTIVE
    assert "speculation off from 16 running requests, where it stops paying" in plan.why()
    assert "+22.2% at 1" in plan.why() and "-7.7% at 16" in plan.why()


def test_a_gain_below_min_gain_does_not_pay():
    plan = adaptive_plan(0.05, measured({1: 110, 4: 350}, {1: 90, 4: 340}))   # +2.9% at 4
    assert plan.off_from == 4 and plan.config == {"1": SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"], "4": OFF}
    assert adaptive_plan(0.02, measured({1: 110, 4: 350}, {1: 90, 4: 340})).off_from == 64


def test_speculation_that_pays_at_every_level_keeps_sglangs_own_config_above_the_levels_measured():
    below_64 = adaptive_plan(0.02, measured({1: 110, 4: 400, 16: 1400}, {1: 90, 4: 340, 16: 1300}))
    assert below_64.off_from == 64 and below_64.config == SGLANG_DEFAULT_ADAPTIVE_CONFIG
    assert "SGLang's own off slot: speculation paid at every level measured" in below_64.why()
    up_to_64 = adaptive_plan(0.02, measured({1: 110, 64: 4000}, {1: 90, 64: 3600}))
    assert up_to_64.off_from is None
    assert up_to_64.config == {key: SGLANG_DEFAULT_ADAPTIVE_CONFIG[key] for key in ("1", "8", "32")}


def test_speculation_that_never_pays_serves_the_baseline():
    plan = adaptive_plan(0.02, measured({1: 80, 4: 300}, {1: 90, 4: 340}))
    assert plan.config is None and plan.decision(-0.11).configuration == BASELINE
    assert "speculation pays at no level measured" in plan.why()
    assert adaptive_plan(0.02, {SPECULATION: {}, BASELINE: {}}) is None


def test_sglangs_default_config_is_the_wheels():
    python = sglang_python("0.5.14")
    found = subprocess.run([str(python), "-c", "import json; from sglang.srt.speculative.adaptive_spec_params "
                            "import DEFAULT_ADAPTIVE_CONFIG as c; print(json.dumps(c))"],
                           capture_output=True, text=True, check=True)
    assert json.loads(found.stdout.splitlines()[-1]) == SGLANG_DEFAULT_ADAPTIVE_CONFIG
    assert standin.SGLANG_DEFAULT_SLOTS == {int(key): slot["candidate_steps"]
                                            for key, slot in SGLANG_DEFAULT_ADAPTIVE_CONFIG.items()}


# -- what the unit runs -------------------------------------------------------------------------------

def record_for(identity: dict, speculation: dict[int, float], baseline: dict[int, float], policy="adaptive") -> dict:
    results = measured(speculation, baseline)
    plan = adaptive_plan(0.02, results) if policy == "adaptive" else None
    decision = plan.decision(None) if plan else record_decision("auto", 0.02, {"configurations": results})
    return make_record(identity, policy, 0.02, results, decision, by="deploy", run_id="r", request=None,
                       method_={}, plan=plan)


def test_adaptive_serves_sglangs_config_until_measured_then_the_hosts():
    identity = {"release": RELEASE_ID, "arguments": ["--tp", "8"]}
    fingerprint = identity_fingerprint(identity)
    assert served("adaptive", 0.02, None, fingerprint) == Served(ADAPTIVE, SGLANG_DEFAULT_ADAPTIVE_CONFIG)
    record = record_for(identity, {1: 110, 4: 300}, {1: 90, 4: 340})
    assert served("adaptive", 0.02, record, fingerprint) == Served(ADAPTIVE, {"1": SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"],
                                                                           "4": OFF})
    assert record["adaptive"]["off_from"] == 4 and record["adaptive"]["levels"][1]["gain"] < 0
    assert served("adaptive", 0.02, record, "other") == Served(ADAPTIVE, SGLANG_DEFAULT_ADAPTIVE_CONFIG)
    losing = record_for(identity, {1: 80}, {1: 90})
    assert served("adaptive", 0.02, losing, fingerprint) == Served(BASELINE)
    assert benchmark_reason("adaptive", 0.02, record, identity)[0] is False


def test_a_record_made_under_auto_is_measured_again_for_adaptive():
    identity = {"release": RELEASE_ID}
    auto = record_for(identity, {1: 110, 4: 300}, {1: 90, 4: 340}, policy="auto")
    needed, why = benchmark_reason("adaptive", 0.02, auto, identity)
    assert needed and "not made for service_speculation = 'adaptive'" in why
    now = served("adaptive", 0.02, auto, identity_fingerprint(identity))
    assert now.adaptive_config == SGLANG_DEFAULT_ADAPTIVE_CONFIG
    assert benchmark_reason("auto", 0.02, auto, identity)[0] is False   # auto's own: unchanged


def host(**data):
    return settings_from_data("gpu-01", {"service_profile": "glm-5-mtp", **data})


def test_the_unit_carries_the_adaptive_flags_and_names_its_config_by_content():
    s = host(service_speculation="adaptive")
    rel = service.release(s, RELEASE_ID)
    config = {"1": SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"], "16": OFF}
    unit = service.unit_for(s, rel, None, (), Served(ADAPTIVE, config))
    path, text = service.adaptive_config_file(rel, Served(ADAPTIVE, config))
    assert path.startswith(f"{rel.dir}/speculative-adaptive-") and json.loads(text) == config
    assert f"--speculative-adaptive \\\n    --speculative-adaptive-config {path}" in unit
    assert "--speculative-num-steps 3" in unit
    assert service.unit_for(s, rel, None, (), Served(ADAPTIVE, dict(config))) == unit
    assert service.unit_for(s, rel, None, (), Served(ADAPTIVE, SGLANG_DEFAULT_ADAPTIVE_CONFIG)) != unit
    assert "--speculative" not in service.unit_for(s, rel, None, (), Served(BASELINE))
    assert "--speculative-adaptive" not in service.unit_for(s, rel, None, (), Served(SPECULATION))
    assert adaptive_config_text(config) == adaptive_config_text(json.loads(text))
    # what a measurement is for does not depend on the config it leads to
    state = fake_state({})
    with ctx_state.use(state), ctx_host.use(state.inventory.get_host("@fake/gpu1")):
        assert "--speculative-adaptive" not in " ".join(service.service_identity(s, rel)["arguments"])


def test_the_unit_parses_with_sglangs_own_parser_and_the_stand_ins():
    from tests.unit.test_profiles import parse_real
    s = host(service_speculation="adaptive")
    argv = serving.launch_arguments(s, True, "/opt/r/speculative-adaptive-0123.json")
    parsed = parse_real(argv, "0.5.14")
    assert parsed.speculative_adaptive is True
    assert parsed.speculative_adaptive_config == "/opt/r/speculative-adaptive-0123.json"
    assert standin.parse(argv).speculative_adaptive is True


FRESH_HOST = {"command -v curl": "/usr/bin/curl", "command -v useradd": "/usr/sbin/useradd", "uname -s": "Linux"}


def adaptive_host(record: dict | None = None):
    """An adaptive host (pyinfra's @fake connector) whose speculation record is `record`."""
    data = {"service_profile": "glm-5-mtp", "service_speculation": "adaptive"}
    record_read = {speculation_record_path(host(**data)): json.dumps(record)} if record else {}
    state = fake_state({**data, "fake_responses": {**FRESH_HOST, **record_read}})
    return state, state.inventory.get_host("@fake/gpu1")


@pytest.mark.parametrize("measured", [False, True])
def test_the_service_step_of_an_adaptive_host_reads_the_config_in_the_batch(monkeypatch, measured):
    """A converged adaptive host costs no remote command more than another (tests/integration/test_probe.py
    counts 4): the adaptive config the unit names is read in the step's batch (`host_reads`), measured for
    this host or SGLang's own, from the speculation record read before the release is chosen (`deploy_reads`)."""
    s = host(service_speculation="adaptive")
    rel = service.release(s, RELEASE_ID)
    state, gpu1 = adaptive_host()
    with ctx_state.use(state), ctx_host.use(gpu1):
        identity = service.service_identity(s, rel)
    record = record_for(identity, {1: 110, 4: 400, 16: 1200}, {1: 90, 4: 340, 16: 1300}) if measured else None
    config = adaptive_plan(0.02, record["configurations"]).config if record else SGLANG_DEFAULT_ADAPTIVE_CONFIG
    wanted = FactRequest.of(Sha256File, path=service.adaptive_config_file(rel, Served(ADAPTIVE, config))[0]).key
    state, gpu1 = adaptive_host(record)
    keys = read_keys(monkeypatch)
    with ctx_state.use(state), ctx_host.use(gpu1):
        listed = {request.key for request in service.host_reads(s, rel)}
    add_deploy(state, service.sglang_service, release=rel)
    assert wanted in keys and wanted in listed
    assert set(keys) - listed == {FactRequest.of(FileContents, path=unit_path(s)).key}   # read only to diff a change


# -- refused before connecting ------------------------------------------------------------------------

def fields(profile: str, **changes) -> dict:
    manifest = load_manifest()
    table = {"extra_args": [], **manifest.service["profiles"][profile]}
    return {**table, **changes}


def test_adaptive_is_refused_where_the_stack_or_sglang_would_not_run_it():
    manifest = load_manifest()
    assert adaptive_unsupported_reason(fields("glm-5-mtp"), manifest) is None
    assert "has no adaptive speculation servestack knows (sglang 0.5.9" in adaptive_unsupported_reason(
        fields("kimi-k2.5-eagle3"), manifest)
    on_current = {"stack": "sglang-0.5.14"}
    assert adaptive_unsupported_reason(fields("kimi-k2.5-eagle3", **on_current), manifest) is None
    for changes, words in (({"speculative_algorithm": "STANDALONE"}, "only for EAGLE, EAGLE3, NEXTN"),
                           ({"speculative_eagle_topk": 4}, "only with topk 1"),
                           ({"extra_args": ["--enable-dp-attention"]}, "extra_args --enable-dp-attention"),
                           ({"speculative_num_steps": 2}, "starts from steps 1, 3, 7")):
        reason = adaptive_unsupported_reason(fields("glm-5-mtp", **changes), manifest)
        assert reason and words in reason, (changes, reason)
        assert "silently" in reason or "refuses" in reason
    assert speculation_policy_problems("auto", fields("kimi-k2.5-eagle3"), manifest) == []
    assert speculation_policy_problems("adaptive", fields("kimi-k2.5-eagle3"), manifest)[0][0] == "speculation"


REAL_CHECKS = """
import json, sys, types
from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason
from sglang.srt.arg_groups.speculative_hook import _init_adaptive_speculative_params
out = []
for case in json.loads(sys.argv[1]):
    args = types.SimpleNamespace(enable_dp_attention=False, enable_multi_layer_eagle=False,
                                 enable_two_batch_overlap=False, enable_pdmux=False, **case["args"])
    reason = adaptive_unsupported_reason(args)
    try:
        if reason is None:
            _init_adaptive_speculative_params(args)
        out.append([reason, None])
    except ValueError as error:
        out.append([reason, str(error)])
print(json.dumps(out))
"""


def test_the_stand_in_refuses_and_falls_back_where_sglang_does(tmp_path):
    good, bad, empty = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "empty.json"
    good.write_text(adaptive_config_text({"1": SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"], "16": OFF}))
    bad.write_text(json.dumps({"1": {"candidate_steps": [3, -1]}}))
    empty.write_text(json.dumps({"note": {"candidate_steps": [1]}}))
    cases = [({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "speculative_num_steps": 3}, good),
             ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, "speculative_num_steps": 2}, good),
             ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, "speculative_num_steps": 3}, bad),
             ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "speculative_num_steps": 3}, empty),
             ({"speculative_algorithm": "STANDALONE", "speculative_eagle_topk": 1, "speculative_num_steps": 3}, good),
             ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2, "speculative_num_steps": 3}, good)]
    real = json.loads(subprocess.run(
        [str(sglang_python("0.5.14")), "-c", REAL_CHECKS,
         json.dumps([{"args": {**args, "speculative_adaptive_config": str(path), "speculative_num_draft_tokens": 4}}
                     for args, path in cases])], capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    for (args, path), (reason, error) in zip(cases, real):
        argv = standin_argv(args, path)
        try:
            slots = standin.adaptive_slots(standin.parse(argv))
            mine = None
        except ValueError as problem:
            slots, mine = None, str(problem)
        assert (mine is None) == (error is None), (args, path.name, mine, error)
        assert (slots is None) == (reason is not None or error is not None), (args, path.name, reason)
    run = subprocess.run([sys.executable, "-m", "sandbox.standins.fake_sglang_server", *standin_argv(cases[0][0], bad)],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert run.returncode == 1 and "candidate_steps must be a list of non-negative ints" in run.stderr


def standin_argv(args: dict, path: Path) -> list[str]:
    """The stand-in's command line for one case of SGLang's checks."""
    argv = ["--model-path", "m", "--speculative-algorithm", args["speculative_algorithm"],
            "--speculative-draft-model-path", "d", "--speculative-num-steps", str(args["speculative_num_steps"]),
            "--speculative-eagle-topk", str(args["speculative_eagle_topk"]), "--speculative-num-draft-tokens",
            str(args["speculative_num_steps"] + 1), "--speculative-adaptive", "--speculative-adaptive-config",
            str(path)]
    if args["speculative_eagle_topk"] != 1:
        argv[argv.index("--speculative-num-draft-tokens") + 1] = "8"
    return argv


def test_the_stand_in_speculates_below_its_off_slot_only():
    decoder = standin.Decoder(standin.Throughput(), True, {1: [1, 3, 7], 8: [0, 1, 3], 16: [0]})
    assert [decoder.speculating(n) for n in (1, 7, 8, 15, 16, 64)] == [True, True, True, True, False, False]
    assert standin.Decoder(standin.Throughput(), True).speculating(64) is True
    assert standin.Decoder(standin.Throughput(), False, {1: [1]}).speculating(1) is False


# -- servestack bench ---------------------------------------------------------------------------------

def adaptive_report() -> dict:
    results = measured({1: 110, 4: 400, 16: 1200}, {1: 90, 4: 340, 16: 1300})
    results[ADAPTIVE] = result({1: 109, 4: 398, 16: 1310}, 2.6)
    plan = adaptive_plan(0.02, results)
    record = make_record({"profile": "glm-5-mtp", "release": RELEASE_ID}, "adaptive", 0.02, results,
                         plan.decision(0.22), by="bench", run_id="r", request="q", method_={}, plan=plan)
    return bench.host_report(record, "q")


def test_bench_shows_the_adaptive_configuration_as_a_third_line_per_level(tmp_path):
    from rich.console import Console
    report = adaptive_report()
    assert report["adaptive"]["off_from"] == 16 and ADAPTIVE in report["configurations"]
    console = Console(width=200, record=True)
    bench.render_tables({"h1": report}, console)
    text = console.export_text()
    assert "adaptive" in text.split("gain over baseline")[1].splitlines()[4]   # the third row
    assert "adaptive gain" in text and "1310.0" in text
    assert "adaptive is below the better of speculation and baseline at concurrency 1 (-0.9%), 4 (-0.5%)" in text
    document = json.loads(bench.render_json({"h1": report}))
    assert document["hosts"]["h1"]["adaptive"]["config"]["16"] == OFF
    if bench.plotting_available():
        assert bench.plot({"h1": report}, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_adaptive_at_or_above_the_better_of_the_two_is_said_so():
    results = measured({1: 110, 16: 1200}, {1: 90, 16: 1300})
    results[ADAPTIVE] = result({1: 111, 16: 1300})
    assert bench.adaptive_verdict(results).startswith("adaptive is at or above the better")
    assert bench.adaptive_verdict(measured({1: 1}, {1: 1})) is None


@pytest.mark.parametrize("policy", ["auto", "adaptive"])
def test_the_status_column_says_what_the_policy_chooses_now(policy):
    report = adaptive_report()
    record = {"configurations": report["configurations"], "decision": "adaptive", "identity": {}, "adaptive": {}}
    summary = bench.status_summary(record, None, policy, 0.02)
    assert summary["now"] == ("adaptive" if policy == "adaptive" else "speculation")


# -- Kimi-K2.5 on the current stack: its patch set, read in the wheel -----------------------------------

def test_kimi_on_sglang_0_5_14_needs_neither_patch_and_its_profile_runs_adaptive():
    import ast
    import zipfile

    from sandbox.standins.pypi import fetch_wheel
    with zipfile.ZipFile(fetch_wheel("sglang", "0.5.14")) as wheel:
        kimi = ast.parse(wheel.read("sglang/srt/models/kimi_k25.py").decode())
        sizes = wheel.read("sglang/srt/distributed/device_communicators/all_reduce_utils.py").decode()
        symm = wheel.read("sglang/srt/distributed/device_communicators/torch_symm_mem.py").decode()
    wrapper = next(node for node in ast.walk(kimi)
                   if isinstance(node, ast.ClassDef) and node.name == "KimiK25ForConditionalGeneration")
    methods = {node.name for node in wrapper.body if isinstance(node, ast.FunctionDef)}
    assert {"set_eagle3_layers_to_capture", "get_embed_and_head", "set_embed_and_head"} <= methods   # 0002 upstream
    table = next(node.value for node in ast.walk(ast.parse(sizes)) if isinstance(node, ast.Assign)
                 and [target.id for target in node.targets] == ["TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"])
    assert {key.value for key in table.keys} == {9, 10}   # no SM120 entry: the flag does nothing there
    assert "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES.get(" in symm and "_WORLD_SIZES_MULTIMEM.get(" in symm  # no KeyError
    profile = load_manifest().service["profiles"]["kimi-k2.5-eagle3-0.5.14"]
    assert profile["patches"] == [] and profile["enable_torch_symm_mem"] is False
    assert adaptive_unsupported_reason(fields("kimi-k2.5-eagle3-0.5.14"), load_manifest()) is None


@pytest.mark.parametrize("data, words", [
    ({"service_profile": "kimi-k2.5-eagle3"}, "stack 'sglang-0.5.9' has no adaptive speculation servestack knows"),
    ({"service_speculative_algorithm": "STANDALONE", "service_draft_model_path": "org/draft"},
     "speculative_algorithm STANDALONE: sglang runs adaptive speculation only for EAGLE, EAGLE3, NEXTN"),
    ({"service_extra_args": ["--enable-two-batch-overlap"]}, "extra_args --enable-two-batch-overlap"),
])
def test_a_host_asking_for_adaptive_where_it_cannot_run_is_refused_in_one_line(data, words):
    """Needs settings.py `_consistency` to call profiles.speculation_policy_problems (the lead's edit)."""
    from servestack.errors import ConfigError
    with pytest.raises(ConfigError) as refused:
        settings_from_data("gpu-01", {"service_profile": "glm-5-mtp", "service_speculation": "adaptive", **data})
    lines = [line for line in str(refused.value).splitlines() if "service_speculation" in line]
    assert len(lines) == 1 and lines[0].startswith("host gpu-01: 'service_speculation': 'adaptive' cannot run here: ")
    assert words in lines[0]
    assert settings_from_data("gpu-01", {"service_profile": "glm-5-mtp", "service_speculation": "adaptive"})
    kimi = {"service_profile": "kimi-k2.5-eagle3-0.5.14", "service_speculation": "adaptive"}
    assert settings_from_data("gpu-01", kimi)
