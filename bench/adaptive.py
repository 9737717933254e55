"""Adaptive speculation against static speculation and the baseline on the stand-in server (issue 33).

    .venv/bin/python bench/adaptive.py                                  # crossover=8, win, lose; 1,4,16,64
    .venv/bin/python bench/adaptive.py --throughput crossover=24 --levels 1,4,16,32,64 --runs 5 --note "..."
    .venv/bin/python bench/adaptive.py --throughput crossover=24 --probe-levels 32,48   # between the levels

For each simulated throughput (the stand-in's FAKE_SGLANG_THROUGHPUT), the stand-in server
(sandbox/standins/fake_sglang_server.py) is started here on 127.0.0.1 three times, as a deploy under
service_speculation = "adaptive" starts the host's: without the speculative flags ("baseline"), with the
GLM-5 profile's static speculation ("speculation"), and with `--speculative-adaptive
--speculative-adaptive-config FILE` ("adaptive"), FILE written from the first two's numbers by the
deploy's own decision (servestack/speculation_policy.py `adaptive_plan`). Each is measured by the deploy's
own client (files/scripts/bench-client.py `measure`: `--runs` requests at concurrency 1, then `--runs` rounds
per level). `--probe-levels` are measured too but left out of the decision, as a deploy that measures only
`--levels` would decide: they show what happens between the levels measured. Prints, per level, the three
aggregate tok/s and adaptive against the better of the other two, and writes bench/results/<git short
sha>[-dirty]-adaptive-<UTC>.json. Every number is the stand-in's SIMULATION: it says how the config servestack
writes behaves under a load model, not how SGLang does on GPUs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write_result  # noqa: E402
from servestack.speculation_policy import (  # noqa: E402  (the project root on the path first)
    ADAPTIVE,
    BASELINE,
    SPECULATION,
    adaptive_config_text,
    adaptive_plan,
    gain_of,
    level_means,
)

CLIENT = ROOT / "files" / "scripts" / "bench-client.py"
# The GLM-5 profile's speculation (files/stack.toml [service.profiles."glm-5-mtp"]): NEXTN 3/1/4, own draft.
STATIC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
          "--speculative-num-draft-tokens", "4"]
PROMPT = "Explain how a CUDA toolkit, a driver and a Python ML environment fit together."


def client():
    spec = importlib.util.spec_from_file_location("bench_client", CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(throughput: str, flags: list[str], params: dict) -> dict:
    """Start the stand-in with `flags`, wait for /health, measure it with the deploy's client, stop it."""
    port = free_port()
    argv = [sys.executable, "-m", "sandbox.standins.fake_sglang_server", "--model-path", "m", "--tp", "8",
            *flags, "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "FAKE_SGLANG_THROUGHPUT": throughput, "FAKE_SGLANG_STARTUP_S": "0"}
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the stand-in exited {server.returncode}: {server.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the stand-in never became healthy")
            time.sleep(0.1)
        return client().measure({**params, "url": url})
    finally:
        server.terminate()
        server.wait()


def decided_on(results: dict, levels: list[int]) -> dict:
    """The results as a deploy measuring only `levels` would have them."""
    return {config: {**result, "concurrency": [level for level in result["concurrency"]
                                               if level["concurrency"] in levels]}
            for config, result in results.items()}


def one_throughput(throughput: str, params: dict, min_gain: float, decision_levels: list[int]) -> dict:
    results = {BASELINE: measure(throughput, [], params), SPECULATION: measure(throughput, STATIC, params)}
    plan = adaptive_plan(min_gain, decided_on(results, decision_levels))
    assert plan is not None
    if plan.config is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config:
            config.write(adaptive_config_text(plan.config))
        try:
            results[ADAPTIVE] = measure(throughput, [*STATIC, "--speculative-adaptive",
                                                     "--speculative-adaptive-config", config.name], params)
        finally:
            os.unlink(config.name)
    return {"throughput": throughput, "plan": plan.as_record(), "levels": by_level(results),
            "results": results}


def by_level(results: dict) -> list[dict]:
    means = {config: level_means(results, config) for config in results}
    rows = []
    for level in sorted(means[BASELINE]):
        row = {"concurrency": level, **{config: means[config].get(level) for config in means}}
        best = max(row[SPECULATION], row[BASELINE])
        row["best_static"] = SPECULATION if row[SPECULATION] >= row[BASELINE] else BASELINE
        row["adaptive_vs_best"] = gain_of(row[ADAPTIVE], best) if row.get(ADAPTIVE) is not None else None
        rows.append(row)
    return rows


def show(outcome: dict) -> None:
    print(f"\n{outcome['throughput']}: {outcome['plan']['why']}")
    print(f"{'level':>6} {'speculation':>12} {'baseline':>10} {'adaptive':>10} {'adaptive vs best':>17}")
    for row in outcome["levels"]:
        adaptive = "-" if row.get(ADAPTIVE) is None else f"{row[ADAPTIVE]:.1f}"
        versus = "-" if row["adaptive_vs_best"] is None else f"{row['adaptive_vs_best']:+.1%} ({row['best_static']})"
        print(f"{row['concurrency']:>6} {row[SPECULATION]:>12.1f} {row[BASELINE]:>10.1f} {adaptive:>10} {versus:>17}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--throughput", action="append", help="FAKE_SGLANG_THROUGHPUT (repeatable)")
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--probe-levels", default="", help="measured, but not part of the decision")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--min-gain", type=float, default=0.02)
    parser.add_argument("--note", default="")
    options = parser.parse_args()
    levels = [int(level) for level in options.levels.split(",")]
    probes = [int(level) for level in options.probe_levels.split(",") if level]
    params = {"prompt": PROMPT, "max_new_tokens": options.tokens, "runs": options.runs, "warmup": 1,
              "concurrency": sorted({*levels, *probes}), "request_timeout_s": 600}
    outcomes = []
    for throughput in options.throughput or ["crossover=8", "win", "lose"]:
        outcomes.append(one_throughput(throughput, params, options.min_gain, levels))
        show(outcomes[-1])
    path = write_result({"benchmark": "adaptive speculation on the stand-in (SIMULATED)", "note": options.note,
                         "params": params, "decision_levels": levels, "probe_levels": probes,
                         "min_gain": options.min_gain, "outcomes": outcomes}, "adaptive")
    print(f"\nSIMULATED by the stand-in server; written {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
