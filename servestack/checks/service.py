"""The service checks: the unit enabled and active, its process running as its user with the
pinned CUDA environment of the active release, its secrets kept out of the unit, and its answers
to /health and a real /generate. Skipped with the reason where systemd is not running."""

from __future__ import annotations

import re

from facts.service import GAVE_UP, gave_up_text
from facts.venv import release_of
from servestack.checks.outcome import Fail, Skip
from servestack.checks.parse import report, tail
from servestack.paths import secrets_path
from servestack.releases import release_at
from servestack.serving import GENERATE_REQUEST
from servestack.serving import service_environment as pinned_environment
from servestack.settings import Settings

# A digest of the host's patch record: the service step pins it, the checks cannot predict it.
UNPREDICTABLE_ENV = ("SERVESTACK_PATCHSET",)
_TOOLKIT_DIR = re.compile(r"/cuda(-\d+(\.\d+)*)?(/|$)")


def _systemd(readings) -> None:
    if not readings.host.systemd:
        raise Skip(f"systemd is not running {readings.on} (no /run/systemd/system)")


def _process(settings: Settings, readings):
    _systemd(readings)
    if not readings.host.has_process:
        raise Fail(f"{settings.service_name} has no running main process {readings.on}")
    return readings.host


def service_active(settings: Settings, readings) -> str:
    _systemd(readings)
    props, unit = readings.host.unit, settings.service_name
    if props.get("LoadState") != "loaded":
        raise Fail(f"{unit} is not installed {readings.on} (LoadState={props.get('LoadState')})")
    state = (f"UnitFileState={props.get('UnitFileState')}, "
             f"ActiveState={props.get('ActiveState')}/{props.get('SubState')}")
    if props.get("Result") == GAVE_UP:
        raise Fail(f"{gave_up_text(unit)} ({readings.on}; {state})")
    if props.get("UnitFileState") != "enabled" or props.get("ActiveState") != "active":
        raise Fail(f"{unit} {readings.on} must be enabled and active: {state}")
    return f"{unit} enabled and active (MainPID {props.get('MainPID')})"


def service_user(settings: Settings, readings) -> str:
    user = _process(settings, readings).process_user or "?"
    if user != settings.service_user:
        raise Fail(f"{settings.service_name}'s process runs as {user} {readings.on}, "
                   f"expected {settings.service_user}")
    return f"{settings.service_name} runs as {user}"


def _path_entries(value: str | None) -> list[str]:
    return [entry.rstrip("/") for entry in (value or "").split(":") if entry]


def _other_toolkit(entry: str, cuda: str) -> bool:
    """A search-path entry inside a CUDA toolkit other than `cuda`."""
    return bool(_TOOLKIT_DIR.search(entry)) and entry != cuda and not entry.startswith(cuda + "/")


def _pinned_for_active_release(settings: Settings, readings) -> dict[str, str] | None:
    """What the service step pins for the active release (servestack/serving.py), or None."""
    release_id = release_of(readings.host.venv_link or "", settings.venv_releases_dir)
    if release_id is None:
        return None
    expected = dict(pinned_environment(settings, release_at(settings.venv_releases_dir, release_id), None))
    return {name: value for name, value in expected.items()
            if name not in UNPREDICTABLE_ENV and name not in settings.service_secret_env}


def service_environment(settings: Settings, readings) -> str:
    """The live process carries the pinned CUDA environment: CUDA_HOME is the new toolkit, its bin/
    and libraries are on PATH and LD_LIBRARY_PATH, no other toolkit is (not even /usr/local/cuda,
    which may point elsewhere), and every variable the service step pins for the active release
    (caches, service_env, SERVESTACK_RELEASE) has its value: the service runs what is active."""
    env = _process(settings, readings).process_env
    cuda = settings.cuda_install_path
    problems = []
    if env.get("CUDA_HOME", "").rstrip("/") != cuda:
        problems.append(f"CUDA_HOME is {env.get('CUDA_HOME')!r}, expected {cuda!r}")
    path, libraries = _path_entries(env.get("PATH")), _path_entries(env.get("LD_LIBRARY_PATH"))
    if f"{cuda}/bin" not in path:
        problems.append(f"PATH lacks {cuda}/bin")
    if not any(entry.startswith(cuda + "/") for entry in libraries):
        problems.append(f"LD_LIBRARY_PATH has no {cuda} library directory")
    strays = sorted({entry for entry in path + libraries if _other_toolkit(entry, cuda)})
    if strays:
        problems.append("another toolkit is on the search paths: " + ", ".join(strays))
    expected = _pinned_for_active_release(settings, readings)
    if expected is None:
        problems.append(f"{settings.venv_path} is not a release under {settings.venv_releases_dir}")
    else:
        problems += [f"{name} is {env.get(name)!r}, the service step pins {value!r}"
                     for name, value in expected.items() if env.get(name) != value]
    if problems or expected is None:
        raise Fail(f"{settings.service_name}'s live environment {readings.on}: " + "; ".join(problems))
    return (f"CUDA_HOME={cuda}; no other toolkit on PATH or LD_LIBRARY_PATH; "
            f"{len(expected)} pinned variable(s) as the service step sets them")


def service_secrets(settings: Settings, readings) -> str:
    """The unit names no secret variable and holds no secret value; the secrets file is 0600 root."""
    _systemd(readings)
    host, path = readings.host, secrets_path(settings)
    problems = []
    if not host.unit_readable:
        problems.append(f"cannot read the unit files of {settings.service_name}")
    if host.unit_secret_names:
        problems.append(f"the unit sets a secret variable ({', '.join(settings.service_secret_env)}) itself")
    if host.unit_secret_values:
        problems.append(f"the unit contains a value from {path}")
    if host.secrets_file is None:
        if settings.service_secret_env:
            problems.append(f"{path} is missing but service_secret_env names " + ", ".join(settings.service_secret_env))
    elif host.secrets_file.split()[:3] != ["600", "root", "root"]:
        problems.append(f"{path} is mode/owner/group {host.secrets_file or '?'}, expected 600 root root")
    if problems:
        raise Fail(f"{settings.service_name} {readings.on}: " + "; ".join(problems))
    where = "absent (no secrets configured)" if host.secrets_file is None else "600 root root"
    return f"no secret in the unit; {path} {where}"


def _http_report(readings) -> dict:
    _systemd(readings)
    found = report(readings.http)
    if found is None:
        raise Fail(f"the HTTP probe {readings.on} gave no report: " + tail(readings.http, 10))
    return found


def service_health(settings: Settings, readings) -> str:
    found = _http_report(readings)
    url = f"{found['base']}/health"
    if found.get("health") != 200:
        raise Fail(f"GET {url} {readings.on}: {found.get('health') or found.get('health_error')}")
    return f"GET {url}: 200"


def service_generate(settings: Settings, readings) -> str:
    found = _http_report(readings)
    url = f"{found['base']}/generate"
    text = found.get("generate_text")
    if found.get("generate_status") != 200 or not isinstance(text, str) or not text.strip():
        why = found.get("generate_error") or (f"status {found.get('generate_status')}, text {text!r}"
                                              + (f", body {found['generate_body']!r}"
                                                 if "generate_body" in found else ""))
        raise Fail(f"POST {url} {readings.on}: {why}")
    return f"POST {url}: {GENERATE_REQUEST['text']!r} -> {text.strip()[:60]!r}"
