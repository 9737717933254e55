"""`servestack status INVENTORY [--limit L ...] [--json]`: where each host stands now; changes nothing.

For each host of the inventory (group data applied, --limit honoured), from what the host keeps:

    active release   what `venv_path` points at, since when (its last activation) and when it was built
    releases         the kept releases (what `venv_rollback_to` takes) and the one rollback.py would
                     pick (servestack/releases.py `rollback_target`, with the host's history), or why
                     there is none
    last run         the last deploy's activation (releases.json), the run holding or left in the
                     lock, the outcome a run recorded (a health gate that put the service back on
                     the previous release); "not recorded" where the host keeps no record of it
    service          the unit's state and since when (systemd), GET /health asked from the host itself
    speculation      the speculative-decoding decision recorded by the last benchmark (a deploy under
                     service_speculation = "auto", or `servestack bench`): the configuration, both
                     means, the gain, the accept length, when and for which release, and what the
                     host's policy picks from those numbers now; "n/a" until a run records one
    models           each model revision staged in service_models_dir, from the weights step's records
                     (facts/weights.py `StagedRevisions`): verified when and how large, a pre-staged
                     copy's place, a download never finished; and which the host's data serves now

Hosts are reached as `servestack verify` reaches them (servestack/verify.py: the inventory's SSH
data, sudo, @local, @chroot) and read in one remote command each, in parallel. A table, or with
--json one object::

    {"hosts": {"h1": {"reachable": true, "error": null, "host_time": "2026-01-06T10:00:00Z",
        "active": {"release", "kind", "path", "realpath", "adopted", "activated_at", "activated_by",
                   "age_s", "created", "built_age_s"},
        "releases": [{"id", "status", "complete", "created", "adopted", "active", "rollback_target"}],
        "rollback": {"target": "r-..." | null, "why": "..."},
        "last_deploy": {"release", "previous", "at"} | null,
        "last_activation": {"release", "previous", "by", "at"} | null,
        "last_run": {"run_id": "..." | "not recorded", "result": "..." | "not recorded",
                     "source": "lock" | "releases.json" | null},
        "verified": {"at", "checks"} | null,
        "service": {"unit", "systemd", "load", "active", "sub", "result", "since", "since_age_s", "url",
                    "health": 200 | null, "health_error"},
        "speculation": "n/a" | {"decision", "now", "policy", "min_gain", "speculation_tok_s", "baseline_tok_s",
                                "gain", "accept_length", "measured_at", "by", "release",
                                "for_active_release", "simulated"},
        "models": [{"repo", "revision", "dir", "state": "verified" | "pre-staged" | "unfinished" | "missing",
                    "verified_at", "bytes", "serves": "model" | "draft" | null}]}}}

Times are UTC, ISO 8601; ages are seconds, taken on the host's own clock. Exit status 0 when every
host was read, else 3 (servestack/errors.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

from pyinfra.api import FactBase

from facts.batch import FactRequest
from facts.framing import Section
from facts.host import HostLock, LockState
from facts.service import GAVE_UP, ServiceRecord, gave_up_text, parse_properties
from facts.venv import MlEnvState
from facts.verify import VerificationRecord
from facts.weights import StagedRevisions
from operations.venv import mlenv_fact_arguments
from servestack import bench
from servestack.checks.parse import report
from servestack.errors import EXIT_OK, EXIT_UNREACHABLE
from servestack.checks.readings import requests as check_requests
from servestack.hostrun import parse_stamp
from servestack.paths import speculation_record_path, verification_record_path
from servestack.releases import NoRollbackTarget, rollback_target
from servestack.settings import Settings
from servestack.verify import Unreachable, read_all, report_console, targets_from_inventory
from servestack.weights import pinned_models

NOT_RECORDED = "not recorded"
NOT_APPLICABLE = "n/a"
# systemd's own properties of the unit that `status` shows (the monotonic stamps: microseconds
# since boot, turned into times with the host's clock and uptime, whatever its time zone).
UNIT_TIMES = ("LoadState", "ActiveState", "SubState", "Result", "ActiveEnterTimestampMonotonic",
              "InactiveEnterTimestampMonotonic", "StateChangeTimestampMonotonic")


class UnitTimes(FactBase):
    """
    The host's clock and a unit's state with the moments it changed, as a dict of ``systemctl
    show`` properties plus ``HostNow`` (seconds since the epoch) and ``HostUptime`` (seconds since
    boot); ``SystemdRunning=no`` where systemd is not the init system.

    + unit: the unit's name
    """

    def command(self, unit: str) -> str:
        show = f"systemctl show --property={','.join(UNIT_TIMES)} -- {shlex.quote(unit)} </dev/null"
        return ("printf 'HostNow=%s\\n' \"$(date -u +%s.%N)\"; "
                "{ read -r up rest </proc/uptime && printf 'HostUptime=%s\\n' \"$up\"; } 2>/dev/null; "
                f"if [ -d /run/systemd/system ]; then {show} 2>/dev/null || true; "
                "else echo SystemdRunning=no; fi")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output) -> dict:
        return parse_properties(output)


def status_requests(settings: Settings) -> list[FactRequest]:
    """What `status` reads of a host, in one remote command: the ML environment (releases,
    history; not its packages), the lock, the verification record, the speculation record, the
    unit, the staged model revisions, /health only."""
    return [FactRequest.of(MlEnvState, **mlenv_fact_arguments(settings)),
            FactRequest.of(HostLock, state_dir=settings.servestack_state_dir),
            FactRequest.of(VerificationRecord, path=verification_record_path(settings)),
            FactRequest.of(ServiceRecord, path=speculation_record_path(settings)),
            FactRequest.of(UnitTimes, unit=settings.service_name),
            FactRequest.of(StagedRevisions, models_dir=settings.service_models_dir),
            *check_requests(settings, "http", generate=False)]


@dataclass(frozen=True)
class StatusReadings:
    """What `status_requests` read, in its order."""

    env: dict | None = None                  # MlEnvState (None: the host lacks venv_python)
    lock: LockState = LockState()
    verified: dict | None = None             # verified.json
    unit: dict = field(default_factory=dict)  # UnitTimes
    http: Section = Section(None, ())        # ServiceHttp, /health only
    speculation: dict | None = None          # speculation.json
    staged: list = field(default_factory=list)   # StagedRevisions

    @classmethod
    def of(cls, values: list) -> "StatusReadings":
        env, lock, verified, speculation, unit, staged, http = values
        return cls(env, lock, verified, unit, http, speculation, staged)


# --- times ----------------------------------------------------------------------------------


def iso(moment: datetime | None) -> str | None:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ") if moment else None


def seconds_between(earlier: datetime | None, later: datetime | None) -> int | None:
    if earlier is None or later is None:
        return None
    return max(0, int((later - earlier).total_seconds()))


def host_now(unit: dict) -> datetime | None:
    """The host's clock when it was read (`date +%s.%N`; a date without %N prints whole seconds)."""
    seconds, _, fraction = str(unit.get("HostNow") or "").partition(".")
    try:
        return datetime.fromtimestamp(int(seconds) + (float(f"0.{fraction}") if fraction.isdigit() else 0),
                                      timezone.utc)
    except (ValueError, OverflowError):
        return None


