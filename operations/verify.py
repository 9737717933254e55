"""Step `verify`, the deploy's last: servestack's verification checks, run on the converged host.

The same checks as the testinfra suite (tests/verify), judging the same facts
(servestack/checks/readings.py), read through servestack.reads. A failed check fails the host,
saying which and why; a skipped check (the host lacks the hardware it needs) is logged with its
reason. Passing changes nothing, so a second converge still reports zero changes.

The heavy checks (torch on every GPU, nvcc building the CUDA sample, the patch check hashing
SGLang's files; they load multi-GB libraries) depend only on the host state the `STATE_GROUPS`
read and on the host's settings. When they pass, their outcomes are recorded on the host
(`<servestack_state_dir>/verified.json`, bookkeeping like the lock: not a change) with a digest
of that state; a later converge that finds the same digest reuses them and says so, and runs
only the cheap checks live. `verify_reuse=False` runs every check live on every converge;
`servestack verify` (the testinfra suite) always does.

What the checks read before they judge (`host_reads`) is read with the other steps' reads, once
the host's lock is taken; on a host this run did not change, the checks read nothing more.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from typing import Sequence

from pyinfra import host, logger
from pyinfra.api import deploy, operation

from facts.batch import FactRequest
from facts.verify import VerificationRecord
from servestack import reads
from servestack.checks.catalogue import (CHECKS, CHECKS_BY_NAME, Check, base_name, groups_for,
                                         in_catalogue_order, judge_all)
from servestack.checks.outcome import FAILED, PASSED, SKIPPED, Outcome
from servestack.checks.readings import NEEDS, Readings, in_order, read_groups, requests
from servestack.hostrun import noop, refuse, write_record
from servestack.paths import verification_record_path
from servestack.scripts import atomic_write_command
from servestack.settings import Settings, host_settings

# The deploy's subset: every check but the real /generate request, which the service step's
# health gate has just made (and which can take long on a large model).
DEPLOY_CHECKS = tuple(check.name for check in CHECKS if check.name != "service_generate")
# Groups whose checks are reused while the host state they depend on is unchanged.
REUSABLE_GROUPS = ("python", "sample", "patches")
# What that state is read from: driver and GPUs, the toolkits, the active release.
STATE_GROUPS = ("gpu", "toolkit", "kept", "host")


def is_reusable(check: Check) -> bool:
    return any(group in REUSABLE_GROUPS for group in check.groups)


def uses_record(settings: Settings, checks: list[Check]) -> bool:
    """Whether the heavy checks among `checks` may be reused from the host's record."""
    return settings.verify_reuse and any(is_reusable(check) for check in checks)


def _first_groups(settings: Settings, checks: list[Check]) -> tuple[str, ...]:
    """What the checks read before they know whether the record holds: the cheap groups, the
    state the record's digest covers (when there is a record to use), and what a later group
    needs (NEEDS)."""
    groups = [group for group in groups_for(checks) if group not in REUSABLE_GROUPS]
    if uses_record(settings, checks):
        groups += STATE_GROUPS
    groups += [need for group in groups_for(checks) for need in NEEDS.get(group, ())]
    return in_order(groups)


def _as_deployed(release) -> dict:
    """How the deploy reads the groups (readings.requests): /health only, the service step's gate
    has just made a real request; the patch check of `release`."""
    return {"generate": False, "release": release}


def _record_request(settings: Settings) -> FactRequest:
    return FactRequest.of(VerificationRecord, path=verification_record_path(settings))


def host_reads(settings: Settings, release=None, names: tuple[str, ...] = DEPLOY_CHECKS) -> list[FactRequest]:
    """What `checks_pass` reads before it judges, with the arguments it reads them with: its
    first groups and the record (the heavy groups are read only when the record does not hold).
    It reads at execute only, once the steps ran: nothing without `release` (the prepare read)."""
    if release is None:
        return []
    checks = [CHECKS_BY_NAME[name] for name in names]
    wanted = [request for group in _first_groups(settings, checks)
              for request in requests(settings, group, None, **_as_deployed(release))]
    if uses_record(settings, checks):
        wanted.append(_record_request(settings))
    return wanted


def _read(settings: Settings, readings: Readings, groups, release, also: Sequence[FactRequest] = ()) -> list:
    """Read `groups` as the deploy reads them (and `also`, whose values are returned) in one remote
    command, unless this stage read them already (servestack.reads)."""
    return read_groups(readings, settings, groups, lambda wanted: reads.read(host, wanted), also,
                       **_as_deployed(release))


