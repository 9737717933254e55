"""The SGLang service: a pinned CUDA 13 systemd unit, restarted only when needed, health-gated.

What the unit runs is the host's service profile with its host data (servestack/settings.py):
servestack/serving.py `launch_arguments` renders its command line, with or without its speculative
flags. Which the unit runs is the speculation policy's (`served_now`): service_speculation "on" with,
"off" without, "auto" as the benchmark recorded for what the service runs decided, "adaptive" with
SGLang's adaptive speculation and the config the benchmark wrote from this host's numbers (SGLang's
own until it measured), a file in the release named by its content, written here before the health
gate starts the unit (servestack/speculation_policy.py; operations/speculation.py measures after this step).

`sglang_service(release)` is given the release this run leaves active (deploy.py: the one the
venv step plans; rollback.py: the one it re-activates). In `--dry` on a fresh host that release
does not exist yet, but its id and paths are known, so the unit's diff is the one the run writes,
but for the patch set's digest: that of the record the patches step writes from the built release
(operations/patches.py `patchset_digest`; a release already built has it in the dry run too).

The unit names the release's python by its release path, so a release switch, a patch-set
change (its digest is in the unit), a flag or an environment change is a unit change; the
secrets file is compared by hash. A restart happens only when the fingerprint of unit + secrets
differs from the one recorded after the last healthy start (or the service is not running), so a
converged host is left untouched. After a restart the health gate waits for GET /health, sends
one POST /generate and, on failure, re-activates the last known-good release and unit.

Hosts restart a batch at a time (`rollout_batch`, via pyinfra's per-operation `_parallel`) and the
roll-out stops once more than `rollout_failure_budget` hosts failed their health gate.

Host-side shell lives in files/scripts: the health gate (sglang-health-gate.sh), the secrets
file's staging (secrets-file.sh) and atomic writes (atomic-write.sh, servestack/scripts.py).
`host_reads` lists what the step reads, for deploy.py's one batched read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from io import StringIO

import jinja2
from pyinfra import host, logger
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, deploy, operation
from pyinfra.api.output import format_text
from pyinfra.api.state import BaseStateCallback
from pyinfra.facts.files import Directory, File, FileContents, Sha256File
from pyinfra.facts.server import Groups, Which
from pyinfra.operations import server
from pyinfra.operations.util.files import generate_color_diff

from facts.batch import FactRequest
from facts.service import PatchsetDigest, PathOwner, ServiceRecord, UnitState, UnreadableBy, UserAccount
from facts.venv import MlEnvState, release_of
from operations import patches
from operations.patches import patchset_digest
from operations.venv import mlenv_fact_arguments
from servestack import reads
from servestack.errors import ConfigError
from servestack.hostrun import REFUSED, fail_host, noop, parse_stamp, plan, refuse, while_busy
from servestack.manifest import PROJECT_ROOT
from servestack.paths import (
    candidate_unit_path,
    good_unit_path,
    release_cache_dir,
    secrets_path,
    secrets_staging_path,
    service_home_dir,
    service_record_path,
    service_state_dir,
    speculation_record_path,
    unit_copy_path,
    unit_path,
)
from servestack.pyinfra_hooks import inner
from servestack.releases import Release, encode, release_at
from servestack.scripts import atomic_copy_command, atomic_write_command, script
from servestack.serving import (
    GENERATE_REQUEST,
    adaptive_config_path,
    check_url,
    launch_arguments,
    service_environment,
    speculates,
)
from servestack.settings import Settings, host_settings, secret_variable_problems
from servestack.speculation_policy import BASELINE, Served, adaptive_config_text, identity_fingerprint, served

TEMPLATES = PROJECT_ROOT / "files" / "templates"
UNIT_TEMPLATE = TEMPLATES / "sglang.service.j2"
GATE_SCRIPT = "sglang-health-gate.sh"      # files/scripts: the health gate, run as root
SECRETS_SCRIPT = "secrets-file.sh"         # files/scripts: stages, places and removes the secrets file
GPU_GROUPS = ("video", "render")  # own /dev/nvidia*, /dev/dri on distributions that restrict them
FIRST_LOGIN_UID = 1000
GENERATE_TIMEOUT_S = 300
RUNNING_STATES = ("active", "activating", "reloading")


def running(state: dict) -> bool:
    """Whether systemd runs the unit's server or is starting it (UnitState's properties): not a
    crash loop between two automatic restarts (activating / auto-restart)."""
    return state.get("ActiveState") in RUNNING_STATES and state.get("SubState") != "auto-restart"


def restarted_since_verified(record: dict | None, state: dict) -> bool:
    """Whether the unit was started since the health gate's last verified start (another
    InvocationID: by hand, or by systemd after a crash). A record from before servestack kept the
    invocation says no."""
    recorded = (record or {}).get("invocation")
    return bool(recorded and state.get("InvocationID") and state["InvocationID"] != recorded)


def edited_since_verified(record: dict | None, unit_mtime: datetime | None) -> bool:
    """Whether the unit file was written after the health gate's last verified start (`unit_mtime`,
    UTC: a hand edit, which this run puts back). With `restarted_since_verified`, the running server
    may run that edit; either alone is harmless (an edit without a restart leaves the verified unit
    running; a restart of an untouched unit runs it again)."""
    healthy_at = parse_stamp((record or {}).get("healthy_at"))
    return bool(unit_mtime and healthy_at and unit_mtime > healthy_at.replace(tzinfo=None))


def unit_state_text(state: dict) -> str:
    active = state.get("ActiveState", "unknown")
    return f"{active} (auto-restart: its server keeps exiting)" if state.get("SubState") == "auto-restart" else active


@dataclass(frozen=True)
class NoEffect:
    """A setting known to do nothing for a package version on some GPU architectures."""

    setting: str
    package: str
    version: str
    working_majors: tuple[int, ...]
    why: str


# Knowledge about specific releases (see stack-facts in the project notes), matched against
# the version the manifest installs; an unlisted version gets no warning.
NO_EFFECT = (
    NoEffect("service_enable_flashinfer_allreduce_fusion", "sglang", "0.5.9", (9, 10),
             "sglang 0.5.9 gates --enable-flashinfer-allreduce-fusion to SM90/SM100 and FlashInfer "
             "builds that kernel only for compute capability majors 9 and 10"),
)


class Secret(str):
    """A secret value: its repr never shows it, should it end up in a log line."""

    def __repr__(self) -> str:
        return "<secret>"


# -- the release -----------------------------------------------------------------------------------

def release(settings: Settings, release_id: str) -> Release:
    return release_at(settings.venv_releases_dir, release_id)


# -- validation and warnings -----------------------------------------------------------------------

def ineffective_settings(settings: Settings) -> list[str]:
    """Warnings for enabled settings known to do nothing on this host's GPUs with the installed version."""
    major = int(settings.gpu_compute_capability.split(".")[0])
    warnings = []
    for rule in NO_EFFECT:
        try:
            installed = settings.package(rule.package).version
        except KeyError:
            continue
        if getattr(settings, rule.setting) and installed == rule.version and major not in rule.working_majors:
            warnings.append(f"{rule.setting} is enabled but has no effect on SM{major}{_minor(settings)} "
                            f"GPUs with {rule.package} {installed}: {rule.why}")
    return warnings


