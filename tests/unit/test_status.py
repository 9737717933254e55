"""`servestack status`: a host's standing from what it keeps (constructed readings, no host), its
JSON and table, what it reads; and `servestack backups` naming what each snapshot was of."""

from __future__ import annotations

import io
import json

import pytest

from facts.batch import FactBatch, batches
from facts.framing import Section, printed
from facts.host import LockState
from facts.verify import REPORT
from servestack import status
from servestack.backups import format_backups, snapshot_of
from servestack.cli import build_parser
from servestack.settings import settings_from_data
from servestack.status import NOT_RECORDED, StatusReadings, host_status, render_json, render_table
from servestack.verify import UNCUT_WIDTH, report_console

NOW = 1767780000          # 2026-01-07T10:00:00Z on the host's clock
UPTIME = 86400.0          # booted a day before
RELEASES = "/opt/servestack/releases"
NEW, OLD, ADOPTED = "r-0123456789ab", "r-ba9876543210", "adopted-20260101T090000Z"


@pytest.fixture
def settings():
    return settings_from_data("h1", {})


def env(active: str | None, history: list, releases: dict | None = None, kind: str = "link") -> dict:
    """MlEnvState's value (facts/venv.py)."""
    releases = releases if releases is not None else {
        ADOPTED: {"id": ADOPTED, "status": "ok", "has_venv": True, "adopted": True, "created": "20260101T090000Z"},
        NEW: {"id": NEW, "status": "ok", "has_venv": True, "adopted": False, "created": "20260107T080000Z"},
    }
    target = f"{RELEASES}/{active}/venv" if active else None
    return {"python": {"version": "3.11.2", "executable": "/usr/bin/python3"}, "machine": "x86_64",
            "venv_path": {"path": "/opt/ml-env", "kind": kind, "target": target,
                          "realpath": target or "/opt/ml-env", "release": active},
            "releases": releases, "history": history, "backups": [], "latest_backup": None,
            "uv": "0.9.5"}


DEPLOYED = [{"release": ADOPTED, "previous": None, "by": "adopt", "at": "20260107T090000Z"},
            {"release": NEW, "previous": ADOPTED, "by": "deploy", "at": "20260107T090000Z"}]
ROLLED_BACK = DEPLOYED + [{"release": ADOPTED, "previous": NEW, "by": "rollback", "at": "20260107T093000Z"}]


def unit(active="active", sub="running", since_boot_s=UPTIME - 1800) -> dict:
    """UnitTimes: the service entered its state `since_boot_s` after boot (default: 30 min ago)."""
    stamp = str(int(since_boot_s * 1e6))
    return {"HostNow": str(NOW), "HostUptime": f"{UPTIME:.2f}", "LoadState": "loaded", "ActiveState": active,
            "SubState": sub, "Result": "success", "ActiveEnterTimestampMonotonic": stamp,
            "InactiveEnterTimestampMonotonic": stamp, "StateChangeTimestampMonotonic": stamp}


def health(code: int | None = 200, error: str | None = None) -> Section:
    answer = {"base": "http://127.0.0.1:30000", **({"health": code} if code else {"health_error": error})}
    return Section(0, printed(REPORT, json.dumps(answer)))


def readings(**overrides) -> StatusReadings:
    values = {"env": env(NEW, DEPLOYED), "lock": LockState(), "verified": None, "unit": unit(), "http": health()}
    return StatusReadings(**{**values, **overrides})


# --- a host's status, from what it keeps ----------------------------------------------------