def since_boot(unit: dict, prop: str, now: datetime | None) -> datetime | None:
    """When a monotonic systemd stamp (µs since boot) happened, by the host's clock and uptime."""
    try:
        stamp_s, uptime = int(unit[prop]) / 1e6, float(unit["HostUptime"])
    except (KeyError, ValueError):
        return None
    if now is None or stamp_s <= 0:
        return None
    return datetime.fromtimestamp(round(now.timestamp() - (uptime - stamp_s)), timezone.utc)


def age_text(seconds: int | None) -> str:
    """300 -> '5m', 93784 -> '1d 2h'."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes}m"
    if seconds < 86400:
        return f"{hours}h {minutes % 60}m" if minutes % 60 else f"{hours}h"
    return f"{days}d {hours % 24}h" if hours % 24 else f"{days}d"


# --- one host's status ----------------------------------------------------------------------


def host_status(settings: Settings, readings: StatusReadings) -> dict:
    """A host's status (the module docstring's per-host object), from what was read of it."""
    now = host_now(readings.unit)
    env = readings.env
    result: dict[str, Any] = {"reachable": True, "error": None, "host_time": iso(now)}
    if env is None:
        result["error"] = (f"'{settings.venv_python}' (venv_python) is not on the host's PATH: its releases "
                           "cannot be read")
        result.update(active=None, releases=[], rollback={"target": None, "why": result["error"]},
                      last_deploy=None, last_activation=None)
    else:
        result.update(_releases(settings, env, now))
    result["last_run"] = last_run(readings.lock, (env or {}).get("history") or [])
    result["verified"] = _verified(readings.verified)
    result["service"] = service_status(settings, readings, now)
    result["speculation"] = bench.status_summary(readings.speculation,
                                                 ((env or {}).get("venv_path") or {}).get("release"),
                                                 settings.service_speculation, settings.service_speculation_min_gain)
    result["models"] = models_status(settings, readings.staged)
    return result


def unreachable_status(error: str) -> dict:
    return {"reachable": False, "error": error, "host_time": None, "active": None, "releases": [],
            "rollback": {"target": None, "why": "the host could not be read"}, "last_deploy": None,
            "last_activation": None, "last_run": {"run_id": NOT_RECORDED, "result": NOT_RECORDED, "source": None},
            "verified": None, "service": None, "speculation": NOT_APPLICABLE, "models": []}


def models_status(settings: Settings, staged: list[dict]) -> list[dict]:
    """The staged revisions as their records say (facts/weights.py `StagedRevisions`), and which of them the
    host's data serves (its model, its draft)."""
    serves = {(model.repo, model.revision): model.role for model in pinned_models(settings)}
    models = []
    for entry in staged:
        record = entry["record"] or {}
        folder, _, revision = entry["dir"].rpartition("/")
        repo = record.get("repo") or folder.rpartition("/")[2].replace("--", "/", 1)
        state = ("missing" if not entry["present"] and not record.get("prestaged") else
                 "pre-staged" if record.get("prestaged") else "verified" if record else "unfinished")
        models.append({"repo": repo, "revision": revision,
                       "dir": record.get("dir") if record.get("prestaged") else entry["dir"], "state": state,
                       "verified_at": iso(parse_stamp(record.get("verified_at"))) or record.get("verified_at"),
                       "bytes": record.get("bytes"), "serves": serves.get((repo, revision))})
    return models