def _minor(settings: Settings) -> str:
    return settings.gpu_compute_capability.split(".")[1]


# -- the unit --------------------------------------------------------------------------------------

def systemd_quote(value: str) -> str:
    """One word of a systemd command line (ExecStart=), quoted when needed: specifiers (%) and
    variables ($), which systemd expands there, are escaped."""
    return _systemd_word(value, value.replace("%", "%%").replace("$", "$$"))


def systemd_environment_quote(assignment: str) -> str:
    """One `NAME=value` of an Environment= line, quoted when needed. systemd expands specifiers
    (%) there but not variables: a `$` is the value's own (doubled, the service would see `$$`)."""
    return _systemd_word(assignment, assignment.replace("%", "%%"))


def _systemd_word(value: str, escaped: str) -> str:
    if value and re.fullmatch(r"[A-Za-z0-9_./:=,+@%$-]+", value):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_start(settings: Settings, rel: Release, speculation: bool = True, adaptive_config: str | None = None) -> str:
    """The command line, one flag (with its value) per continued line, so a diff shows the flag."""
    lines = [f"{systemd_quote(rel.python)} -m {systemd_quote(settings.service_launch_module)}"]
    for word in launch_arguments(settings, speculation, adaptive_config):
        if word.startswith("-") or len(lines) == 1:
            lines.append(systemd_quote(word))
        else:
            lines[-1] += " " + systemd_quote(word)
    return " \\\n    ".join(lines)


