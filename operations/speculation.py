"""Step `speculation`: the speculation policy, and the benchmark that decides it (issue 17).

Host data `service_speculation` says whether the unit runs the profile's speculative flags: "on"
(default, as the reference deployments), "off", "auto": measured, or "adaptive": SGLang's adaptive
speculation with a config from this host's measurements. operations/service.py renders the unit
accordingly (`service.served_now`); this step runs after it (deploy.py) and, under "auto" and
"adaptive", benchmarks the host when no measurement is recorded for what the service runs now (its
release, patch set, profile, command line, environment: servestack/speculation_policy.py
`identity_fingerprint`), so a converge that changed none of those never benchmarks again. A dry run
says for each host whether it would benchmark and why.

The benchmark (`benchmark`: one FunctionCommand at execute, hosts a `rollout_batch` at a time):
  1. baseline: the unit without the speculative flags is written (files/scripts/atomic-write.sh)
     and started through the deploy's own health gate (files/scripts/sglang-health-gate.sh, with
     `service.gate_environment`, under busy.sh as the service step's restart runs it); then
     files/scripts/bench-client.py measures it from the host itself, over loopback;
  2. speculation: the same with the profile's speculative flags;
  3. the policy decides from both means (servestack/speculation_policy.py `decide`); under
     "adaptive", from both configurations' numbers per concurrency level (`adaptive_plan`, levels
     ADAPTIVE_LEVELS unless `servestack bench --concurrency` names others): SGLang's adaptive config is
     written into the release (a file named by its content) and the adaptive configuration is
     started through the gate and measured the same way (where speculation pays at no level, the
     baseline is served and nothing more is measured); unless the policy chose the configuration
     running now, that configuration's unit is started through the gate again; the unit is copied into
     the release (the unit that release runs with);
  4. the measurement and the decision are recorded in `<servestack_state_dir>/speculation.json`
     (bookkeeping, `hostrun.write_record`). The run says the decision with both numbers.
A configuration that does not become healthy is rolled back by the gate to the last unit that
passed it (the unit the service step started, or the baseline just measured), the host fails with
the gate's reason, and nothing is recorded: the service keeps serving and the next deploy measures
again. Each configuration is measured on a freshly started server, since the accept length SGLang
reports is a running average since start.

`bench_now` is `servestack bench` on a host (servestack/bench.py runs it through pyinfra's CLI):
preflight, the host's lock, the benchmark whatever the policy, the lock's release.
"""

from __future__ import annotations

import base64
import functools
import json
import shlex
from dataclasses import dataclass
from typing import Callable

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation
from pyinfra.facts.server import Groups

from facts.batch import FactRequest
from facts.framing import split
from facts.service import PatchsetDigest, ServiceRecord, UnitState
from operations import patches, preflight, service, venv
from operations.patches import patchset_digest
from servestack import reads
from servestack.hostrun import (
    REFUSED,
    fail_host,
    is_executing,
    noop,
    refuse,
    run_id,
    run_remote,
    said_in,
    utc_stamp,
    while_busy,
    write_record,
)
from servestack.manifest import PROJECT_ROOT
from servestack.paths import (
    benchmark_marker_path,
    benchmark_unit_path,
    service_record_path,
    speculation_record_path,
    unit_copy_path,
)
from servestack.releases import Release
from servestack.scripts import atomic_write_command, python_script_command, script_command
from servestack.serving import check_url, speculates
from servestack.settings import Settings, host_settings
from servestack.speculation_policy import (
    ADAPTIVE,
    ADAPTIVE_LEVELS,
    BASELINE,
    CONFIGURATIONS,
    SPECULATION,
    AdaptivePlan,
    Decision,
    Served,
    adaptive_plan,
    benchmark_reason,
    decide,
    gain_of,
    make_record,
)

# The operation's name: the run's recap and its interruption notice treat it as the restarts it makes
# (servestack/runreport.py matches "health-gated restart").
BENCHMARK = "Health-gated restarts: speculation benchmark"
CLIENT = PROJECT_ROOT / "files" / "scripts" / "bench-client.py"
RESULT = "result"   # the section the client prints its measurement in (facts/framing.py)


def host_reads(settings: Settings, release: Release | None = None) -> list[FactRequest]:
    """What `speculation` and `bench_now` read of a host (deploy.py reads them all in one command):
    the decision's record, the health gate's record and the unit (on demand), the GPU groups (when
    benchmarking), what the service runs (the release's patch set)."""
    requests = [FactRequest.of(ServiceRecord, path=speculation_record_path(settings)),
                FactRequest.of(ServiceRecord, path=benchmark_marker_path(settings)),
                FactRequest.of(ServiceRecord, path=service_record_path(settings)),
                FactRequest.of(UnitState, unit=settings.service_name),
                FactRequest.of(Groups)]
    if release is not None:   # what the service runs: its release's patch set (patches.patchset_digest)
        requests += [FactRequest.of(PatchsetDigest, release_dir=release.dir), *patches.host_reads(settings, release)]
    return requests