def state_key(settings: Settings, readings: Readings) -> str:
    """Digest of what the reusable checks' outcomes depend on: settings, manifest, host state
    (the GPUs and driver, the toolkits, the active release)."""
    toolkits, found = readings.toolkits, readings.host
    state = {
        "gpu": asdict(readings.gpu),
        "toolkit": None if toolkits is None else {"install": asdict(toolkits.install),
                                                  "link": toolkits.link.to_record(), "record": toolkits.record},
        "kept": {path: fingerprint.to_record() for path, fingerprint in sorted(readings.kept.items())},
        "host": {"devices": found.devices, "toolkit_package": found.toolkit_package,
                 "toolkit_path": found.toolkit_path, "venv": found.venv, "records": found.records,
                 "release_state": found.release_state},
    }
    document = {"settings": settings.values, "manifest": asdict(settings.manifest), "host": state}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def recorded_outcomes(record: dict | None, key: str, wanted: list[Check]) -> list[Outcome] | None:
    """The outcomes `record` holds for the `wanted` checks when it was made on this state, else None."""
    if not record or record.get("key") != key or not set(record.get("checks", ())) >= {c.name for c in wanted}:
        return None
    names = {check.name for check in wanted}
    try:
        outcomes = [Outcome(*entry) for entry in record.get("outcomes", [])]
    except TypeError:
        return None
    return [outcome for outcome in outcomes if base_name(outcome.check) in names]


def record_text(key: str, judged: list[Check], outcomes: list[Outcome]) -> str:
    """The record (root's, world-readable: it holds check names and details)."""
    return json.dumps({"key": key, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "checks": [check.name for check in judged],
                       "outcomes": [[outcome.check, outcome.status, outcome.detail] for outcome in outcomes]},
                      sort_keys=True)


def _summary(outcomes: list[Outcome], reused: list[Outcome], record: dict | None) -> str:
    passed = sum(outcome.status == PASSED for outcome in outcomes)
    text = f"verified: {passed} check(s) passed, {len(outcomes) - passed} skipped"
    if reused and record is not None:  # outcomes are reused only from a record
        text += (f"; {len(reused)} of them not re-run: recorded at {record.get('at')} on this same state "
                 "(driver, GPUs, toolkit, release, settings)")
    return text


@operation()
def checks_pass(release=None, names: tuple[str, ...] = DEPLOY_CHECKS):
    """
    Fail the host unless servestack's verification checks pass on it.

    + release: the release this run leaves active (its patch check); None: the active venv's
    + names: checks of ``servestack.checks.catalogue.CHECKS`` to run (default: all but the
      /generate request, which the service step's health gate has just made)

    The checks read the host after the deploy's changes: at prepare time (and with ``--dry``)
    this operation reads nothing and reports no change. Skipped checks are logged with their
    reason; a failed check fails the host, naming the check and what it found. Heavy checks that
    passed on this same host state are reused from the host's record (see the module docstring).

    **Example:**

    .. code:: python

        checks_pass(name="Verify the host", release=release)
    """
    if not host.state.is_executing:
        noop(host, "verification runs once the deploy's changes are made")
        return
    settings = host_settings(host)
    selected = [CHECKS_BY_NAME[name] for name in names]
    heavy = [check for check in selected if is_reusable(check)]
    use_record = uses_record(settings, selected)
    readings = Readings(host.name)
    also = [_record_request(settings)] if use_record else []
    record = next(iter(_read(settings, readings, _first_groups(settings, selected), release, also)), None)
    key = state_key(settings, readings) if use_record else ""
    reused = recorded_outcomes(record, key, heavy) or []
    live = [check for check in selected if not (reused and is_reusable(check))]
    _read(settings, readings, [group for group in groups_for(live) if group not in readings.groups], release)
    judged = judge_all(settings, readings, live)
    outcomes = in_catalogue_order(judged + reused)
    for outcome in outcomes:
        if outcome.status == SKIPPED:
            host.log(f"verify: {outcome.check} skipped: {outcome.detail}", logger.warning)
    failures = [outcome for outcome in outcomes if outcome.status == FAILED]
    if failures:
        yield from refuse(host, [f"verify {outcome.check}: {outcome.detail}" for outcome in failures])
        return
    if use_record and not reused:
        ran = [outcome for outcome in judged if base_name(outcome.check) in {check.name for check in heavy}]
        write_record(host, atomic_write_command(verification_record_path(settings), record_text(key, heavy, ran)),
                     f"the verification record {verification_record_path(settings)}")
    summary = _summary(outcomes, reused, record)
    host.log(summary)   # shown without -v: what the run verified, and what it reused
    noop(host, summary)


@deploy("servestack verify")
def verify(release=None, names: tuple[str, ...] = DEPLOY_CHECKS):
    """Run the verification checks on the converged host; a failed check fails the host.

    `release`: the release this run leaves active (deploy.py passes the venv step's plan)."""
    checks_pass(name="Verify the host (servestack checks)", release=release, names=names)