@functools.cache
def _unit_template() -> jinja2.Template:
    """Compiled once per run, not once per host and stage."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
    ).get_template(UNIT_TEMPLATE.name)


def render_unit(settings: Settings, rel: Release, patchset: str | None,
                supplementary_groups: tuple[str, ...] = (), with_secrets: bool = False,
                speculation: bool = True, adaptive_config: str | None = None) -> str:
    """The unit text for `rel` (pure: same inputs, same bytes); `speculation=False`: without the
    profile's speculative flags; `adaptive_config`: SGLang's adaptive speculation with the config at that path."""
    return _unit_template().render(
        service_name=settings.service_name,
        release_id=rel.id,
        release_dir=rel.dir,
        cuda_version=settings.cuda_version,
        cuda_home=settings.cuda_install_path,
        user=settings.service_user,
        supplementary_groups=list(supplementary_groups),
        home=service_home_dir(settings),
        environment=[systemd_environment_quote(f"{name}={value}")
                     for name, value in service_environment(settings, rel, patchset)],
        secrets_file=secrets_path(settings) if with_secrets else None,
        exec_start=exec_start(settings, rel, speculation, adaptive_config),
        start_timeout_s=settings.service_start_timeout_s,
        start_limit_burst=settings.service_start_limit_burst,
        start_limit_interval_s=start_limit_interval_s(settings),
        restart_sec=RESTART_SEC,
    )


RESTART_SEC = 10  # the unit's RestartSec


def start_limit_interval_s(settings: Settings) -> int:
    """StartLimitIntervalSec: long enough to hold `start_limit_burst` starts that each load the model
    for up to start_timeout_s, so a server that crashes while loading does trip the limit."""
    return settings.service_start_limit_burst * (settings.service_start_timeout_s + RESTART_SEC)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(unit_text: str, secrets_sha: str | None) -> str:
    """What the running service was started with: the unit bytes and the secrets file's hash."""
    return sha256_text(f"unit {sha256_text(unit_text)}\nsecrets {secrets_sha or 'none'}\n")


# -- secrets ---------------------------------------------------------------------------------------

def secrets_content(host_name: str, names: tuple[str, ...], environ=os.environ) -> Secret | None:
    """The secrets file from control-machine environment variables; None when none are configured.

    Raises ConfigError naming every missing or unusable variable (never a value).
    """
    if not names:
        return None
    problems = secret_variable_problems(names, environ)
    if problems:
        raise ConfigError("\n".join(f"host {host_name}: 'service_secret_env': {problem}" for problem in problems))
    lines = ["# servestack: SGLang service secrets (root only); from the control machine's environment\n"]
    lines += [f"{name}='{environ[name]}'\n" for name in names]
    return Secret("".join(lines))


# -- the health gate -------------------------------------------------------------------------------

def gate_environment(settings: Settings, rel: Release, unit_fingerprint: str,
                     record: dict | None, unit_source: str | None = None) -> dict[str, str]:
    """Inputs of the health-gate script (files/scripts/sglang-health-gate.sh); it installs `unit_source`
    (default: the release's copy of the unit, which the `unit` operation writes) as the service's unit."""
    previous = (record or {}).get("release")
    if previous:
        previous_venv = release(settings, previous).venv
        label = f"release {previous}"
    else:
        previous_venv = ""
        label = "the unit that ran before servestack managed it"
    return {
        "SS_UNIT": settings.service_name,
        "SS_UNIT_PATH": unit_path(settings),
        "SS_UNIT_CANDIDATE": candidate_unit_path(settings),
        "SS_UNIT_SOURCE": unit_source or unit_copy_path(settings, rel),
        "SS_URL": check_url(settings),
        "SS_HEALTH_TIMEOUT": str(settings.service_health_timeout_s),
        "SS_GENERATE_TIMEOUT": str(GENERATE_TIMEOUT_S),
        "SS_GENERATE_BODY": json.dumps(GENERATE_REQUEST),
        "SS_RELEASE": rel.id,
        "SS_RELEASE_DIR": rel.dir,
        "SS_FINGERPRINT": unit_fingerprint,
        "SS_STATE_DIR": service_state_dir(settings),
        "SS_GOOD_UNIT": good_unit_path(settings),
        "SS_RECORD": service_record_path(settings),
        "SS_VENV_PATH": settings.venv_path,
        "SS_PREVIOUS_RELEASE": previous or "",
        "SS_PREVIOUS_VENV": previous_venv,
        "SS_PREVIOUS_LABEL": label,
        "SS_PREVIOUS_FINGERPRINT": (record or {}).get("fingerprint") or "",
        "SS_PYTHON": settings.venv_python,
        "SS_ROLLBACK_RECORD": encode({"state_dir": settings.servestack_state_dir, "release": previous or "",
                                      "previous": rel.id, "by": "service-rollback",
                                      "only_where_kept": True}),
    }


def gate_command(environment: dict[str, str]) -> StringCommand:
    return script(GATE_SCRIPT, env=environment)


# -- the roll-out's failure budget ---------------------------------------------------------------------

