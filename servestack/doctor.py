"""`servestack doctor INVENTORY [--limit L] [--json]`: the preflight checks as a report, changing nothing.

For each host of the inventory (group data applied, --limit honoured): its settings, whether it
can be reached, then every preflight check (operations/preflight.py) read from the same single
fact the deploy uses. A rich table per host, or with --json one object with stable check names::

    {"ok": false, "hosts": {"gpu-node-01": {"ok": false, "checks": {
        "settings": {"status": "ok", "detail": "...", "problems": []},
        "connect": {...}, "driver": {...}, "gpus": {...}, "compute_capability": {...}, "serving": {...},
        "arch": {...}, "install_path": {...}, "runfile": {...}, "disk": {...}, "lock": {...}, "link": {...},
        "kept_toolkits": {...}, "service": {...}}}}}

status is "ok", "warn" (reported only), "fail" or "skip". The settings check fails with exactly the lines
the deploy would refuse the host with before connecting (servestack/preconnect.py: host data, secrets,
this machine as a target); connect says why a host could not be reached. Exit status
(servestack/errors.py): 2 when a host's settings fail, else 1 when a check fails on a host that was
read, 3 when a host could not be reached, 0 when every host passes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable

from operations.preflight import CHECKS, CheckResult, digest_read, evaluate, host_reads, preflight_facts
from servestack.errors import EXIT_BAD_INPUT, ConfigError, exit_status
from servestack.fleet import group_data_of, limited, load_inventory, unused_group_data
from servestack.preconnect import targets_problems
from servestack.settings import host_settings
from servestack.verify import Target, Unreachable, read_all, report_console, target_for
from servestack.weights import pin_problems, token_problems

REPORT_CHECKS = ("settings", "connect")


@dataclass(frozen=True)
class HostReport:
    name: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks)


def report_for(name: str, settings, facts, refusals: Iterable[str] | None = (),
               connect_error: str | None = None, groups: Iterable[str] = ()) -> HostReport:
    """A host's checks: settings (the lines the deploy would refuse it with, or which group data
    applied), connect, then the preflight checks (skipped when they cannot run)."""
    refusals = tuple(refusals or ())
    refused = settings is None or bool(refusals)
    applied = f"group data: {', '.join(groups)}" if groups else "no group data"
    checks = [CheckResult("settings", "fail", "\n".join(refusals) or "invalid", refusals or ("invalid",))
              if refused else CheckResult("settings", "ok", f"valid ({applied})")]
    if refused:
        checks.append(CheckResult("connect", "skip", "not attempted"))
    elif connect_error or facts is None:
        problem = connect_error or "connected, but could not read the host (sudo?)"
        checks.append(CheckResult("connect", "fail", problem, (problem,)))
    else:
        checks.append(CheckResult("connect", "ok", "connected"))
    if refused or facts is None:
        return HostReport(name, checks + [CheckResult(name_, "skip", "host not checked") for name_ in CHECKS])
    return HostReport(name, checks + evaluate(settings, facts))


def render_json(reports: dict[str, HostReport], unused: Iterable[str] = ()) -> str:
    hosts = {name: {"ok": report.ok,
                    "checks": {check.name: {"status": check.status, "detail": check.detail,
                                            "problems": list(check.problems)} for check in report.checks}}
             for name, report in reports.items()}
    return json.dumps({"ok": all(report.ok for report in reports.values()), "hosts": hosts,
                       "unused_group_data": list(unused)}, indent=2)


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render_table(reports: dict[str, HostReport], console=None, unused: Iterable[str] = ()) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = console or report_console()
    table = Table(title="servestack doctor (nothing was changed)", show_lines=False)
    for column in ("host", "check", "status", "detail"):
        table.add_column(column, overflow="fold")
    for name, report in reports.items():
        for index, check in enumerate(report.checks):
            style = _STYLE.get(check.status, "")
            table.add_row(name if index == 0 else "", check.name, f"[{style}]{check.status}[/]", check.detail,
                          end_section=index == len(report.checks) - 1)
    console.print(table)
    for line in unused:
        console.print(f"[yellow]warning:[/] {escape(line)}")
    failed = [name for name, report in reports.items() if not report.ok]
    console.print(f"[bold red]{len(failed)} of {len(reports)} hosts would be refused:[/] {', '.join(failed)}"
                  if failed else f"[green]all {len(reports)} hosts pass preflight[/]")


def collect(inventory_path: str, limit: Iterable[str] | None = None,
            environ=None) -> tuple[dict[str, HostReport], list[str]]:
    """Every host's report, and the group data that applies to no host; nothing is changed on any host.
    A host the deploy would refuse before connecting (servestack/preconnect.py, the same lines) is not
    contacted; the others are read as every `servestack` report reads hosts (servestack/verify.py
    `read_all`: one remote command each, in parallel), with the facts preflight reads."""
    inventory = load_inventory(inventory_path)
    hosts = limited(inventory, limit or ())
    refusals = {host.name: targets_problems([host], environ) or weights_refusals(host, environ) for host in hosts}
    targets = _targets(hosts, refusals)
    found = read_all(list(targets.values()), lambda target: host_reads(target.settings))
    digests = _runfile_digests(targets, found)
    reports = {host.name: _report(host, refusals[host.name], targets.get(host.name), found.get(host.name),
                                  digests.get(host.name)) for host in hosts}
    return reports, unused_group_data(inventory)


def weights_refusals(host, environ=None) -> list[str]:
    """What the deploy's weights step refuses the host with before any change, known without reading it: a
    model pinned nowhere, a Hub token variable unset here (operations/weights.py refuses the same at prepare)."""
    settings = host_settings(host)
    lines = pin_problems(settings) + token_problems(settings, os.environ if environ is None else environ)
    return [f"host {host.name}: {line}" for line in lines]


def _targets(hosts, refusals: dict[str, list[str]]) -> dict[str, Target]:
    """A Target for each host not refused; a host whose connector the reports cannot use is refused."""
    targets = {}
    for host in hosts:
        if not refusals[host.name]:
            try:
                targets[host.name] = target_for(host, host_settings(host))
            except ConfigError as error:
                refusals[host.name] = [str(error)]
    return targets


def _report(host, refusals: list[str], target: Target | None, value, digest) -> HostReport:
    if refusals or target is None:
        return report_for(host.name, None, None, refusals)
    groups = group_data_of(host)
    if isinstance(value, Unreachable):
        return report_for(host.name, target.settings, None, (), f"cannot connect: {value}", groups)
    return report_for(host.name, target.settings, preflight_facts(value, runfile_digest=digest), groups=groups)


def _runfile_digests(targets: dict[str, Target], found: dict) -> dict:
    """The runfile digest of each host whose checks need one (an install is due, a full-size runfile is
    there): a second read of those hosts, as the deploy's preflight makes it."""
    wanted = {name: request for name, value in found.items() if not isinstance(value, Unreachable)
              and (request := digest_read(targets[name].settings, value[2]))}
    read = read_all([targets[name] for name in wanted], lambda target: [wanted[target.name]])
    return {name: value[0] for name, value in read.items() if not isinstance(value, Unreachable)}


def doctor_status(reports: dict[str, HostReport]) -> int:
    """The contract's exit status (servestack/errors.py): 2 when the deploy would refuse a host's data,
    else 1 when a check failed, 3 when a host could not be reached, 0 when every host passes."""
    def failed(report: HostReport, name: str) -> bool:
        return any(check.name == name and check.status == "fail" for check in report.checks)

    if any(failed(report, "settings") for report in reports.values()):
        return EXIT_BAD_INPUT
    unreachable = {name for name, report in reports.items() if failed(report, "connect")}
    return exit_status(any(not report.ok for name, report in reports.items() if name not in unreachable),
                       bool(unreachable))


def doctor_main(inventory_path: str, limit: Iterable[str] | None = None, as_json: bool = False) -> int:
    """Print the preflight report of the inventory's hosts, with the contract's exit status."""
    reports, unused = collect(inventory_path, limit)
    if as_json:
        print(render_json(reports, unused))
    else:
        render_table(reports, unused=unused)
    return doctor_status(reports)