def _entry(entry: dict | None, *keys: str) -> dict | None:
    if not entry:
        return None
    return {key: (iso(parse_stamp(entry.get(key))) or entry.get(key)) if key == "at" else entry.get(key)
            for key in keys}


def _releases(settings: Settings, env: dict, now: datetime | None) -> dict:
    history = list(env.get("history") or [])
    releases = dict(env.get("releases") or {})
    where = env.get("venv_path") or {}
    active_id = where.get("release")
    deploys = [entry for entry in history if entry.get("by") == "deploy"]
    try:
        target = rollback_target(history, releases, active_id, settings.venv_rollback_to)
        why = (f"venv_rollback_to={settings.venv_rollback_to}" if settings.venv_rollback_to
               else f"the release active before the deploy of {deploys[-1].get('release')}")
        if target == active_id:
            why += "; it is active already: a rollback changes nothing"
        rollback: dict[str, str | None] = {"target": target, "why": why}
    except NoRollbackTarget as reason:
        rollback = {"target": None, "why": str(reason)}
    activated = next((entry for entry in reversed(history) if entry.get("release") == active_id), None) \
        if active_id else None
    created = parse_stamp((releases.get(active_id) or {}).get("created")) if active_id else None
    activated_at = parse_stamp((activated or {}).get("at"))
    active = {"release": active_id, "kind": where.get("kind"), "path": where.get("path") or settings.venv_path,
              "realpath": where.get("realpath"), "adopted": bool((releases.get(active_id) or {}).get("adopted")),
              "activated_at": iso(activated_at), "activated_by": (activated or {}).get("by"),
              "age_s": seconds_between(activated_at, now),
              "created": iso(created), "built_age_s": seconds_between(created, now)}
    kept = [{"id": release_id, "status": record.get("status"), "complete": bool(record.get("has_venv")),
             "created": iso(parse_stamp(record.get("created"))), "adopted": bool(record.get("adopted")),
             "active": release_id == active_id, "rollback_target": release_id == rollback["target"]}
            for release_id, record in sorted(releases.items(), key=lambda item: (item[1].get("created") or "",
                                                                                  item[0]))]
    return {"active": active, "releases": kept, "rollback": rollback,
            "last_deploy": _entry(deploys[-1] if deploys else None, "release", "previous", "at"),
            "last_activation": _entry(history[-1] if history else None, "release", "previous", "by", "at")}