def test_a_converged_host_active_release_ages_rollback_target_service_and_no_run_record(settings):
    found = host_status(settings, readings(verified={"at": "2026-01-07T09:01:00Z", "checks": ["cuda_sample"]}))
    assert found["host_time"] == "2026-01-07T10:00:00Z"
    assert found["active"] == {"release": NEW, "kind": "link", "path": "/opt/ml-env",
                               "realpath": f"{RELEASES}/{NEW}/venv", "adopted": False,
                               "activated_at": "2026-01-07T09:00:00Z",
                               "activated_by": "deploy", "age_s": 3600, "created": "2026-01-07T08:00:00Z",
                               "built_age_s": 7200}
    assert [(release["id"], release["active"], release["rollback_target"]) for release in found["releases"]] == [
        (ADOPTED, False, True), (NEW, True, False)]
    assert found["rollback"] == {"target": ADOPTED, "why": f"the release active before the deploy of {NEW}"}
    assert found["last_deploy"] == {"release": NEW, "previous": ADOPTED, "at": "2026-01-07T09:00:00Z"}
    assert found["last_run"] == {"run_id": NOT_RECORDED, "result": NOT_RECORDED, "source": None}
    assert found["verified"] == {"at": "2026-01-07T09:01:00Z", "checks": ["cuda_sample"]}
    assert found["service"] == {"unit": "sglang.service", "systemd": True, "load": "loaded", "active": "active",
                                "sub": "running", "result": "success", "since": "2026-01-07T09:30:00Z",
                                "since_age_s": 1800, "url": "http://127.0.0.1:30000/health", "health": 200,
                                "health_error": None}
    assert found["speculation"] == "n/a"
    assert json.loads(render_json({"h1": found})) == {"hosts": {"h1": found}}


def test_a_rolled_back_host_a_second_rollback_picks_the_same_release(settings):
    found = host_status(settings, readings(env=env(ADOPTED, ROLLED_BACK)))
    assert found["active"]["release"] == ADOPTED and found["active"]["activated_by"] == "rollback"
    assert found["active"]["age_s"] == 1800
    assert found["rollback"]["target"] == ADOPTED
    assert "it is active already: a rollback changes nothing" in found["rollback"]["why"]
    assert found["last_deploy"]["release"] == NEW
    assert found["last_activation"] == {"release": ADOPTED, "previous": NEW, "by": "rollback",
                                        "at": "2026-01-07T09:30:00Z"}


def test_venv_rollback_to_is_the_target_as_rollback_py_takes_it():
    settings = settings_from_data("h1", {"venv_rollback_to": NEW})
    found = host_status(settings, readings(env=env(ADOPTED, ROLLED_BACK)))
    assert found["rollback"] == {"target": NEW, "why": f"venv_rollback_to={NEW}"}


def test_a_host_never_deployed_says_why_there_is_nothing_to_roll_back_to(settings):
    found = host_status(settings, readings(env=env(None, [], releases={}, kind="venv"),
                                                 unit={**unit(), "LoadState": "not-found", "ActiveState": "inactive"},
                                                 http=health(None, "connection refused (curl exit 7)")))
    assert found["active"]["release"] is None and found["active"]["kind"] == "venv"
    assert found["releases"] == [] and found["rollback"]["target"] is None
    assert found["rollback"]["why"].startswith("nothing to roll back to: no release was active before the last deploy")
    assert found["last_deploy"] is None
    assert found["service"]["health"] is None
    assert found["service"]["health_error"] == "connection refused (curl exit 7)"


def test_the_run_in_the_lock_is_the_last_run_running_or_interrupted(settings):
    info = {"run_id": "20260107T095900Z-1a2b3c4d", "controller": "ctl:42", "started": "20260107T095900Z"}
    running = host_status(settings, readings(lock=LockState(True, True, info, "connection")))
    assert running["last_run"]["run_id"] == info["run_id"] and running["last_run"]["source"] == "lock"
    assert running["last_run"]["result"].startswith("running: holds the lock since 2026-01-07T09:59:00Z")
    stale = host_status(settings, readings(lock=LockState(True, False, info, None)))
    assert stale["last_run"]["result"].startswith("interrupted: started 2026-01-07T09:59:00Z; its connection is gone")
    step = {"run_id": info["run_id"], "step": f"build release {NEW}", "since": "20260107T095930Z", "pid": 812}
    building = host_status(settings, readings(lock=LockState(True, True, info, "connection", step)))
    assert building["last_run"]["result"].endswith(f"; now in 'build release {NEW}' (since 20260107T095930Z, pid 812)")
    killed = host_status(settings, readings(lock=LockState(True, False, info, None, step)))
    assert killed["last_run"]["result"].startswith(
        f"interrupted: started 2026-01-07T09:59:00Z, stopped in 'build release {NEW}' (since 20260107T095930Z")