# -- the request and the client ------------------------------------------------------------------

def method(settings, runs: int | None = None, concurrency=None) -> dict:
    """The benchmark's request: the manifest's [service.speculation_benchmark], with `servestack
    bench`'s --runs and --concurrency; concurrency 1 always (the reference's measure); under
    "adaptive" ADAPTIVE_LEVELS too, unless --concurrency names the levels."""
    table = settings.manifest.service["speculation_benchmark"]
    adaptive = ADAPTIVE_LEVELS if settings.service_speculation == "adaptive" and not concurrency else ()
    levels = sorted({1, *(concurrency or table["concurrency"]), *adaptive})
    return {"prompt": table["prompt"], "max_new_tokens": table["max_new_tokens"], "runs": runs or table["runs"],
            "warmup": table["warmup"], "concurrency": levels, "request_timeout_s": table["request_timeout_s"]}


def client_command(python: str, params: dict) -> str:
    """files/scripts/bench-client.py run by the host's `python` (stdlib only, nothing uploaded)."""
    encoded = base64.b64encode(json.dumps(params, sort_keys=True).encode()).decode()
    return python_script_command(python, CLIENT, encoded, site=False)


@dataclass(frozen=True)
class Job:
    """One host's benchmark, as decided while the operation ran: what to start, how to measure."""

    settings: Settings
    release: Release
    units: dict            # configuration -> the unit's text (speculation, baseline)
    render: Callable[[Served], str]   # the unit serving a configuration (adaptive: once its config is known)
    secrets_sha: str | None
    identity: dict         # what the service runs (service.service_identity)
    params: dict           # the client's input: the request (`method`) and the server's URL
    by: str                # "deploy" or "bench"
    request: str | None    # `servestack bench`'s id for this measurement


def _on_demand_problem(settings: Settings, release: Release) -> str | None:
    """Why `servestack bench` cannot measure the host: the service must run as a deploy left it."""
    record = reads.fact(host, ServiceRecord, path=service_record_path(settings))
    state = reads.fact(host, UnitState, unit=settings.service_name)
    if not record or not record.get("fingerprint") or record.get("release") != release.id:
        return (f"{settings.service_name} has no healthy start recorded on the active release {release.id}: "
                "deploy first (pyinfra INVENTORY deploy.py); nothing was changed")
    if not service.running(state):
        return (f"{settings.service_name} is {service.unit_state_text(state)}, not running: deploy first; "
                "nothing was changed")
    return None


@operation()
def benchmark(release: Release, on_demand: dict | None = None):
    """
    Benchmark the service with and without speculation when the policy needs it; leave the host in
    the configuration the policy chooses and record the measurement and the decision.

    + release: the release the service runs (deploy.py: the one this run leaves active)
    + on_demand: ``servestack bench``'s options (``runs``, ``concurrency``, ``request``): measure now,
      whatever the policy and the record say (None: the deploy's step, measuring only under "auto"
      when nothing is recorded for what the service runs)
    """
    settings = host_settings(host)
    if not speculates(settings):
        noop(host, f"service profile {settings.service_profile} runs no speculative decoding "
                   "(speculative_algorithm NONE): nothing to measure")
        return
    identity = service.service_identity(settings, release)
    record = reads.fact(host, ServiceRecord, path=speculation_record_path(settings))
    unfinished = reads.fact(host, ServiceRecord, path=benchmark_marker_path(settings))
    if unfinished:
        host.log(unfinished_benchmark_line(settings, unfinished, after_service_step=on_demand is None),
                 logger.warning)
    if on_demand is None:
        needed, why = benchmark_reason(settings.service_speculation, settings.service_speculation_min_gain,
                                       record, identity)
        if not needed:
            if unfinished and is_executing(host):
                write_record(host, f"rm -f -- {shlex.quote(benchmark_marker_path(settings))}",
                             "the unfinished benchmark's marker")
            noop(host, why)
            return
    else:
        problem = _on_demand_problem(settings, release)
        if problem:
            yield from refuse(host, [problem])
            return
        why = "servestack bench asked for it"
    options = on_demand or {}
    groups = service.gpu_groups()
    secrets = service.secrets_content(host.name, settings.service_secret_env)
    params = {**method(settings, options.get("runs"), options.get("concurrency")), "url": check_url(settings)}
    render = functools.partial(service.unit_for, settings, release, patchset_digest(release), groups)
    job = Job(settings=settings, release=release, render=render,
              units={config: render(Served(config)) for config in CONFIGURATIONS},
              secrets_sha=service.sha256_text(secrets) if secrets else None, identity=identity, params=params,
              by="deploy" if on_demand is None else "bench", request=options.get("request"))
    verb = "benchmarking" if is_executing(host) else "will benchmark"
    adaptive = (", then with SGLang's adaptive speculation configured from those numbers"
                if settings.service_speculation == "adaptive" else "")
    host.log(f"{verb} {settings.service_name} with and without speculation{adaptive} ({params['runs']} runs of "
             f"{params['max_new_tokens']} tokens, concurrency {', '.join(map(str, params['concurrency']))}; "
             f"{settings.service_name} restarted through the health gate for each configuration, and once more "
             f"into the one the policy chooses when that is not the last; each restart waits up to "
             f"{settings.service_health_timeout_s} s for /health): {why}", logger.info)
    yield FunctionCommand(_run_benchmark, (job,), {})


