"""`servestack bench` and the speculation policy (issue 17): the decision, what the unit runs under each
policy, the record, the report (table, JSON, chart), the client's arithmetic against the stand-in server
on 127.0.0.1, and the benchmark operation itself through pyinfra's @fake connector with the client
really run here (the health gate answered by a stand-in that restarts the local server)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pyinfra.api import Config
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops
from pyinfra.context import ctx_host, ctx_state

from facts.batch import FactRequest
from facts.framing import split
from operations import service, speculation
from sandbox.standins import fake_sglang_server as standin
from servestack import bench, reads, status
from servestack.cli import build_parser
from servestack.errors import ConfigError
from servestack.hostrun import Reason, reasons
from servestack.settings import settings_from_data
from servestack.speculation_policy import (
    BASELINE,
    CONFIGURATIONS,
    SPECULATION,
    benchmark_reason,
    crossover,
    decide,
    identity_fingerprint,
    make_record,
    means,
    record_is_current,
    speculation_wanted,
)
from servestack.verify import report_console
from tests.unit.fake_host import fake_state, run_here

RELEASE_ID = "r-0123456789ab"
CLIENT_PATH = Path(speculation.CLIENT)
SPECULATIVE = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def settings(**data):
    return settings_from_data("gpu-01", data)


def load_client():
    spec = importlib.util.spec_from_file_location("bench_client", CLIENT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


client = load_client()


# -- the stand-in server on 127.0.0.1 ---------------------------------------------------------------

class LocalServer:
    """The stand-in SGLang server on a loopback port, restartable in either configuration on that port."""

    def __init__(self, throughput: str = "win"):
        self.throughput = standin.Throughput.parse(throughput)
        self.server = None
        self.port = 0
        self.started: list[str] = []

    def start(self, config: str) -> None:
        self.stop()
        argv = ["--model-path", "m", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += SPECULATIVE if config == SPECULATION else []
        self.server = standin.FakeServer(standin.parse(argv), "ok", 0, argv, self.throughput)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.started.append(config)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def local_server():
    made = []

    def make(throughput: str = "win") -> LocalServer:
        made.append(LocalServer(throughput))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def params(url: str, **overrides) -> dict:
    return {"url": url, "prompt": "a fixed prompt", "max_new_tokens": 24, "runs": 3, "warmup": 1,
            "concurrency": [1], "request_timeout_s": 30, **overrides}


# -- decisions ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, spec, base, chosen", [
    ("auto", 96.1, 92.6, "speculation"),    # the reference: +3.8% beats the default 2%
    ("auto", 94.0, 92.6, "baseline"),       # +1.5%: not enough
    ("auto", 80.0, 92.6, "baseline"),
    ("auto", 102.0, 100.0, "speculation"),  # exactly the min gain keeps it
    ("on", 80.0, 92.6, "speculation"),
    ("off", 120.0, 92.6, "baseline"),
])
def test_the_policy_decides_from_both_means(policy, spec, base, chosen):
    decision = decide(policy, 0.02, spec, base)
    assert decision.configuration == chosen
    assert decision.gain == pytest.approx(spec / base - 1)
    assert f"{spec:.1f} tok/s with speculation vs {base:.1f} without" in decision.why


def test_the_decision_says_both_numbers_and_the_threshold():
    kept = decide("auto", 0.02, 96.1, 92.6)
    assert kept.why == ("speculation kept: 96.1 tok/s with speculation vs 92.6 without (+3.8%), at least the "
                        "+2.0% service_speculation_min_gain")
    dropped = decide("auto", 0.05, 96.1, 92.6)
    assert dropped.why.startswith("speculation off: 96.1 tok/s with speculation vs 92.6 without (+3.8%), less "
                                  "than the +5.0% service_speculation_min_gain: the host serves without speculation")
    assert decide("auto", 0.02, 10.0, 0.0).configuration == "speculation"  # a baseline that decoded nothing


def identity(release: str = RELEASE_ID, **changes) -> dict:
    return {"release": release, "patchset": "none", "profile": "kimi-k2.5-eagle3",
            "launch_module": "sglang.launch_server", "arguments": ["--model-path", "m"],
            "environment": [["HOME", "/var/lib/sglang"]], **changes}


def record_for(ident: dict, spec: float, base: float, **extra) -> dict:
    results = {SPECULATION: result(spec, accept=2.4), BASELINE: result(base)}
    decision = decide("auto", 0.02, spec, base)
    made = make_record(ident, "auto", 0.02, results, decision, by="deploy", run_id="run-1", request=None,
                       method_={"runs": 3, "url": "http://127.0.0.1:30000"})
    return {**made, **extra}


def result(mean: float, accept: float | None = None, standin: bool = True, levels=((1, None),)) -> dict:
    runs = [{"output_tokens": 24, "seconds": 24 / speed, "ttft_s": 0.05, "output_tok_s": speed,
             "decode_tok_s": speed * 1.1, "accept_length": accept} for speed in (mean - 1, mean, mean + 1)]
    return {"server": {"standin": standin}, "accept_length": accept, "runs": runs,
            "output_tok_s": {"mean": mean, "min": mean - 1, "max": mean + 1},
            "decode_tok_s": {"mean": mean * 1.1, "min": mean, "max": mean * 1.2},
            "ttft_s": {"mean": 0.05, "min": 0.05, "max": 0.05},
            "concurrency": [{"concurrency": level, "rounds": [tok or mean], "tok_s": {"mean": tok or mean,
                             "min": tok or mean, "max": tok or mean}, "per_request_tok_s": mean}
                            for level, tok in levels]}


def test_auto_serves_the_recorded_decision_only_for_what_was_measured():
    current = identity()
    fingerprint = identity_fingerprint(current)
    losing = record_for(current, 80.0, 92.6)
    assert speculation_wanted("auto", 0.02, losing, fingerprint) is False
    assert speculation_wanted("auto", 0.02, record_for(current, 96.1, 92.6), fingerprint) is True
    # measured for another release, or nothing measured yet: the profile as written until the benchmark decides
    other = identity_fingerprint(identity("r-ba9876543210"))
    assert speculation_wanted("auto", 0.02, losing, other) is True
    assert speculation_wanted("auto", 0.02, None, fingerprint) is True
    # a different min gain decides from the recorded numbers, without measuring again
    assert speculation_wanted("auto", 0.0, record_for(current, 93.0, 92.6), fingerprint) is True
    assert speculation_wanted("auto", 0.01, record_for(current, 93.0, 92.6), fingerprint) is False
    assert speculation_wanted("on", 0.02, losing, fingerprint) is True
    assert speculation_wanted("off", 0.02, record_for(current, 200.0, 92.6), fingerprint) is False


def test_a_benchmark_runs_only_under_auto_when_what_the_service_runs_changed():
    current = identity()
    needed, why = benchmark_reason("auto", 0.02, None, current)
    assert needed and why == "no speculation decision is recorded on the host yet"
    needed, why = benchmark_reason("auto", 0.02, record_for(current, 96.1, 92.6), current)
    assert not needed and why.startswith("measured for what the service runs (by deploy at ")
    assert "speculation kept: 96.1 tok/s with speculation vs 92.6 without (+3.8%)" in why
    old = record_for(identity("r-ba9876543210", arguments=["--model-path", "other"]), 96.1, 92.6)
    needed, why = benchmark_reason("auto", 0.02, old, current)
    assert needed and why == ("what the service runs changed since the last benchmark: the release r-ba9876543210 "
                              f"-> {RELEASE_ID}, the server's command line")
    broken = {**record_for(current, 96.1, 92.6), "configurations": {}}
    assert benchmark_reason("auto", 0.02, broken, current) == (
        True, "the record of the last benchmark holds no usable numbers")
    for policy in ("on", "off"):
        needed, why = benchmark_reason(policy, 0.02, None, current)
        assert not needed and why.startswith(f"service_speculation = '{policy}': the unit runs")
        assert "servestack bench measures on demand" in why


def test_the_record_keeps_both_configurations_the_decision_and_what_was_measured():
    made = record_for(identity(), 96.1, 92.6)
    assert made["fingerprint"] == identity_fingerprint(identity()) and made["identity"] == identity()
    assert (made["decision"], made["policy"], made["min_gain"], made["by"]) == ("speculation", "auto", 0.02, "deploy")
    assert made["simulated"] is True and "url" not in made["method"]
    assert means(made) == (96.1, 92.6)
    assert record_is_current(made, made["fingerprint"]) and not record_is_current(made, "other")
    real = make_record(identity(), "on", 0.02, {SPECULATION: result(96.1, standin=False),
                                                BASELINE: result(92.6, standin=False)},
                       decide("on", 0.02, 96.1, 92.6), by="bench", run_id="r", request="q", method_={})
    assert real["simulated"] is False and real["request"] == "q"


def test_the_crossover_is_the_first_level_where_speculation_no_longer_wins():
    made = record_for(identity(), 96.1, 92.6)
    made["configurations"][SPECULATION] = result(96.1, levels=((1, 96.1), (4, 330.0), (16, 700.0)))
    made["configurations"][BASELINE] = result(92.6, levels=((1, 92.6), (4, 320.0), (16, 880.0)))
    assert crossover(made) == 16
    made["configurations"][BASELINE] = result(92.6, levels=((1, 92.6), (4, 320.0), (16, 690.0)))
    assert crossover(made) is None


def test_what_the_service_runs_names_the_release_patches_profile_line_and_environment():
    s = settings(service_speculation="auto")
    rel = service.release(s, RELEASE_ID)
    state = fake_state({})
    target = state.inventory.get_host("@fake/gpu1")
    with ctx_state.use(state), ctx_host.use(target):
        found = service.service_identity(s, rel)
    assert found["release"] == RELEASE_ID and found["patchset"] == "none" and found["profile"] == "kimi-k2.5-eagle3"
    assert found["arguments"] == service.launch_arguments(s, True)
    assert ["SERVESTACK_RELEASE", RELEASE_ID] in found["environment"]


# -- the unit under each policy -----------------------------------------------------------------

def test_off_renders_the_unit_without_the_speculative_flags_and_on_with_them():
    s = settings()
    rel = service.release(s, RELEASE_ID)
    with_flags = service.render_unit(s, rel, None, speculation=True)
    without = service.render_unit(s, rel, None, speculation=False)
    assert "--speculative-algorithm EAGLE3" in with_flags and "--speculative-draft-model-path" in with_flags
    assert "--speculative" not in without and "--enable-torch-symm-mem" in without
    assert service.render_unit(s, rel, None) == with_flags  # the default renders the profile as written


def unit_for(data: dict, record: dict | None) -> str:
    responses = {"cat /var/lib/servestack/speculation.json": json.dumps(record)} if record else {}
    state = fake_state({"fake_responses": responses, **data})
    target = state.inventory.get_host("@fake/gpu1")
    s = settings(**data)
    with ctx_state.use(state), ctx_host.use(target):
        rel = service.release(s, RELEASE_ID)
        current = service.service_identity(s, rel)
        return service.desired_unit(s, rel, ()), current


@pytest.mark.parametrize("policy, spec, wanted", [("auto", 80.0, False), ("auto", 110.0, True), ("off", 110.0, False),
                                                  ("on", 80.0, True)])
def test_the_service_step_renders_what_the_policy_and_the_record_say(policy, spec, wanted):
    data = {"service_speculation": policy}
    _, current = unit_for(data, None)
    text, _ = unit_for(data, record_for(current, spec, 90.0))
    assert ("--speculative-algorithm" in text) is wanted
    stale = record_for(identity("r-ba9876543210"), 80.0, 90.0)
    assert ("--speculative-algorithm" in unit_for(data, stale)[0]) is (policy != "off")


def test_the_settings_declare_the_policy_keys():
    s = settings()
    assert (s.service_speculation, s.service_speculation_min_gain) == ("on", 0.02)
    assert settings(service_speculation="auto", service_speculation_min_gain=0.05).service_speculation_min_gain == 0.05
    for data, expected in (
            ({"service_speculation": "maybe"}, "'service_speculation': expected one of 'on', 'off', 'auto'"),
            ({"service_speculation_min_gain": 2}, "'service_speculation_min_gain': expected a fraction"),
            ({"service_speculation_min_gain": True}, "'service_speculation_min_gain': expected a fraction")):
        with pytest.raises(ConfigError, match=expected):
            settings(**data)


def test_the_benchmark_request_comes_from_the_manifest():
    s = settings()
    table = s.manifest.service["speculation_benchmark"]
    found = speculation.method(s)
    assert (found["prompt"], found["max_new_tokens"], found["runs"]) == (table["prompt"], table["max_new_tokens"],
                                                                        table["runs"])
    assert speculation.method(s, runs=3, concurrency=[16, 4])["concurrency"] == [1, 4, 16]
    assert speculation.method(s, runs=3)["runs"] == 3
    assert bench.parse_levels("1,4,16") == [1, 4, 16] and bench.parse_levels(None) is None
    for bad in ("0", "a,b", "", "4,2000"):
        with pytest.raises(ConfigError, match="--concurrency"):
            bench.parse_levels(bad)


def test_a_bad_benchmark_table_in_the_manifest_is_named(tmp_path):
    from servestack.manifest import DEFAULT_MANIFEST
    from servestack.errors import ManifestError

    path = tmp_path / "stack.toml"
    path.write_text(DEFAULT_MANIFEST.read_text().replace("\nruns = 10\n", '\nruns = "ten"\n'))
    with pytest.raises(ManifestError, match="key 'service.speculation_benchmark.runs': expected an integer from 1"):
        settings(servestack_manifest=str(path))


# -- the client's arithmetic --------------------------------------------------------------------

def test_per_request_rates_and_statistics():
    rates = client.per_request({"seconds": 2.0, "ttft_s": 0.4, "completion_tokens": 160, "accept_length": 2.5})
    assert rates["output_tok_s"] == 80.0 and rates["decode_tok_s"] == 100.0 and rates["accept_length"] == 2.5
    assert client.stats([1.0, 2.0, 6.0]) == {"mean": 3.0, "min": 1.0, "max": 6.0} and client.stats([]) is None
    samples = [{"completion_tokens": 100}, {"completion_tokens": 100}]
    assert client.round_rate(samples, 2.0) == 100.0
    assert client.accept_length({"internal_states": [{"avg_spec_accept_length": 2.41}]}) == 2.41
    assert client.accept_length({"internal_states": [{}]}) is None and client.accept_length({}) is None
    assert client.server_facts({"speculative_algorithm": "EAGLE3", "version": "0.5.9"}) == {
        "standin": False, "version": "0.5.9", "speculative_algorithm": "EAGLE3", "simulation": None}


# The stand-in's simulated server (its docstring): the first token after 0.05 s, then 110 tok/s with
# speculation, 90 without; "jitter=0" leaves each request exactly that.
STANDIN_TTFT_S = 0.05
STANDIN_DECODE_TOK_S = {SPECULATION: 110.0, BASELINE: 90.0}


def test_the_client_measures_the_stand_in_over_loopback(local_server):
    """What a sleep guarantees on any machine, however loaded: the client never sees the stand-in's first
    token before its TTFT, nor its last before the simulated decode time; how much later is the machine's
    doing, so the upper bounds on time are only a safety net (twice the simulated time)."""
    server = local_server("win,jitter=0")
    measured = {}
    for config in CONFIGURATIONS:
        server.start(config)
        measured[config] = client.measure(params(server.url))
    for config, found in measured.items():
        decode_s = 23 / STANDIN_DECODE_TOK_S[config]   # the 23 tokens after the first
        assert found["server"]["standin"] is True and len(found["runs"]) == 3
        for run in found["runs"]:
            assert run["output_tokens"] == 24   # ignore_eos: exactly max_new_tokens
            assert run["output_tok_s"] == pytest.approx(24 / run["seconds"], rel=1e-4)   # seconds kept to the µs
            assert run["decode_tok_s"] == pytest.approx(24 / (run["seconds"] - run["ttft_s"]), rel=1e-4)
            assert run["ttft_s"] >= STANDIN_TTFT_S, run                   # the first chunk, not the headers
            assert run["seconds"] - run["ttft_s"] > decode_s / 2, run     # ... nor the last
            assert STANDIN_TTFT_S + decode_s <= run["seconds"] < 2 * (STANDIN_TTFT_S + decode_s), run
        assert found["output_tok_s"]["min"] <= found["output_tok_s"]["mean"] <= found["output_tok_s"]["max"]
    spec, base = measured[SPECULATION], measured[BASELINE]
    assert spec["output_tok_s"]["mean"] > base["output_tok_s"]["mean"]
    assert spec["accept_length"] == pytest.approx(2.6, abs=0.3) and base["accept_length"] is None
    assert spec["runs"][0]["accept_length"] == pytest.approx(2.6, abs=0.4)


def test_higher_concurrency_finds_the_crossover(local_server):
    server = local_server("crossover=3,jitter=0")
    levels = {}
    for config in CONFIGURATIONS:
        server.start(config)
        found = client.measure(params(server.url, runs=2, warmup=0, concurrency=[1, 32], max_new_tokens=16))
        levels[config] = {level["concurrency"]: level["tok_s"]["mean"] for level in found["concurrency"]}
        assert [level["concurrency"] for level in found["concurrency"]] == [1, 32]
        assert len(found["concurrency"][1]["rounds"]) == 2
    assert levels[SPECULATION][1] > levels[BASELINE][1]
    assert levels[SPECULATION][32] < levels[BASELINE][32]
    assert levels[BASELINE][32] > 8 * levels[BASELINE][1]   # rounds add up their requests' tokens


def test_the_client_runs_as_the_host_runs_it_and_fails_with_a_reason(local_server):
    server = local_server("win")
    server.start(SPECULATION)
    command = speculation.client_command(sys.executable, params(server.url, runs=1, warmup=0, max_new_tokens=4))
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(split(proc.stdout.splitlines())[speculation.RESULT].text)["output_tok_s"]["mean"] > 0
    server.stop()
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"servestack: benchmark of {server.url}: POST /generate to {server.url} failed")


def test_the_stand_in_knobs_parse_and_refuse_nonsense():
    assert standin.Throughput.parse("lose").speculation < standin.Throughput.parse("lose").baseline
    crossing = standin.Throughput.parse("crossover=8")
    assert crossing.rate(True, 8) == pytest.approx(crossing.rate(False, 8))
    assert crossing.rate(True, 1) > crossing.rate(False, 1) and crossing.rate(True, 16) < crossing.rate(False, 16)
    assert standin.Throughput.parse("reference,seed=3") == standin.Throughput(baseline=92.6, speculation=96.1,
                                                                             accept=2.1, jitter=0.08, seed=3)
    for bad in ("fast", "win,colour=blue", "crossover=1", "win,baseline=0"):
        with pytest.raises(ValueError):
            standin.Throughput.parse(bad)


def test_the_stand_in_can_fail_only_its_baseline(monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SGLANG_MODE_BASELINE", "crash")
    assert standin.main(["--model-path", "m", "--port", "1"]) == 1
    assert "told to crash" in capsys.readouterr().err
    monkeypatch.setenv("FAKE_SGLANG_THROUGHPUT", "nonsense")
    assert standin.main(["--model-path", "m", "--port", "1", *SPECULATIVE]) == 2


# -- the report ---------------------------------------------------------------------------------

def reports() -> dict:
    measured = record_for(identity(), 96.1, 92.6, request="q")
    measured["configurations"][SPECULATION] = result(96.1, accept=2.41, levels=((1, 96.1), (4, 330.0), (16, 700.0)))
    measured["configurations"][BASELINE] = result(92.6, levels=((1, 92.6), (4, 320.0), (16, 880.0)))
    return {"h1": bench.host_report(measured, "q"), "h2": bench.host_report(record_for(identity(), 50, 50), "q"),
            "h3": bench.host_report(None, "q", "cannot read its record: ssh failed")}


def test_the_table_per_host_and_the_plain_simulated_notice():
    out = io.StringIO()
    bench.render_tables(reports(), report_console(file=out))
    text = out.getvalue()
    assert f"h1: kimi-k2.5-eagle3 on {RELEASE_ID} (SIMULATED by the sandbox stand-in)" in text
    for column in ("configuration", "runs", "mean tok/s", "min-max", "decode tok/s", "TTFT s", "accept length",
                   "gain over baseline"):
        assert column in text
    assert "95.1-97.1" in text and "2.41" in text and "+3.8%" in text
    assert "h1: aggregate output tok/s by concurrency" in text
    assert "h1: speculation stops paying at concurrency 16" in text
    assert "h1: speculation kept: 96.1 tok/s with speculation vs 92.6 without (+3.8%)" in text
    assert "h2: not measured: this run recorded no measurement (see its output above)" in text
    assert "h3: not measured: cannot read its record: ssh failed" in text
    assert bench.SIMULATED_NOTICE in text


def test_the_json_document_says_it_is_simulated():
    found = json.loads(bench.render_json(reports(), "q"))
    assert found["simulated"] is True and found["notice"] == bench.SIMULATED_NOTICE and found["request"] == "q"
    one = found["hosts"]["h1"]
    assert (one["measured"], one["decision"], one["crossover"], one["policy"]) == (True, "speculation", 16, "auto")
    assert one["configurations"]["speculation"]["accept_length"] == 2.41
    assert found["hosts"]["h3"] == {"measured": False, "error": "cannot read its record: ssh failed"}


def test_the_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = bench.plot(reports(), tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ConfigError, match="no host was measured"):
        bench.plot({"h3": reports()["h3"]}, tmp_path / "none.png")


def test_the_status_column_shows_the_recorded_decision():
    record = record_for(identity(), 96.1, 92.6)
    summary = bench.status_summary(record, RELEASE_ID)
    assert summary["decision"] == "speculation" and summary["for_active_release"] and summary["simulated"]
    cell = bench.status_cell(summary)
    assert cell.splitlines()[:3] == ["speculation (auto)", "96.1 vs 92.6 tok/s (+3.8%)", "accept length 2.40"]
    assert "SIMULATED (stand-in)" in cell
    assert "not the active one" in bench.status_cell(bench.status_summary(record, "r-ba9876543210"))
    assert bench.status_summary(None, RELEASE_ID) == "n/a" == bench.status_cell("n/a")
    readings = status.StatusReadings(env=None, speculation=record)
    found = status.host_status(settings(service_speculation="off"), readings)["speculation"]
    assert found["baseline_tok_s"] == 92.6 and (found["decision"], found["now"]) == ("speculation", "baseline")
    assert "now baseline: the host's service_speculation settings changed since" in bench.status_cell(found)


def test_the_cli_and_the_pyinfra_command(monkeypatch):
    args = build_parser().parse_args(["bench", "inv.py", "--runs", "5", "--concurrency", "1,4", "--json", "b.json",
                                      "--plot", "b.png", "--limit", "h1", "--limit", "gpu"])
    assert (args.runs, args.concurrency, args.json_path, args.plot_path, args.limit) == (5, "1,4", "b.json", "b.png",
                                                                                        ["h1", "gpu"])
    argv = bench.pyinfra_argv("inv.py", args.limit, {"runs": 5})
    assert argv[1:6] == ["-y", "--limit", "h1", "--limit", "gpu"]
    assert bench.pyinfra_argv("inv.py", (), {"runs": 5}, dry=True)[1] == "--dry"
    assert argv[-2:] == [bench.ON_DEMAND, json.dumps([[], {"runs": 5}])]
    monkeypatch.setattr(bench, "plotting_available", lambda: False)
    with pytest.raises(ConfigError, match="--plot needs matplotlib, the 'plot' extra"):
        bench.bench_main("inv.py", plot_path="b.png")


class Runs:
    """What bench_main asked pyinfra to do, instead of running it; the hosts then hold no record of the run."""

    def __init__(self, monkeypatch, tmp_path, status: int = 0, answer: str | None = None, terminal: bool = True):
        self.argvs: list[list[str]] = []
        self.inventory = tmp_path / "fleet.py"
        self.inventory.write_text('hosts = [("gpu-a", {"ssh_hostname": "192.0.2.10"})]\n')
        monkeypatch.setattr(bench, "run_pyinfra", lambda argv: self.argvs.append(argv) or status)
        monkeypatch.setattr(bench, "read_all", lambda targets, requests: {t.name: [None] for t in targets})
        monkeypatch.setattr(sys, "stdin", io.StringIO(answer or ""))
        monkeypatch.setattr(sys.stdin, "isatty", lambda: terminal)

    def modes(self) -> list[str]:
        return [argv[1] for argv in self.argvs]


def test_bench_without_a_terminal_to_ask_on_refuses_unless_told_yes(monkeypatch, tmp_path, capsys):
    runs = Runs(monkeypatch, tmp_path, terminal=False)
    with pytest.raises(ConfigError, match="pass -y to run without asking, or --dry to see what it would do"):
        bench.bench_main(str(runs.inventory))
    assert runs.argvs == []
    assert bench.bench_main(str(runs.inventory), yes=True) == 1 and runs.modes() == ["-y"]   # nothing recorded


def test_bench_dry_shows_the_plan_and_restarts_nothing(monkeypatch, tmp_path, capsys):
    runs = Runs(monkeypatch, tmp_path, terminal=False)
    assert bench.bench_main(str(runs.inventory), dry=True) == 0
    assert runs.modes() == ["--dry"] and "nothing was restarted or measured" in capsys.readouterr().err


@pytest.mark.parametrize(("answer", "modes"), [("\n", ["--dry"]), ("n\n", ["--dry"]), ("y\n", ["--dry", "-y"]),
                                               ("yes\n", ["--dry", "-y"])])
def test_bench_on_a_terminal_shows_the_plan_then_asks(monkeypatch, tmp_path, capsys, answer, modes):
    runs = Runs(monkeypatch, tmp_path, answer=answer)
    status_ = bench.bench_main(str(runs.inventory))
    assert runs.modes() == modes
    assert "Restart the services above and benchmark them? [y/N]" in capsys.readouterr().err
    assert status_ == (0 if modes == ["--dry"] else 1)


def test_bench_plot_with_nothing_measured_says_no_chart_was_drawn(monkeypatch, tmp_path, capsys):
    runs = Runs(monkeypatch, tmp_path)
    monkeypatch.setattr(bench, "plotting_available", lambda: True)
    chart = tmp_path / "bench.png"
    assert bench.bench_main(str(runs.inventory), plot_path=str(chart), yes=True) == 1
    assert f"--plot {chart}: no chart drawn: no host was measured" in capsys.readouterr().err
    assert not chart.exists()


def test_bench_dry_and_yes_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "inv.py", "--dry", "-y"])
    assert build_parser().parse_args(["bench", "inv.py", "--yes"]).yes


# -- the operation, through pyinfra's @fake connector ------------------------------------------------

def test_a_dry_run_says_whether_it_would_benchmark_and_why(caplog):
    caplog.set_level(logging.INFO, logger="pyinfra")
    state = fake_state({"service_speculation": "auto"}, Config(DIFF=True))
    rel = service.release(settings(service_speculation="auto"), RELEASE_ID)
    add_deploy(state, speculation.speculation, release=rel)
    assert "will benchmark sglang.service with and without speculation (10 runs of 256 tokens, concurrency 1; " \
           "sglang.service restarted through the health gate for each configuration, and once more into the one the " \
           "policy chooses when that is not the last; each restart waits up to 1800 s for /health): no speculation " \
           "decision is recorded" in caplog.text
    target = state.inventory.get_host("@fake/gpu1")
    assert state.get_meta_for_host(target).ops_change == 1

    caplog.clear()
    for data in ({}, {"service_speculation": "off"}):
        quiet = fake_state(data, Config(DIFF=True))
        add_deploy(quiet, speculation.speculation, release=rel)
        assert "will benchmark" not in caplog.text and "no benchmark" in caplog.text
        assert quiet.get_meta_for_host(quiet.inventory.get_host("@fake/gpu1")).ops_change == 0


def test_the_step_lists_what_it_reads(monkeypatch):
    keys = []
    real = reads.fact
    monkeypatch.setattr(reads, "fact", lambda host, cls, **kwargs: keys.append(FactRequest.of(cls, **kwargs).key)
                        or real(host, cls, **kwargs))
    data = {"service_speculation": "auto"}
    state = fake_state(data)
    rel = service.release(settings(**data), RELEASE_ID)
    add_deploy(state, speculation.speculation, release=rel)
    assert keys and set(keys) <= {request.key for request in speculation.host_reads(settings(**data), rel)}


class Gate:
    """The health gate as the host would run it, here: the local stand-in restarted in the gated
    configuration; `failing` configurations do not become healthy (the gate rolls back: the server
    keeps the configuration it had)."""

    def __init__(self, server: LocalServer, failing: tuple[str, ...] = ()):
        self.server, self.failing, self.runs = server, failing, []

    def __call__(self, command: str) -> subprocess.CompletedProcess:
        config = next(name for name in CONFIGURATIONS if f"start of the {name} configuration" in command)
        self.runs.append(config)
        if config in self.failing:
            return subprocess.CompletedProcess(command, 1, "", "servestack: sglang.service on release "
                                               f"{RELEASE_ID} failed: no HTTP 200 from GET /health within 20 s; rolled "
                                               "back to the last unit that passed the health gate, which is healthy")
        self.server.start(config)
        return subprocess.CompletedProcess(command, 0, "servestack: sglang.service is healthy\n", "")


def run_benchmark(monkeypatch, tmp_path, server: LocalServer, gate: Gate, **data):
    """The deploy's step on @fake/gpu1, the gate answered by `gate`, the client and the record's write
    really run here (the state dir is `tmp_path`)."""
    def ours(command: str) -> bool:
        return "sglang-health-gate.sh" in command or "bench-client.py" in command or str(tmp_path) in command

    def run(command: str) -> subprocess.CompletedProcess:
        if "sglang-health-gate.sh" in command:
            return gate(command)
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)

    run_here(monkeypatch, ours, run)
    host_data = {"service_speculation": "auto", "service_port": server.port, "servestack_state_dir": str(tmp_path),
                 "venv_python": sys.executable, **data}
    state = fake_state(host_data, check_for_changes=False)
    s = settings(**host_data)
    # the benchmark's request, small: 3 runs of 16 tokens
    monkeypatch.setattr(speculation, "method", lambda settings_, runs=None, concurrency=None: {
        "prompt": "p", "max_new_tokens": 16, "runs": 3, "warmup": 0, "concurrency": [1], "request_timeout_s": 30})
    add_deploy(state, speculation.speculation, release=service.release(s, RELEASE_ID))
    target = state.inventory.get_host("@fake/gpu1")
    return state, target


@pytest.mark.parametrize("throughput, chosen, gates", [
    ("win,jitter=0", "speculation", ["baseline", "speculation"]),
    ("lose,jitter=0", "baseline", ["baseline", "speculation", "baseline"])])
def test_auto_measures_both_configurations_through_the_gate_and_keeps_the_winner(
        monkeypatch, tmp_path, local_server, caplog, throughput, chosen, gates):
    caplog.set_level(logging.INFO, logger="pyinfra")
    server = local_server(throughput)
    server.start(SPECULATION)   # what the service step left running
    gate = Gate(server)
    state, target = run_benchmark(monkeypatch, tmp_path, server, gate)
    run_ops(state)
    assert not state.failed_hosts, caplog.text
    assert gate.runs == gates and server.started[-1] == chosen
    record = json.loads((tmp_path / "speculation.json").read_text())
    assert record["decision"] == chosen and record["by"] == "deploy" and record["simulated"] is True
    assert record["configurations"]["speculation"]["accept_length"] is not None
    assert record["configurations"]["baseline"]["accept_length"] is None
    said = "speculation kept" if chosen == "speculation" else "speculation off"
    assert f"{said}: " in caplog.text and "tok/s with speculation vs" in caplog.text
    commands = target.connector.executed_commands
    staged = [command for command in commands if "atomic-write.sh" in command
              and f"/opt/servestack/releases/{RELEASE_ID}/sglang.service." in command]
    assert len(staged) == len(gates)  # each start staged its unit, which its gate installs
    assert not [command for command in commands if "atomic-write.sh" in command
                and "/etc/systemd/system/sglang.service " in command]   # never written but by the gate
    assert any(f"/opt/servestack/releases/{RELEASE_ID}/sglang.service" in command
               for command in target.connector.executed_commands)   # the release's copy of the chosen unit


def test_a_configuration_that_fails_its_gate_leaves_the_last_good_unit_and_records_nothing(
        monkeypatch, tmp_path, local_server, caplog):
    server = local_server("win")
    server.start(SPECULATION)
    gate = Gate(server, failing=(BASELINE,))
    state, target = run_benchmark(monkeypatch, tmp_path, server, gate)
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        run_ops(state)
    assert gate.runs == ["baseline"] and server.started == ["speculation"]   # still serving what it served
    assert not (tmp_path / "speculation.json").exists()
    assert not any("bench-client.py" in command for command in target.connector.executed_commands)
    assert reasons(state)["@fake/gpu1"] == [Reason("failed",
        "health-gated start of the baseline configuration of sglang.service failed: servestack: sglang.service on "
        f"release {RELEASE_ID} failed: no HTTP 200 from GET /health within 20 s; rolled back to the last unit that "
        "passed the health gate, which is healthy")]


def test_a_failed_measurement_fails_the_host_and_records_nothing(monkeypatch, tmp_path, local_server, caplog):
    server = local_server("win")
    server.start(SPECULATION)

    class DeadAfterGate(Gate):
        def __call__(self, command):
            done = super().__call__(command)
            self.server.stop()   # healthy at the gate, gone when the client asks
            return done

    state, _ = run_benchmark(monkeypatch, tmp_path, server, DeadAfterGate(server))
    with pytest.raises(PyinfraError, match="No hosts remaining"):
        run_ops(state)
    assert "the benchmark of the baseline configuration failed: servestack: benchmark of" in caplog.text
    assert not (tmp_path / "speculation.json").exists()


def test_a_current_record_means_no_benchmark(monkeypatch, tmp_path, local_server):
    server = local_server("win")
    server.start(SPECULATION)
    gate = Gate(server)
    state, target = run_benchmark(monkeypatch, tmp_path, server, gate)
    run_ops(state)
    first = json.loads((tmp_path / "speculation.json").read_text())
    again, target = run_benchmark(monkeypatch, tmp_path, server, gate)
    run_ops(again)
    assert gate.runs == ["baseline", "speculation"]   # nothing more
    assert json.loads((tmp_path / "speculation.json").read_text()) == first
    assert again.get_meta_for_host(target).ops_change == 0