class GateFailures(BaseStateCallback):
    """The hosts whose health gate failed in this run, per restart operation (its op hash).

    pyinfra runs an operation with `_parallel=N` batch after batch, but marks hosts failed
    (`state.failed_hosts`) only once every batch is done; it reports each host's failure to the
    state's callbacks at once, so the roll-out's failure budget is counted here, before each
    restart. Only hosts whose gate ran count: a host the roll-out stopped, or refused for another
    reason, did not fail a health gate.
    """

    def __init__(self):
        self.gated: set[tuple[str, str]] = set()   # (op hash, host name): the gate ran there
        self.failed: dict[str, list[str]] = {}     # op hash -> host names, in order of failure

    def gating(self, op_hash: str, host_name: str) -> None:
        """The restart operation `op_hash` runs the health gate on this host now."""
        self.gated.add((op_hash, host_name))

    def operation_host_error(self, state, host, op_hash, retry_count=0, max_retries=0):  # type: ignore[override]
        if (op_hash, host.name) in self.gated:
            self.failed.setdefault(op_hash, []).append(host.name)


def gate_failures(state) -> GateFailures:
    """The run's `GateFailures`, registered with the state on first use."""
    for handler in state.callback_handlers:
        if isinstance(handler, GateFailures):
            return handler
    handler = GateFailures()
    state.add_callback_handler(handler)
    return handler


def rollout_failures(state, op_hash: str) -> list[str]:
    """Hosts whose health gate (the restart operation `op_hash`) has already failed in this run."""
    return list(gate_failures(state).failed.get(op_hash, ()))


# -- what the operations read and share ----------------------------------------------------------------

def desired_unit(settings: Settings, rel: Release, supplementary_groups: tuple[str, ...],
                 what: Served | None = None) -> str:
    """The unit for `rel` serving `what` (None: as the policy says)."""
    return unit_for(settings, rel, patchset_digest(rel), supplementary_groups, what or served_now(settings, rel))


def unit_for(settings: Settings, rel: Release, patchset: str | None, supplementary_groups: tuple[str, ...],
             what: Served) -> str:
    """The unit for `rel` serving `what` (pure)."""
    config = adaptive_config_file(rel, what)
    return render_unit(settings, rel, patchset, supplementary_groups, bool(settings.service_secret_env),
                       what.speculation, config[0] if config else None)


def adaptive_config_file(rel: Release, what: Served) -> tuple[str, str] | None:
    """(path, text) of the adaptive config file the unit serving `what` names (None: it names none)."""
    if what.adaptive_config is None:
        return None
    text = adaptive_config_text(what.adaptive_config)
    return adaptive_config_path(rel, text), text


def service_identity(settings: Settings, rel: Release) -> dict:
    """What the service runs, as far as its speed goes: what a speculation decision was measured for
    (servestack/speculation_policy.py `identity_fingerprint`)."""
    patchset = patchset_digest(rel)
    return {"release": rel.id, "patchset": patchset or "none", "profile": settings.service_profile,
            "launch_module": settings.service_launch_module, "arguments": launch_arguments(settings, True),
            "environment": [list(pair) for pair in service_environment(settings, rel, patchset)]}


def served_now(settings: Settings, rel: Release) -> Served:
    """What the unit for `rel` runs (service_speculation; under "auto" and "adaptive", the decision
    recorded for what the service runs, else the profile as written, with SGLang's own adaptive config)."""
    if not speculates(settings):
        return Served(BASELINE)
    record = reads.fact(host, ServiceRecord, path=speculation_record_path(settings))
    return served(settings.service_speculation, settings.service_speculation_min_gain, record,
                  identity_fingerprint(service_identity(settings, rel)))


def speculation_enabled(settings: Settings, rel: Release) -> bool:
    """Whether the unit for `rel` runs the profile's speculative flags (`served_now`)."""
    return served_now(settings, rel).speculation


def gpu_groups() -> tuple[str, ...]:
    """The GPU device groups present on the host: the service user's supplementary groups."""
    return tuple(group for group in GPU_GROUPS if group in reads.fact(host, Groups))


def local_model_paths(settings: Settings) -> list[str]:
    """Model paths on the host's disk (others are hub ids, downloaded into the service user's home)."""
    paths = [settings.service_model_path]
    if speculates(settings) and settings.service_draft_model_path is not None:
        paths.append(settings.service_draft_model_path)
    return [path for path in paths if path.startswith("/")]