def test_a_health_gate_that_put_the_service_back_is_a_recorded_failure(settings):
    history = DEPLOYED + [{"release": ADOPTED, "previous": NEW, "by": "service-rollback", "at": "20260107T091000Z"}]
    found = host_status(settings, readings(env=env(ADOPTED, history)))
    assert found["last_run"] == {
        "run_id": NOT_RECORDED, "source": "releases.json",
        "result": f"failed at 2026-01-07T09:10:00Z: release {NEW} did not become healthy; the service is back on "
                  f"{ADOPTED}"}


def test_a_stopped_service_since_when_and_a_missing_python(settings):
    found = host_status(settings, readings(env=None, unit=unit("failed", "failed", UPTIME - 120),
                                                 http=health(None, "connection refused")))
    assert found["reachable"] and "(venv_python) is not on the host's PATH" in found["error"]
    assert found["active"] is None and found["releases"] == []
    assert (found["service"]["active"], found["service"]["since"], found["service"]["since_age_s"]) == (
        "failed", "2026-01-07T09:58:00Z", 120)


def test_a_service_systemd_gave_up_on_says_so_in_the_table(settings):
    gave_up = {**unit("failed", "failed", UPTIME - 120), "Result": "start-limit-hit"}
    found = host_status(settings, readings(unit=gave_up, http=health(None, "connection refused")))
    assert found["service"]["result"] == "start-limit-hit"
    cell = status.service_cell(found)
    assert "failed (failed) since" in cell
    assert "systemd gave up on sglang.service (Result=start-limit-hit)" in cell
    crashed_once = {**unit("failed", "failed", UPTIME - 120), "Result": "exit-code"}
    assert "result exit-code" in status.service_cell(host_status(settings, readings(unit=crashed_once)))


def test_a_probe_without_a_report_says_what_it_printed(settings):
    found = host_status(settings, readings(http=Section(1, ("bash: python3: not found",))))
    assert found["service"]["health_error"] == "the HTTP probe gave no report: bash: python3: not found"


def test_unit_times_parse_systemctl_show_and_the_clock():
    lines = ["HostNow=1767780000", "HostUptime=86400.00", "ActiveState=active",
             "ActiveEnterTimestampMonotonic=84600000000"]
    parsed = status.UnitTimes().process(lines)
    now = status.host_now(parsed)
    assert status.iso(status.since_boot(parsed, "ActiveEnterTimestampMonotonic", now)) == "2026-01-07T09:30:00Z"
    assert status.since_boot({**parsed, "ActiveEnterTimestampMonotonic": "0"}, "ActiveEnterTimestampMonotonic",
                             now) is None
    assert status.host_now({"HostNow": "1767780000.750000000"}).timestamp() == 1767780000.75
    assert status.host_now({"HostNow": "1767780000.N"}).timestamp() == 1767780000  # a date without %N
    assert status.host_now({}) is None


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59, "59s"), (300, "5m"), (3600, "1h"), (5400, "1h 30m"),
                                               (93784, "1d 2h"), (None, "?")])
def test_ages_read_short(seconds, text):
    assert status.age_text(seconds) == text


def test_status_reads_a_host_in_one_command_asking_health_only(settings):
    wanted = status.status_requests(settings)
    assert [request.name for request in wanted] == ["MlEnvState", "HostLock", "VerificationRecord", "ServiceRecord",
                                                    "UnitTimes", "StagedRevisions", "ServiceHttp"]
    assert dict(wanted[3].kwargs)["path"] == "/var/lib/servestack/speculation.json"
    assert len(batches(wanted)) == 1
    assert dict(wanted[-1].kwargs)["request"] == ""         # GET /health, never a real /generate
    command = FactBatch().command(batches(wanted)[0])
    assert "def command_packages" not in command            # no Python tool: the packages are not listed
    assert "systemctl show --property=LoadState,ActiveState" in command and "date -u +%s" in command


# --- rendering ----------------------------------------------------------------------------