def _start(state, host, job: Job, config: str, text: str) -> bool:
    """Start `config`'s unit (`text`) through the health gate, which installs it (and rolls back on failure)."""
    settings = job.settings
    staged = benchmark_unit_path(settings, job.release, config)
    ok, _, stderr = run_remote(host, atomic_write_command(staged, text, "644"))
    if not ok:
        return fail_host(host, REFUSED, [f"could not write the {config} unit {staged}: "
                                         f"{' '.join(stderr)}; {settings.service_name} was not restarted"])
    environment = service.gate_environment(settings, job.release, service.fingerprint(text, job.secrets_sha),
                                           {"release": job.release.id}, unit_source=staged)
    environment["SS_PREVIOUS_LABEL"] = "the last unit that passed the health gate"
    step = f"health-gated start of the {config} configuration of {settings.service_name}"
    gate = while_busy(host, settings.servestack_state_dir, step, service.gate_command(environment))
    return gate.execute(state, host, {})


def _measure(state, host, job: Job, config: str) -> dict | None:
    """files/scripts/bench-client.py against the server running `config`, on the host; its result."""
    settings = job.settings
    command = script_command("busy.sh", settings.servestack_state_dir, run_id(state),
                             f"benchmark of the {config} configuration", "bash", "-c",
                             client_command(settings.venv_python, job.params))
    ok, stdout, stderr = run_remote(host, StringCommand(command))
    result = split(stdout).get(RESULT)
    if not ok or result is None:
        said = said_in(stderr, nothing="no output")
        fail_host(host, REFUSED, [f"the benchmark of the {config} configuration failed: {said}; "
                                  f"{settings.service_name} keeps serving the {config} configuration "
                                  "(the last unit that passed the health gate); nothing was recorded"])
        return None
    return json.loads(result.text)


def _summary(config: str, result: dict) -> str:
    speed, accept = result["output_tok_s"], result.get("accept_length")
    return (f"{config}: {speed['mean']:.1f} tok/s mean ({speed['min']:.1f}-{speed['max']:.1f}) over "
            f"{len(result['runs'])} runs, decode {result['decode_tok_s']['mean']:.1f} tok/s"
            + ("" if accept is None else f", accept length {accept:.2f}")
            + (" [SIMULATED by the stand-in]" if (result.get("server") or {}).get("standin") else ""))


def unfinished_benchmark_line(settings: Settings, marker: dict, after_service_step: bool) -> str:
    """What a run says when it finds the marker of a benchmark whose controller was killed."""
    now = ("the service step of this run has put back the unit the policy chooses" if after_service_step
           else "this benchmark measures both again and leaves the unit the policy chooses")
    return (f"the speculation benchmark of run {marker.get('run_id')} ({marker.get('by')}, started "
            f"{marker.get('started')}) did not finish: it may have left {settings.service_name} on either "
            f"configuration, and recorded nothing; {now}")


def _run_benchmark(state, host, job: Job) -> bool:
    """Both configurations measured and the decision recorded, with a marker on the host meanwhile."""
    marker = benchmark_marker_path(job.settings)
    write_record(host, atomic_write_command(marker, json.dumps({"run_id": run_id(state), "by": job.by,
                                                                "started": utc_stamp()}), "644"),
                 "the benchmark's marker")
    done = _measure_and_decide(state, host, job)
    write_record(host, f"rm -f -- {shlex.quote(marker)}", "the end of the benchmark's marker")
    return done


def _start_and_measure(state, host, job: Job, config: str, text: str, results: dict) -> bool:
    if not _start(state, host, job, config, text):
        return False
    result = _measure(state, host, job, config)
    if result is None:
        return False
    results[config] = result
    host.log(_summary(config, result))
    return True