def deploy_reads(settings: Settings) -> list[FactRequest]:
    """What `sglang_service` itself decides from when deploy.py runs (its operations read the rest):
    the service user's account, the host's groups, the ML environment before this run (where
    venv_path points: the venv step's own MlEnvState), and the speculation record, which names the
    adaptive config files `host_reads` lists with the release."""
    return [FactRequest.of(Groups),
            FactRequest.of(UserAccount, user=settings.service_user),
            FactRequest.of(MlEnvState, **mlenv_fact_arguments(settings)),
            FactRequest.of(ServiceRecord, path=speculation_record_path(settings))]


def host_reads(settings: Settings, release: Release | None = None) -> list[FactRequest]:
    """What `sglang_service` and its operations read of a host, with the arguments they pass
    (deploy.py reads them all in one remote command); with `release`, also what they read of it.
    Reads made only when something changes (the unit's text, the releases, unreadable model
    paths) are not listed."""
    requests = [
        *deploy_reads(settings),
        FactRequest.of(Directory, path=service_home_dir(settings)),
        FactRequest.of(Sha256File, path=secrets_path(settings)),
        FactRequest.of(Which, command="curl"),
        FactRequest.of(UnitState, unit=settings.service_name),
        FactRequest.of(Sha256File, path=unit_path(settings)),
        FactRequest.of(Sha256File, path=good_unit_path(settings)),
        FactRequest.of(ServiceRecord, path=service_record_path(settings)),
    ]
    if release is not None:
        requests += [
            FactRequest.of(PathOwner, path=release_cache_dir(settings, release.id)),
            FactRequest.of(PatchsetDigest, release_dir=release.dir),
            *patches.host_reads(settings, release),   # patchset_digest: what the patches step leaves
            FactRequest.of(Sha256File, path=unit_copy_path(settings, release)),
            *adaptive_config_reads(settings, release),
        ]
    return requests


def adaptive_config_reads(settings: Settings, rel: Release) -> list[FactRequest]:
    """The adaptive config files the unit for `rel` may name (`served_now`): the one the speculation
    record gives if it measured what the service runs, else SGLang's own; both, as whether it did is
    known only from the release's patch set, read with this list."""
    if settings.service_speculation != "adaptive":
        return []
    policy, min_gain = settings.service_speculation, settings.service_speculation_min_gain
    record = reads.fact(host, ServiceRecord, path=speculation_record_path(settings))
    measured = served(policy, min_gain, record, (record or {}).get("fingerprint", ""))
    configs = (adaptive_config_file(rel, what) for what in (measured, served(policy, min_gain, None, "")))
    return [FactRequest.of(Sha256File, path=config[0]) for config in configs if config]


# -- operations ------------------------------------------------------------------------------------

SERVICE_USER_COMMENT = "SGLang service (servestack)"
SERVICE_USER_SHELL = "/usr/sbin/nologin"


def _user_is_current(settings: Settings, groups: tuple[str, ...]) -> bool:
    """What `server.user` below would check, from two small facts: no change when all match."""
    existing = reads.fact(host, UserAccount, user=settings.service_user).get(settings.service_user)
    home = reads.fact(host, Directory, path=service_home_dir(settings))
    return bool(existing) and bool(home) and existing.get("home") == service_home_dir(settings) \
        and existing.get("shell") == SERVICE_USER_SHELL and existing.get("comment") == SERVICE_USER_COMMENT \
        and set(existing.get("groups") or ()) == set(groups) \
        and home.get("user") == settings.service_user and home.get("group") == settings.service_user


@operation()
def service_user(groups: tuple[str, ...] = ()):
    """
    The service's dedicated system user (pyinfra's ``server.user``), with its home directory.

    + groups: its supplementary groups (the GPU device groups present on the host)
    """
    settings = host_settings(host)
    if _user_is_current(settings, groups):
        noop(host, f"user {settings.service_user} exists as configured")
        return
    yield from inner(server.user)(
        user=settings.service_user,
        system=True,
        shell=SERVICE_USER_SHELL,
        home=service_home_dir(settings),
        groups=list(groups),
        comment=SERVICE_USER_COMMENT,
    )


@operation()
def cache_directory(release: Release):
    """
    Create the JIT cache directory of the release, owned by the service user.

    + release: the release the service runs (deploy.py: the one this run leaves active)

    The directory is ``<service_cache_dir>/<cuda_version>-<release id>``: kernels compiled by
    one toolkit for one release are never picked up by another.
    """
    settings = host_settings(host)
    path = release_cache_dir(settings, release.id)
    if reads.fact(host, PathOwner, path=path) == {"owner": settings.service_user, "mode": "750"}:
        noop(host, f"cache directory {path} exists")
        return
    user = settings.service_user
    yield StringCommand("install", "-d", "-m", "755", "-o", "root", "-g", "root",
                        QuoteString(settings.service_cache_dir))
    yield StringCommand("install", "-d", "-m", "750", "-o", QuoteString(user), "-g", QuoteString(user),
                        QuoteString(path))