def last_run(lock: LockState, history: list) -> dict:
    """The last run as the host recorded it: the run in the lock (holding it, or gone leaving it
    stale; the long step it is or was in, lock.activity), else the outcome a run wrote in the
    activation history; else not recorded."""
    if lock.present:
        info = lock.info or {}
        started = iso(parse_stamp(info.get("started"))) or info.get("started") or "?"
        doing = lock.doing()   # the long step (busy.sh) it runs, or was in when interrupted
        if lock.alive:
            result = f"running: holds the lock since {started} ({lock.why_alive()})"
            if doing and lock.why != "busy":
                result += f"; now in {doing}"
        else:
            result = (f"interrupted: started {started}" + (f", stopped in {doing}" if doing else "")
                      + "; its connection is gone and its lock is stale (the next run takes it over)")
        return {"run_id": lock.run_id or NOT_RECORDED, "result": result, "source": "lock"}
    last = history[-1] if history else {}
    if last.get("by") == "service-rollback":
        at = iso(parse_stamp(last.get("at"))) or last.get("at")
        return {"run_id": NOT_RECORDED,
                "result": f"failed at {at}: release {last.get('previous')} did not become healthy; "
                          f"the service is back on {last.get('release')}",
                "source": "releases.json"}
    return {"run_id": NOT_RECORDED, "result": NOT_RECORDED, "source": None}


def _verified(record: dict | None) -> dict | None:
    if not record:
        return None
    return {"at": iso(parse_stamp(record.get("at"))) or record.get("at"), "checks": list(record.get("checks") or [])}


def service_status(settings: Settings, readings: StatusReadings, now: datetime | None) -> dict:
    unit = readings.unit
    active = unit.get("ActiveState")
    stamp = {"active": "ActiveEnterTimestampMonotonic", "inactive": "InactiveEnterTimestampMonotonic",
             "failed": "InactiveEnterTimestampMonotonic"}.get(active or "", "StateChangeTimestampMonotonic")
    since = since_boot(unit, stamp, now)
    answer = report(readings.http) or {}
    health_error = answer.get("health_error")
    if not answer:
        said = " ".join(line.strip() for line in readings.http.lines if line.strip())
        health_error = f"the HTTP probe gave no report: {said[-300:] or 'no output'}"
    return {"unit": settings.service_name,
            "systemd": unit.get("SystemdRunning") != "no",
            "load": unit.get("LoadState"), "active": active, "sub": unit.get("SubState"),
            "result": unit.get("Result"), "since": iso(since), "since_age_s": seconds_between(since, now),
            "url": f"{answer.get('base')}/health" if answer.get("base") else None,
            "health": answer.get("health"), "health_error": health_error}


# --- reading the fleet ----------------------------------------------------------------------


def collect(inventory_path: str, limit: Iterable[str] | None = None) -> dict[str, dict]:
    """{host name: its status}, every host of the inventory (in the limit) read in parallel."""
    targets = targets_from_inventory(inventory_path, limit, action="read the hosts' status", local=False)
    values = read_all(targets, lambda target: status_requests(target.settings))
    statuses = {}
    for target in targets:
        found = values[target.name]
        statuses[target.name] = (unreachable_status(str(found)) if isinstance(found, Unreachable)
                                 else host_status(target.settings, StatusReadings.of(found)))
    return statuses


# --- rendering ------------------------------------------------------------------------------


def render_json(statuses: dict[str, dict]) -> str:
    return json.dumps({"hosts": statuses}, indent=2)


def _at(stamp: str | None, seconds: int | None) -> str:
    return f"{stamp.replace('T', ' ')} ({age_text(seconds)} ago)" if stamp else "?"


def _ago(stamp: str | None, status: dict) -> str:
    """A recorded stamp with its age on the host's clock."""
    now = parse_stamp(status.get("host_time"))
    return _at(stamp, seconds_between(parse_stamp(stamp), now))


def active_cell(status: dict) -> str:
    active = status.get("active")
    if not active:
        return "?"
    if active["release"]:
        lines = [active["release"]]
        if active["activated_at"]:
            lines.append(f"active {age_text(active['age_s'])} (by {active['activated_by']})")
        if active["created"]:  # an adopted (hand-made) venv was not built by servestack
            lines.append(f"{'adopted' if active['adopted'] else 'built'} {age_text(active['built_age_s'])} ago")
        return "\n".join(lines)
    return {"venv": f"hand-made venv at {active['path']} (not adopted yet)",
            "missing": f"none ({active['path']} is missing)",
            "link": f"{active['path']} -> {active['realpath']} (not a servestack release)",
            "broken-link": f"{active['path']} is a broken link",
            }.get(active["kind"], f"{active['path']}: not a venv")