def _decision(settings: Settings, results: dict) -> tuple[Decision, AdaptivePlan | None]:
    """What the policy chooses from both configurations' numbers (under "adaptive": with its plan)."""
    speculation_mean, baseline_mean = (results[config]["output_tok_s"]["mean"] for config in (SPECULATION, BASELINE))
    if settings.service_speculation != "adaptive":
        return decide(settings.service_speculation, settings.service_speculation_min_gain, speculation_mean,
                      baseline_mean), None
    plan = adaptive_plan(settings.service_speculation_min_gain, results)
    assert plan is not None, "both configurations are measured at concurrency 1 at least"
    return plan.decision(gain_of(speculation_mean, baseline_mean)), plan


def _write_adaptive_config(host, job: Job, what: Served) -> bool:
    config = service.adaptive_config_file(job.release, what)
    assert config is not None, "an adaptive configuration has its config"
    ok, _, stderr = run_remote(host, atomic_write_command(config[0], config[1], "644"))
    if not ok:
        return fail_host(host, REFUSED, [f"could not write SGLang's adaptive config {config[0]}: {' '.join(stderr)}; "
                                         "nothing was recorded"])
    return True


def _measure_and_decide(state, host, job: Job) -> bool:
    settings = job.settings
    results: dict = {}
    units = dict(job.units)
    for config in (BASELINE, SPECULATION):
        if not _start_and_measure(state, host, job, config, units[config], results):
            return False
    running = SPECULATION
    decision, plan = _decision(settings, results)
    host.log_styled(decision.why, bold=True, log_func=logger.info)
    if plan is not None and plan.config is not None:
        what = Served(ADAPTIVE, plan.config)
        units[ADAPTIVE] = job.render(what)
        if not _write_adaptive_config(host, job, what) or \
                not _start_and_measure(state, host, job, ADAPTIVE, units[ADAPTIVE], results):
            return False
        running = ADAPTIVE
    if decision.configuration != running and not _start(state, host, job, decision.configuration,
                                                        units[decision.configuration]):
        return False
    copy_path = unit_copy_path(settings, job.release)
    ok, _, stderr = run_remote(host, atomic_write_command(copy_path, units[decision.configuration], "644"))
    if not ok:
        host.log(f"could not copy the unit into {copy_path}: {' '.join(stderr)}", logger.warning)
    record = make_record(job.identity, settings.service_speculation, settings.service_speculation_min_gain,
                         results, decision, by=job.by, run_id=run_id(state), request=job.request, method_=job.params,
                         plan=plan)
    write_record(host, atomic_write_command(speculation_record_path(settings), json.dumps(record, indent=1), "644"),
                 "the speculation record")
    return True


@deploy("Speculative decoding")
def speculation(release: Release):
    """
    The speculation policy after the service step: under "auto", benchmark when what the service
    runs changed since the last measurement, and keep speculation only where it wins.

    + release: the release the service runs (deploy.py: the one this run leaves active)
    """
    settings = host_settings(host)
    benchmark(name=BENCHMARK, release=release, _parallel=settings.rollout_batch)


@deploy("Speculation benchmark on demand")
def measure(release: Release, on_demand: dict):
    """
    ``servestack bench``'s measurement of a host that a deploy left serving.

    + release: the active release (the one the service runs)
    + on_demand: ``runs``, ``concurrency``, ``request`` (see ``benchmark``)
    """
    settings = host_settings(host)
    benchmark(name=BENCHMARK, release=release, on_demand=on_demand, _parallel=settings.rollout_batch)


def _steps_reads(settings: Settings, release: Release | None = None) -> list[FactRequest]:
    return [request for step in (preflight, venv, service) for request in step.host_reads(settings, release)] \
        + host_reads(settings, release)


def _deployed_release(settings: Settings) -> Release | None:
    """The release the service runs, which the benchmark measures; None after refusing a host that no
    deploy left serving."""
    release = venv.active_release(settings)
    if release is None:
        fail_host(host, REFUSED, [f"{settings.venv_path} is not a servestack release: deploy first "
                                  "(pyinfra INVENTORY deploy.py); nothing was changed"])
    return release


def bench_now(runs: int | None = None, concurrency: list[int] | None = None, request: str | None = None):
    """`servestack bench` on each host, run by pyinfra's CLI (servestack/bench.py `pyinfra_argv`):
    preflight and the host's lock as in deploy.py (`preflight.locked_run`), then the configurations
    measured and the host left in the one its policy chooses, the record written; nothing else changes."""
    settings = host_settings(host)
    on_demand = {"runs": runs, "concurrency": concurrency, "request": request}
    # the speculation record names the adaptive config files the service step reads with the release
    decides = [*venv.host_reads(settings), FactRequest.of(ServiceRecord, path=speculation_record_path(settings))]
    preflight.locked_run(reads=functools.partial(_steps_reads, settings), decides=decides,
                         choose=functools.partial(_deployed_release, settings),
                         steps=lambda release: measure(release=release, on_demand=on_demand))