@operation()
def secrets_file(content: Secret | None):
    """
    Write the service's secrets file (root, 0600) or remove it when no secrets are configured.

    + content: the file's text (from ``secrets_content``), or None for no secrets file

    The file is compared by sha256. Its content is never logged, diffed or put on a command line:
    with ``--diff`` the operation says only that the secrets file changed, and the text travels by
    SFTP into a file that is 0600 before any byte is written, through a private (0700) temporary
    directory (files/scripts/secrets-file.sh).
    """
    settings = host_settings(host)
    path = secrets_path(settings)
    current = reads.fact(host, Sha256File, path=path)
    if content is None:
        if current is None:
            noop(host, "no secrets configured and no secrets file")
            return
        plan(host, f"Will remove the secrets file {path} (service_secret_env is empty)")
        yield script(SECRETS_SCRIPT, "remove", path)
        return
    if current == sha256_text(content):
        noop(host, f"secrets file {path} is current")
        return
    plan(host, f"{format_text('secrets file changed', bold=True)}: {path} (content not shown)")
    upload_dir = host.get_temp_filename(f"servestack-secrets-{path}")
    yield script(SECRETS_SCRIPT, "stage", path)
    yield StringCommand("rm", "-rf", QuoteString(upload_dir), "&&", "mkdir", "-m", "700",
                        QuoteString(upload_dir), _sudo=False)
    yield FileUploadCommand(StringIO(content), secrets_staging_path(path), remote_temp_filename=f"{upload_dir}/secrets")
    yield script(SECRETS_SCRIPT, "place", path, upload_dir)


@operation()
def unit(release: Release, supplementary_groups: tuple[str, ...] = (),
         pre_deploy_venv: dict | None = None):
    """
    Render the unit for the release and keep it in the release, where the health gate installs it from.

    + release: the release the unit runs (deploy.py: the one this run leaves active; in ``--dry``
      it may not exist yet, its paths are known)
    + supplementary_groups: groups giving the service user the GPU devices (``video``, ``render``)
    + pre_deploy_venv: what sat at venv_path before the deploy changed anything (the ``venv_path``
      of ``MlEnvState``); names the release a unit servestack did not write belongs to, the first
      time servestack replaces it

    The service's unit file (/etc/systemd/system) is written only by the health gate, which installs
    the unit it starts (``restart``): systemd never holds a unit no gate started, even when this run
    stops between the steps. Where that file was edited since the gate verified it, the verified unit
    is put back (its copy in the state directory). The first time servestack replaces a unit it did not
    write, that unit is kept as the last known-good one, so a failed first restart goes back to it.
    ``--diff`` shows the unit's diff.
    """
    settings = host_settings(host)
    state = reads.fact(host, UnitState, unit=settings.service_name)
    problems = unit_host_problems(settings, bool(reads.fact(host, Which, command="curl")), state)
    if problems:   # preflight refused such a host before any change; here for a host changed since
        yield from refuse(host, problems)
        return
    what = served_now(settings, release)
    text = desired_unit(settings, release, supplementary_groups, what)
    path, wanted = unit_path(settings), sha256_text(text)
    current_sha = reads.fact(host, Sha256File, path=path)
    commands = _adaptive_config_commands(release, what)
    if current_sha != wanted:
        current_lines = reads.fact(host, FileContents, path=path) or []
        if current_sha and reads.fact(host, ServiceRecord, path=service_record_path(settings)) is None:
            commands += _baseline_commands(settings, current_lines, pre_deploy_venv)
        if host.state.config.DIFF:
            _log_unit_diff(path, current_lines, text)
        if reads.fact(host, Sha256File, path=good_unit_path(settings)) == wanted:
            plan(host, f"{path} was edited since the health gate verified it: the verified unit is put back")
            commands += [StringCommand(atomic_copy_command(good_unit_path(settings), path, "644")),
                         StringCommand("systemctl", "daemon-reload")]
        else:
            plan(host, f"the health gate installs {path} for release {release.id} when it starts it")
    elif state.get("NeedDaemonReload") == "yes":
        commands.append(StringCommand("systemctl", "daemon-reload"))
    copy_path = unit_copy_path(settings, release)
    if reads.fact(host, Sha256File, path=copy_path) != wanted:
        commands.append(StringCommand(atomic_write_command(copy_path, text, "644")))
    if current_sha == wanted and state.get("UnitFileState") != "enabled":
        commands.append(StringCommand("systemctl", "enable", "--", QuoteString(settings.service_name)))
    if not commands:
        noop(host, f"{path} is current for release {release.id}" if current_sha == wanted
             else f"{copy_path} is current for release {release.id}")
        return
    yield from commands