def releases_cell(status: dict) -> str:
    lines = []
    for release in status.get("releases") or []:
        marks = [mark for mark, on in (("active", release["active"]), ("rollback", release["rollback_target"])) if on]
        state = "" if release["status"] == "ok" and release["complete"] else f" {release['status']}"
        lines.append(release["id"] + state + (f" <- {', '.join(marks)}" if marks else ""))
    rollback = status.get("rollback") or {}
    if rollback.get("target"):
        lines.append(f"rollback -> {rollback['target']}")
        lines += [f"  {part}" for part in (rollback.get("why") or "").split("; ")]
    else:
        lines += ["rollback: none", f"  {rollback.get('why')}"]
    return "\n".join(lines)


def last_run_cell(status: dict) -> str:
    run = status.get("last_run") or {}
    lines = [f"run: {run.get('run_id') or NOT_RECORDED}", f"result: {run.get('result') or NOT_RECORDED}"]
    deploy, last = status.get("last_deploy"), status.get("last_activation")
    if deploy:
        lines.append(f"last deploy: {deploy['release']} at {_ago(deploy['at'], status)}")
    else:
        lines.append("last deploy: none recorded")
    if last and last.get("by") != "deploy":
        lines.append(f"then: {last['by']} to {last['release']} at {_ago(last['at'], status)}")
    verified = status.get("verified")
    if verified:
        lines.append(f"heavy checks last passed: {_ago(verified['at'], status)}")
    return "\n".join(lines)


def service_cell(status: dict) -> str:
    service = status.get("service")
    if not service:
        return "?"
    if not service["systemd"]:
        state = "systemd is not running on the host"
    elif service["load"] == "not-found":
        state = f"{service['unit']}: not installed"
    else:
        state = f"{service['active']} ({service['sub']})"
        if service["since"]:
            state += f" since {_at(service['since'], service['since_age_s'])}"
        if service["result"] == GAVE_UP:
            state += f"; {gave_up_text(service['unit'])}"
        elif service["active"] == "failed" and service["result"]:
            state += f", result {service['result']}"
    health = (f"/health: {service['health']}" if service["health"] is not None
              else f"/health: {service['health_error']}")
    return f"{state}\n{health}"


def models_cell(status: dict) -> str:
    lines = []
    for model in status.get("models") or []:
        size = f"{model['bytes'] / 10**9:.1f} GB" if isinstance(model["bytes"], int) else "?"
        what = {"verified": f"{size}, verified {_ago(model['verified_at'], status)}",
                "pre-staged": f"pre-staged copy {model['dir']}, verified {_ago(model['verified_at'], status)}",
                "unfinished": "a download not finished", "missing": "its directory is missing"}[model["state"]]
        serves = f" <- {model['serves']}" if model["serves"] else ""
        lines += [f"{model['repo']}@{model['revision'][:12]}{serves}", f"  {what}"]
    return "\n".join(lines) or "none staged"


def render_table(statuses: dict[str, dict], console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="servestack status (nothing was changed)", show_lines=True)
    for column in ("host", "active release", "kept releases", "last run", "service", "speculation", "models"):
        table.add_column(column, overflow="fold")
    for name, status in statuses.items():
        if not status["reachable"]:
            table.add_row(Text(name), Text(f"cannot read the host: {status['error']}", style="bold red"),
                          "", "", "", bench.status_cell(status["speculation"]), "")
            continue
        service = status.get("service") or {}
        healthy = service.get("active") == "active" and service.get("health") == 200
        cells = [active_cell(status), releases_cell(status), last_run_cell(status)]
        if status.get("error"):
            cells[0] = f"{cells[0]}\n{status['error']}"
        table.add_row(Text(name), *[Text(cell) for cell in cells],
                      Text(service_cell(status), style="green" if healthy else "bold red"),
                      Text(bench.status_cell(status["speculation"])), Text(models_cell(status)))
    console.print(table)
    unread = [name for name, status in statuses.items() if not status["reachable"]]
    if unread:
        console.print(Text(f"{len(unread)} of {len(statuses)} host(s) could not be read: {', '.join(unread)}",
                           style="bold red"))


def status_main(inventory_path: str, limit: Iterable[str] | None = None, as_json: bool = False) -> int:
    """Print every host's status; 0 when every host was read, else 3 (servestack/errors.py)."""
    statuses = collect(inventory_path, limit)
    if as_json:
        print(render_json(statuses))
    else:
        render_table(statuses, report_console())
    return EXIT_OK if all(status["reachable"] for status in statuses.values()) else EXIT_UNREACHABLE
