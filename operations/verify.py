"""The deploy's last step: servestack's verification checks, run on the converged host.

The same check functions as the testinfra suite (tests/verify), judged on the same probe output
read through pyinfra. A failed check fails the host, saying which and why; a skipped check (the
host lacks the hardware it needs) is logged with its reason. Passing changes nothing, so a second
converge still reports zero changes.

The heavy checks (torch on every GPU, nvcc building the CUDA sample, the patch check hashing
SGLang's files; their probes load multi-GB libraries) depend only on the host state in
`STATE_SECTIONS` and on the host's settings. When they pass, their outcomes are recorded on the
host (`<servestack_state_dir>/verified.json`, bookkeeping like the lock: not a change) with a
digest of that state; a later converge that finds the same digest reuses them and says so, and
runs only the cheap checks live. `verify_reuse=False` runs every check live on every converge;
`servestack verify` (the testinfra suite) always does.

The GPU section is the one preflight read in this run, replayed into the host script, instead of
asking nvidia-smi a second time (it wakes the driver for every GPU); servestack never touches the
driver or the GPUs, and a step that drops every read makes the script ask nvidia-smi itself. The
toolkit tree and the /usr/local/cuda link chain are replayed the same way from the toolkit step's
read (the same commands), unless that step changed something.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import asdict

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation

from facts.preflight import HostPreflight
from facts.toolkit import CudaToolkits
from facts.probe import FactRequest
from facts.verify import ProbeScript, VerificationProbe, VerificationRecord
from operations.preflight import preflight_fact_arguments
from operations.toolkit import toolkit_fact_arguments
from servestack import checks
from servestack import probe as host_probe
from servestack.hostrun import keep
from servestack.settings import Settings, host_settings

# The deploy's subset: every check but the real /generate request, which the service step's
# health gate has just made (and which can take long on a large model).
DEPLOY_CHECKS = tuple(check.name for check in checks.CHECKS if check.name != "service_generate")
# Probe groups whose checks are reused while the host state they depend on is unchanged.
REUSABLE_GROUPS = ("python", "sample", "patches")
# Host-group sections that state is read from: driver and GPUs, the toolkit, the active release.
STATE_SECTIONS = ("gpu", "device_nodes", "tree", "toolkit_package", "toolkit_path", "link", "record",
                  "release", "release_state")
RECORD_FILE = "verified.json"


def record_path(settings: Settings) -> str:
    return f"{settings.servestack_state_dir}/{RECORD_FILE}"


def is_reusable(check: checks.Check) -> bool:
    return any(group in REUSABLE_GROUPS for group in check.groups)


def group_script(settings: Settings, group: str, probe: checks.Probe | None = None) -> str:
    """A probe group's script as the deploy runs it (but the host group's: `_request`): the HTTP
    probe asks /health only (the service step's gate has just made a real request); the patch
    check reads the active release's record."""
    if group == "http":
        return checks.http_script(settings, generate=False)
    if group == "patches":
        return checks.patches_script(settings, checks.patch_record_for(probe) if probe else None)
    return checks.SCRIPTS[group](settings)


def _read_in_this_run(target, settings: Settings) -> dict[str, tuple[str, ...]]:
    """Host sections this run already read with the same commands, while those reads are still
    current: the GPUs as preflight read them (nothing drops that read: servestack never touches
    the driver or the GPUs), the toolkit tree and link as the toolkit step read them (dropped when
    the step changed anything, then read live)."""
    read: dict[str, tuple[str, ...]] = {}
    preflight = host_probe.cached(target, HostPreflight, **preflight_fact_arguments(settings))
    if preflight is not None and preflight.gpu_output:
        read["gpu"] = preflight.gpu_output
    toolkits = host_probe.cached(target, CudaToolkits, **toolkit_fact_arguments(settings))
    if toolkits is not None:
        read.update((section, toolkits.section_lines(section)) for section in ("tree", "link"))
    return read


def _request(settings: Settings, group: str, probe: checks.Probe | None = None, target=None) -> FactRequest:
    if group == "host":  # its unit read is shared with the service step's (facts/probe.py)
        prelude, script = checks.host_script_parts(settings, replay=_read_in_this_run(target or host, settings))
        return FactRequest.of(VerificationProbe, probe=ProbeScript(group, script, prelude))
    return FactRequest.of(VerificationProbe, probe=ProbeScript(group, group_script(settings, group, probe)))


def read_probe(settings: Settings, groups: tuple[str, ...], probe: checks.Probe | None = None) -> checks.Probe:
    """Read the probe groups not read yet: the host group first (the patch check needs its record
    path), then all others at once, in one remote command."""
    probe = probe or checks.Probe(host.name)
    pending = [group for group in groups if group not in probe.loaded]
    batches = [["host"], [group for group in pending if group != "host"]] if "host" in pending else [pending]
    for batch in batches:
        requests = [_request(settings, group, probe) for group in batch]
        for group, sections in zip(batch, host_probe.facts(host, requests)):
            probe.sections.update(sections)
            probe.loaded.add(group)
    return probe


def state_key(settings: Settings, probe: checks.Probe) -> str:
    """Digest of what the reusable checks' outcomes depend on: settings, manifest, host state."""
    sections = {name: [section.rc, section.text] for name, section in probe.sections.items()
                if name in STATE_SECTIONS or name.startswith("kept_")}
    document = {"settings": settings.values, "manifest": asdict(settings.manifest), "host": sections}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def _base_name(outcome: checks.Outcome) -> str:
    return outcome.check.split("[", 1)[0]  # package_version[torch] -> package_version


def recorded_outcomes(record: dict | None, key: str, wanted: list[checks.Check]) -> list[checks.Outcome] | None:
    """The outcomes `record` holds for the `wanted` checks when it was made on this state, else None."""
    if not record or record.get("key") != key or not set(record.get("checks", ())) >= {c.name for c in wanted}:
        return None
    names = {check.name for check in wanted}
    try:
        outcomes = [checks.Outcome(*entry) for entry in record.get("outcomes", [])]
    except TypeError:
        return None
    return [outcome for outcome in outcomes if _base_name(outcome) in names]


def record_command(settings: Settings, key: str, judged: list[checks.Check], outcomes: list[checks.Outcome]) -> str:
    """Write the record atomically (root-owned, world-readable: it holds check names and details)."""
    path = record_path(settings)
    record = {"key": key, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "checks": [check.name for check in judged],
              "outcomes": [[outcome.check, outcome.status, outcome.detail] for outcome in outcomes]}
    return (f"umask 022 && mkdir -p {shlex.quote(settings.servestack_state_dir)} && "
            f"printf '%s\\n' {shlex.quote(json.dumps(record, sort_keys=True))} > {shlex.quote(path + '.tmp')} && "
            f"mv -f {shlex.quote(path + '.tmp')} {shlex.quote(path)}")


def _expected_facts(host_) -> list[FactRequest]:
    """At execute, the cheap groups (host, the /health request) and the record are read ahead with the
    rest of the probe: on a host this run does not change, they see exactly what they would see at
    the end. The reusable groups are read only when the record does not cover this state."""
    if not host_.state.is_executing:
        return []
    settings = host_settings(host_)
    selected = [checks.CHECKS_BY_NAME[name] for name in DEPLOY_CHECKS]
    groups = [group for group in checks.groups_for(selected) if group not in REUSABLE_GROUPS]
    facts = [_request(settings, group, target=host_) for group in groups]
    if settings.verify_reuse:
        facts.append(FactRequest.of(VerificationRecord, path=record_path(settings)))
    return facts


host_probe.expects(_expected_facts, volatile=(VerificationProbe,))


def failure_command(failures: list[checks.Outcome]) -> StringCommand:
    """Print every failed check to stderr and exit 1: pyinfra shows it and fails the host."""
    lines = [f"servestack verify: {len(failures)} check(s) failed"]
    lines += [f"  {outcome.check}: {outcome.detail}" for outcome in failures]
    return StringCommand("printf '%s\\n'", *[shlex.quote(line) for line in lines], ">&2; exit 1")


def _in_catalogue_order(outcomes: list[checks.Outcome]) -> list[checks.Outcome]:
    order = {check.name: index for index, check in enumerate(checks.CHECKS)}
    return sorted(outcomes, key=lambda outcome: order[_base_name(outcome)])


def _summary(outcomes: list[checks.Outcome], reused: list[checks.Outcome], record: dict | None) -> str:
    passed = sum(outcome.status == checks.PASSED for outcome in outcomes)
    text = f"verified: {passed} check(s) passed, {len(outcomes) - passed} skipped"
    if reused:
        text += (f"; {len(reused)} of them not re-run: recorded at {record.get('at')} on this same state "
                 "(driver, GPUs, toolkit, release, settings)")
    return text


@operation()
def checks_pass(names: tuple[str, ...] = DEPLOY_CHECKS):
    """
    Fail the host unless servestack's verification checks pass on it.

    + names: checks of ``servestack.checks.CHECKS`` to run (default: all but the /generate
      request, which the service step's health gate has just made)

    The checks read the host after the deploy's changes: at prepare time (and with ``--dry``)
    this operation reads nothing and reports no change. Skipped checks are logged with their
    reason; a failed check fails the host, naming the check and what it found. Heavy checks that
    passed on this same host state are reused from the host's record (see the module docstring).

    **Example:**

    .. code:: python

        checks_pass(name="Verify the host")
    """
    if not host.state.is_executing:
        host.noop("verification runs once the deploy's changes are made")
        return
    settings = host_settings(host)
    selected = [checks.CHECKS_BY_NAME[name] for name in names]
    heavy = [check for check in selected if is_reusable(check)]
    probe = read_probe(settings, ("host",))
    key = state_key(settings, probe)
    record = None
    if heavy and settings.verify_reuse:
        record = host_probe.fact(host, VerificationRecord, path=record_path(settings))
    reused = recorded_outcomes(record, key, heavy) or []
    live = [check for check in selected if not (reused and is_reusable(check))]
    read_probe(settings, checks.groups_for(live), probe)
    judged = checks.judge_all(settings, probe, live)
    outcomes = _in_catalogue_order(judged + reused)
    for outcome in outcomes:
        if outcome.status == checks.SKIPPED:
            host.log(f"verify: {outcome.check} skipped: {outcome.detail}", logger.warning)
    failures = [outcome for outcome in outcomes if outcome.status == checks.FAILED]
    if failures:
        yield failure_command(failures)
        return
    if heavy and settings.verify_reuse and not reused:
        ran = [outcome for outcome in judged if _base_name(outcome) in {check.name for check in heavy}]
        keep(host, record_command(settings, key, heavy, ran), f"the verification record {record_path(settings)}")
    host.noop(_summary(outcomes, reused, record))


@deploy("servestack verify")
def verify(names: tuple[str, ...] = DEPLOY_CHECKS):
    """Run the verification checks on the converged host; a failed check fails the host."""
    checks_pass(name="Verify the host (servestack checks)", names=names)