def _adaptive_config_commands(release: Release, what: Served) -> list:
    """Write the adaptive config file the unit names, unless it is there (a file named by its content)."""
    config = adaptive_config_file(release, what)
    if config is None:
        return []
    path, text = config
    if reads.fact(host, Sha256File, path=path) == sha256_text(text):
        return []
    plan(host, f"SGLang's adaptive speculation config {path}: {_slots(what.adaptive_config or {})}")
    return [StringCommand(atomic_write_command(path, text, "644"))]


def _slots(config: dict) -> str:
    return ", ".join(f"from {size}: steps {slot['candidate_steps']}" for size, slot in config.items())


def _baseline_commands(settings: Settings, current_lines: list[str], pre_deploy_venv: dict | None) -> list:
    """Keep the unit servestack is about to replace for the first time as the last known-good one."""
    release_id = _release_of_unit(settings, current_lines) or _pre_deploy_release(settings, pre_deploy_venv)
    record = json.dumps({"fingerprint": None, "release": release_id, "unit": unit_path(settings),
                         "baseline": "the unit found before servestack first replaced it"})
    return [
        StringCommand(atomic_copy_command(unit_path(settings), good_unit_path(settings), "644")),
        StringCommand(atomic_write_command(service_record_path(settings), record, "644")),
    ]


def _release_of_unit(settings: Settings, lines: list[str]) -> str | None:
    """The release a unit's ExecStart runs from, when it names `<releases_dir>/<id>/venv/bin/...`."""
    for line in lines:
        if line.startswith("ExecStart="):
            program = line[len("ExecStart="):].split()[0].strip('"')
            return release_of(program.rsplit("/bin/", 1)[0], settings.venv_releases_dir)
    return None


def _pre_deploy_release(settings: Settings, pre_deploy_venv: dict | None) -> str | None:
    """The release the venv path pointed at before this deploy (a hand-made venv: its adopted release)."""
    pre = pre_deploy_venv or {}
    if pre.get("kind") in ("link", "broken-link"):
        return pre.get("release")
    if pre.get("kind") in ("venv", "other"):
        now = reads.fact(host, MlEnvState, **mlenv_fact_arguments(settings)) or {}
        adopted = [name for name in now.get("releases", {}) if name.startswith("adopted-")]
        return max(adopted) if adopted else None
    return None


def _log_unit_diff(path: str, current_lines: list[str], text: str) -> None:
    host.log(f"Will {'modify' if current_lines else 'create'} {format_text(path, bold=True)}", logger.info)
    for line in generate_color_diff([line + "\n" for line in current_lines], text.splitlines(keepends=True)):
        logger.info("  %s", line)
    logger.info("")


