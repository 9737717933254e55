"""The deploy's last step: servestack's verification checks, run on the converged host.

The same check functions as the testinfra suite (tests/verify), judged on the same probe output
read through pyinfra. A failed check fails the host, saying which and why; a skipped check (the
host lacks the hardware it needs) is logged with its reason. Passing changes nothing, so a second
converge still reports zero changes.
"""

from __future__ import annotations

import shlex

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation

from facts.verify import ProbeScript, VerificationProbe
from facts.probe import FactRequest
from operations.venv import planned_only
from servestack import checks
from servestack import probe as host_probe
from servestack.settings import Settings, host_settings

# The deploy's subset: every check but the real /generate request, which the service step's
# health gate has just made (and which can take long on a large model).
DEPLOY_CHECKS = tuple(check.name for check in checks.CHECKS if check.name != "service_generate")


def read_probe(settings: Settings, groups: tuple[str, ...]) -> checks.Probe:
    """Run each probe group once through pyinfra facts (the patches group after the host group)."""
    probe = checks.Probe(host.name)
    for group in groups:
        if group == "patches":
            script = checks.patches_script(settings, checks.patch_record_for(probe))
        else:
            script = checks.SCRIPTS[group](settings)
        probe.sections.update(host_probe.fact(host, VerificationProbe, probe=ProbeScript(group, script)))
        probe.loaded.add(group)
    return probe


def _expected_facts(host_) -> list[FactRequest]:
    """At execute, the deploy's checks are read ahead with the rest of the probe: on a host this run
    does not change, they see exactly what they would see at the end. The patches group's record is
    predicted as the planned release's `patches.json`; read_probe re-reads it if that is wrong. The
    http group is not read ahead: it is a request to the service (which may hang until its timeout),
    not host state, and is made once the service step is done."""
    if not host_.state.is_executing:
        return []
    settings = host_settings(host_)
    selected = [checks.CHECKS_BY_NAME[name] for name in DEPLOY_CHECKS]
    release = planned_only(host_)
    facts = []
    for group in checks.groups_for(selected):
        if group == "http":
            continue
        if group == "patches":
            if release is None:
                continue
            script = checks.patches_script(settings, f"{release.dir}/patches.json")
        else:
            script = checks.SCRIPTS[group](settings)
        facts.append(FactRequest.of(VerificationProbe, probe=ProbeScript(group, script)))
    return facts


host_probe.expects(_expected_facts, volatile=(VerificationProbe,))


def failure_command(failures: list[checks.Outcome]) -> StringCommand:
    """Print every failed check to stderr and exit 1: pyinfra shows it and fails the host."""
    lines = [f"servestack verify: {len(failures)} check(s) failed"]
    lines += [f"  {outcome.check}: {outcome.detail}" for outcome in failures]
    return StringCommand("printf '%s\\n'", *[shlex.quote(line) for line in lines], ">&2; exit 1")


@operation()
def checks_pass(names: tuple[str, ...] = DEPLOY_CHECKS):
    """
    Fail the host unless servestack's verification checks pass on it.

    + names: checks of ``servestack.checks.CHECKS`` to run (default: all but the /generate
      request, which the service step's health gate has just made)

    The checks read the host after the deploy's changes: at prepare time (and with ``--dry``)
    this operation reads nothing and reports no change. Skipped checks are logged with their
    reason; a failed check fails the host, naming the check and what it found.

    **Example:**

    .. code:: python

        checks_pass(name="Verify the host")
    """
    if not host.state.is_executing:
        host.noop("verification runs once the deploy's changes are made")
        return
    settings = host_settings(host)
    selected = [checks.CHECKS_BY_NAME[name] for name in names]
    probe = read_probe(settings, checks.groups_for(selected))
    outcomes = checks.judge_all(settings, probe, selected)
    for outcome in outcomes:
        if outcome.status == checks.SKIPPED:
            host.log(f"verify: {outcome.check} skipped: {outcome.detail}", logger.warning)
    failures = [outcome for outcome in outcomes if outcome.status == checks.FAILED]
    if failures:
        yield failure_command(failures)
        return
    passed = sum(outcome.status == checks.PASSED for outcome in outcomes)
    host.noop(f"verified: {passed} check(s) passed, {len(outcomes) - passed} skipped")


@deploy("servestack verify")
def verify(names: tuple[str, ...] = DEPLOY_CHECKS):
    """Run the verification checks on the converged host; a failed check fails the host."""
    checks_pass(name="Verify the host (servestack checks)", names=names)