def test_the_table_when_not_a_terminal_shows_every_cell_whole(settings):
    converged = host_status(settings, readings())
    rolled_back = host_status(settings, readings(env=env(ADOPTED, ROLLED_BACK),
                                                       http=health(None, "connection refused (curl exit 7)")))
    never = host_status(settings, readings(env=env(None, [], releases={}, kind="venv")))
    out = io.StringIO()
    console = report_console(file=out)
    assert console.width == UNCUT_WIDTH
    unreachable = status.unreachable_status("cannot run the probes on h4 (ssh://10.0.0.4): Connection timed out")
    render_table({"h1": converged, "h2": rolled_back, "h3": never, "h4": unreachable}, console)
    text = out.getvalue()
    assert "servestack status (nothing was changed)" in text
    for column in ("active release", "kept releases", "last run", "service", "speculation"):
        assert column in text
    assert f"rollback -> {ADOPTED}" in text and f"  the release active before the deploy of {NEW}" in text
    assert "  it is active already: a rollback changes nothing" in text  # h2
    assert f"{NEW} <- active" in text and f"{ADOPTED} <- rollback" in text
    assert "active 1h (by deploy)" in text and "built 2h ago" in text
    assert f"{ADOPTED} <- active, rollback" in text and "adopted 6d 1h ago" in text  # h2: rolled back
    assert f"then: rollback to {ADOPTED} at 2026-01-07 09:30:00Z (30m ago)" in text
    assert "run: not recorded" in text and "result: not recorded" in text
    assert f"last deploy: {NEW} at 2026-01-07 09:00:00Z (1h ago)" in text
    assert "active (running) since 2026-01-07 09:30:00Z (30m ago)" in text
    assert "/health: 200" in text and "/health: connection refused (curl exit 7)" in text
    assert "hand-made venv at /opt/ml-env (not adopted yet)" in text
    assert "rollback: none" in text
    assert "  nothing to roll back to: no release was active before the last deploy (kept releases: none)" in text
    assert "cannot read the host: cannot run the probes on h4 (ssh://10.0.0.4): Connection timed out" in text
    assert "1 of 4 host(s) could not be read: h4" in text
    assert "n/a" in text and "…" not in text


def test_the_cli_has_status_with_json_and_limit():
    args = build_parser().parse_args(["status", "inv.py", "--limit", "gpu_hosts", "--limit", "h9", "--json"])
    assert (args.command, args.inventory, args.limit, args.as_json) == ("status", "inv.py", ["gpu_hosts", "h9"], True)


def test_status_main_prints_json_and_fails_when_a_host_cannot_be_read(monkeypatch, capsys, settings):
    statuses = {"h1": host_status(settings, readings()), "h2": status.unreachable_status("no route")}
    monkeypatch.setattr(status, "collect", lambda path, limit: statuses)
    assert status.status_main("inv.py", None, as_json=True) == 3
    assert json.loads(capsys.readouterr().out) == {"hosts": statuses}
    monkeypatch.setattr(status, "collect", lambda path, limit: {"h1": statuses["h1"]})
    assert status.status_main("inv.py") == 0
    assert "servestack status" in capsys.readouterr().out


# --- servestack backups: what each snapshot was of ------------------------------------------


def test_a_snapshot_names_the_release_or_the_hand_made_venv_it_became():
    state = env(NEW, DEPLOYED)
    hand_made = {"timestamp": "20260107T085959Z", "venv_path": "/opt/ml-env", "realpath": "/opt/ml-env",
                 "release": None, "python": "3.11.2", "packages": 12, "torch": "2.9.1+cu128",
                 "reason": "before change", "file": "/var/lib/servestack/backups/20260107T085959Z.json"}
    of_release = {**hand_made, "timestamp": "20260107T092959Z", "release": NEW,
                  "realpath": f"{RELEASES}/{NEW}/venv", "reason": "before rollback"}
    assert snapshot_of(hand_made, state) == f"hand-made venv, adopted as release {ADOPTED}"
    assert snapshot_of(of_release, state) == f"release {NEW}"
    assert snapshot_of(hand_made, env(None, [], releases={}, kind="venv")) == "hand-made venv (not adopted)"
    assert snapshot_of({**hand_made, "realpath": "/srv/envs/ml"}, state) == \
        "a link to /srv/envs/ml (not a servestack release)"
    text = format_backups({"h1": [{**hand_made, "of": snapshot_of(hand_made, state)}], "h2": "could not be read: x"})
    assert f"20260107T085959Z  /opt/ml-env -> hand-made venv, adopted as release {ADOPTED}  (before change)" in text
    assert "/opt/ml-env -> /opt/ml-env" not in text
    assert "torch 2.9.1+cu128" in text and "h2: could not be read: x" in text