@operation()
def restart(release: Release, secrets_sha: str | None = None,
            supplementary_groups: tuple[str, ...] = ()):
    """
    Restart the service when what it runs with changed, gate it on health, roll back on failure.

    + release: the release the unit runs (as given to ``unit``)
    + secrets_sha: sha256 of the desired secrets file (None: no secrets file)
    + supplementary_groups: as given to ``unit`` (part of the rendered unit)

    No restart when the unit + secrets fingerprint equals the one recorded after the last healthy
    start and the service is running. Otherwise: restart, wait for GET /health (200 within
    ``service_health_timeout_s``), one POST /generate with a non-empty answer; on failure the
    last known-good release and unit are re-activated and restarted, and the host fails with a
    message saying what failed and that it was rolled back. Run it with ``_parallel=rollout_batch``:
    once more than ``rollout_failure_budget`` hosts failed their gate, the others are not restarted.
    """
    settings = host_settings(host)
    text = desired_unit(settings, release, supplementary_groups)
    wanted = fingerprint(text, secrets_sha)
    record = reads.fact(host, ServiceRecord, path=service_record_path(settings))
    state = reads.fact(host, UnitState, unit=settings.service_name)
    elsewhere = restarted_since_verified(record, state) and edited_since_verified(
        record, (reads.fact(host, File, path=unit_path(settings)) or {}).get("mtime"))
    in_place = reads.fact(host, Sha256File, path=unit_path(settings))
    verified_copy = reads.fact(host, Sha256File, path=good_unit_path(settings))   # `unit` puts it back in place
    unverified = sha256_text(text) not in (in_place, verified_copy)
    left = state.get("FragmentPath") == candidate_unit_path(settings)   # by a gate that did not finish
    if record and record.get("fingerprint") == wanted and running(state) and not elsewhere and not unverified \
            and not left:
        noop(host, f"{settings.service_name} runs release {release.id} as last verified healthy; not restarted")
        return
    local_paths = local_model_paths(settings)
    unreadable = reads.fact(host, UnreadableBy, user=settings.service_user, paths=local_paths) if local_paths else []
    if unreadable:
        yield from refuse(host, [f"the service user {settings.service_user} cannot read {', '.join(unreadable)} "
                                 "(service_model_path / service_draft_model_path): grant it read access; "
                                 f"{settings.service_name} was not restarted"])
        return
    if host.state.is_executing:
        failures, op_hash = gate_failures(host.state), host.current_op_hash
        assert op_hash is not None, "pyinfra sets the operation's hash while it executes"
        failed = rollout_failures(host.state, op_hash)
        if len(failed) > settings.rollout_failure_budget:
            yield from refuse(host, [
                f"{settings.service_name} not restarted: the roll-out stopped after {len(failed)} host(s) "
                f"failed their health gate ({', '.join(sorted(failed))}; rollout_failure_budget="
                f"{settings.rollout_failure_budget})"])
            return
        failures.gating(op_hash, host.name)
    why = (f"it runs {candidate_unit_path(settings)}, the unit a health gate that did not finish was starting"
           if left and running(state)
           else "it was restarted from a unit edited since its last verified start" if elsewhere
           else f"{unit_path(settings)} is not the unit the health gate verified, and no copy of that one is "
                "kept: the gate installs this release's and starts it" if unverified and record and running(state)
           else "what it runs with changed" if record and running(state)
           else f"it is {unit_state_text(state)}" if record else "no healthy start recorded yet")
    verb = "restarting" if host.state.is_executing else "will restart"
    host.log(f"{verb} {settings.service_name} on release {release.id}: {why}", logger.info)
    yield while_busy(host, settings.servestack_state_dir, f"health-gated restart of {settings.service_name}",
                     gate_command(gate_environment(settings, release, wanted, record)))


@deploy("SGLang service")
def sglang_service(release: Release):
    """
    The service user, its cache, secrets, unit and a health-gated restart, a batch of hosts at a time.

    + release: the release the service runs: the one this run leaves active (deploy.py:
      ``venv.plan()``; rollback.py: ``venv.rollback_target()``)
    """
    settings = host_settings(host)
    secrets = secrets_content(host.name, settings.service_secret_env)
    for warning in ineffective_settings(settings):
        logger.warning(f"{host.print_prefix}{warning}")
    login = _login_user_problem(settings)
    if login:
        fail_host(host, REFUSED, [login])
        return
    groups = gpu_groups()
    service_user(name=f"Service user {settings.service_user}", groups=groups)
    cache_directory(name="Service JIT cache directory", release=release)
    secrets_file(name="Service secrets file", content=secrets)
    unit(name=f"Unit {settings.service_name}", release=release, supplementary_groups=groups,
         pre_deploy_venv=(reads.fact(host, MlEnvState, **mlenv_fact_arguments(settings)) or {}).get("venv_path"))
    restart(name=f"Health-gated restart of {settings.service_name}", release=release,
            secrets_sha=sha256_text(secrets) if secrets else None, supplementary_groups=groups,
            _parallel=settings.rollout_batch)


def _login_user_problem(settings: Settings) -> str | None:
    return login_user_problem(settings, reads.fact(host, UserAccount, user=settings.service_user))


# -- what keeps a host from running the service (preflight checks them before any change) -------------

def service_host_reads(settings: Settings) -> list[FactRequest]:
    return [FactRequest.of(Which, command="curl"), FactRequest.of(UnitState, unit=settings.service_name),
            FactRequest.of(UserAccount, user=settings.service_user)]


def unit_host_problems(settings: Settings, has_curl: bool, unit_state: dict) -> list[str]:
    problems = []
    if not has_curl:
        problems.append("curl is needed on the host for the service health gate; install it "
                        "(the service was not touched)")
    if unit_state.get("SystemdRunning") == "no":
        problems.append("systemd is not the init system here (no /run/systemd/system): "
                        f"{settings.service_name} cannot run on this host")
    return problems


def login_user_problem(settings: Settings, accounts: dict) -> str | None:
    entry = (accounts or {}).get(settings.service_user)
    if entry and entry["uid"] >= FIRST_LOGIN_UID:
        return (f"'service_user': {settings.service_user} is an existing login user (uid {entry['uid']}); "
                "the service runs as a dedicated system user: pick a name that does not exist yet "
                "(default 'sglang')")
    return None
