"""The verification suite's control side: pyinfra inventory -> testinfra hosts, probes, the fleet table.

    pytest tests/verify --inventory inventory.py [--limit GROUP_OR_HOST] [--junitxml=FILE]
    pytest tests/verify --hosts=ssh://root@gpu-node-01 [--host-data gpu_count=4]
    servestack verify inventory.py [--limit GROUP_OR_HOST] [--junit FILE]

Each inventory host (group data applied, `--limit` honoured) becomes a `Target`: its validated
`Settings` (the expectations: versions, paths, GPU architecture, from the manifest and the same
host data the deploy used) and a testinfra backend reached the way pyinfra reaches it:

    SSH host        ssh://user@hostname:port, with ssh_key, ssh_known_hosts_file,
                    ssh_strict_host_key_checking, ssh_config_file; sudo when _sudo is set
    @local          local://
    @chroot/PATH    testinfra's chroot backend on PATH

A target runs each probe group of servestack/checks.py once (one remote command) and keeps its
output; every test reads from that. `servestack verify` runs the same suite in-process and prints
one table: a row per check, a column per host.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable, Iterable

from servestack import checks
from servestack.errors import ConfigError
from servestack.manifest import PROJECT_ROOT
from servestack.settings import Settings, settings_from_data
from servestack.targets import PLACEHOLDER_SUFFIX

VERIFY_TESTS = PROJECT_ROOT / "tests" / "verify"
SSH_CONTROL_PERSIST_S = 60
PREFETCH_WORKERS = 16


# --- inventory -> testinfra backends ------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """How testinfra reaches one host: `testinfra.get_host(hostspec, **options)`."""

    hostspec: str
    options: tuple[tuple[str, Any], ...] = ()

    def connect(self):
        import testinfra

        return testinfra.get_host(self.hostspec, **dict(self.options))

    def describe(self) -> str:
        sudo = dict(self.options).get("sudo")
        connection = dict(self.options).get("connection")
        spec = f"{connection}:{self.hostspec}" if connection and "://" not in self.hostspec else self.hostspec
        return spec + (" (sudo)" if sudo else "")


def _control_dir() -> str:
    """A private directory for OpenSSH control sockets (one master connection per host)."""
    path = Path(tempfile.gettempdir()) / f"servestack-ssh-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def _ssh_options(name: str, data: dict) -> list[str]:
    """OpenSSH -o options carrying the pyinfra SSH data testinfra has no parameter for."""
    options = ["BatchMode=yes"]
    if data.get("ssh_known_hosts_file"):
        options.append(f"UserKnownHostsFile={os.path.expanduser(data['ssh_known_hosts_file'])}")
    strict = data.get("ssh_strict_host_key_checking")
    if strict is not None:
        strict = {True: "yes", False: "no", "off": "no"}.get(strict, strict)
        if strict not in ("yes", "no", "accept-new", "ask"):
            raise ConfigError(f"host {name}: 'ssh_strict_host_key_checking': expected yes, no, accept-new "
                              f"or off, got {data['ssh_strict_host_key_checking']!r}")
        options.append(f"StrictHostKeyChecking={'yes' if strict == 'ask' else strict}")
    if data.get("ssh_key"):
        options.append("IdentitiesOnly=yes")
    if data.get("ssh_allow_agent") is False:
        options.append("IdentityAgent=none")
    if data.get("ssh_forward_agent"):
        options.append("ForwardAgent=yes")
    return options


def _sudo_options(data: dict) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = []
    if data.get("_sudo"):
        options.append(("sudo", True))
        if data.get("_sudo_user"):
            options.append(("sudo_user", data["_sudo_user"]))
    return options


def ssh_backend(name: str, data: dict) -> Backend:
    """testinfra's OpenSSH backend for a pyinfra SSH host, from its (merged) host data."""
    if data.get("ssh_password"):
        raise ConfigError(f"host {name}: the verification suite does not use SSH passwords "
                          "(ssh_password); give the host an ssh_key")
    hostname = str(data.get("ssh_hostname") or name)
    if ":" in hostname and not hostname.startswith("["):
        hostname = f"[{hostname}]"
    user = f"{data['ssh_user']}@" if data.get("ssh_user") else ""
    port = f":{int(data['ssh_port'])}" if data.get("ssh_port") else ""
    # One master connection per host for all its probes. Given in ssh_extra_args, which testinfra
    # escapes, because its own `controlpath` option breaks on the % of %C.
    multiplex = ["ControlMaster=auto", f"ControlPersist={SSH_CONTROL_PERSIST_S}s",
                 f"ControlPath={os.path.join(_control_dir(), '%C')}"]
    extra = " ".join(f"-o {shlex.quote(option)}" for option in _ssh_options(name, data) + multiplex)
    options: list[tuple[str, Any]] = [("ssh_extra_args", extra)]
    if data.get("ssh_key"):
        options.append(("ssh_identity_file", os.path.expanduser(str(data["ssh_key"]))))
    if data.get("ssh_config_file"):
        options.append(("ssh_config", os.path.expanduser(str(data["ssh_config_file"]))))
    return Backend(f"ssh://{user}{hostname}{port}", tuple(options + _sudo_options(data)))


def backend_for(host) -> Backend:
    """Map a pyinfra inventory host to the testinfra backend that reaches it the same way."""
    from pyinfra.connectors.chroot import ChrootConnector
    from pyinfra.connectors.local import LocalConnector
    from pyinfra.connectors.ssh import SSHConnector

    data = host.data.dict()
    connector = host.connector_cls
    if issubclass(connector, SSHConnector):
        return ssh_backend(host.name, data)
    if issubclass(connector, LocalConnector):
        return Backend("local://", tuple(_sudo_options(data)))
    if issubclass(connector, ChrootConnector):
        return Backend(data["chroot_directory"], (("connection", "chroot"), *_sudo_options(data)))
    raise ConfigError(f"host {host.name}: the verification suite cannot reach hosts of pyinfra's "
                      f"{connector.__name__}; it supports SSH hosts, @local and @chroot/PATH")


def split_patterns(limit: str | Iterable[str] | None) -> list[str]:
    """--limit values ('a,b' or repeated) as a list of names/globs."""
    if not limit:
        return []
    values = [limit] if isinstance(limit, str) else list(limit)
    return [pattern.strip() for value in values for pattern in value.split(",") if pattern.strip()]


def _apply_limit(inventory, patterns: list[str]) -> list:
    """pyinfra's --limit: each pattern is a group name, else a glob over host names."""
    from pyinfra.api.exceptions import NoGroupError

    if not patterns:
        return list(inventory)
    chosen = []
    for pattern in patterns:
        try:
            hosts = list(inventory.get_group(pattern))
        except NoGroupError:
            hosts = [host for host in inventory if fnmatch(host.name, pattern)]
        if not hosts:
            raise ConfigError(f"--limit {pattern}: no group or host of the inventory matches")
        chosen += [host for host in hosts if host not in chosen]
    return [host for host in inventory if host in chosen]


def _pyinfra_cli():
    """pyinfra's CLI package, for its inventory loader, imported WITHOUT the gevent monkey-patching
    its import performs (the `pyinfra` command needs it; this process does not). Patched, os.close
    hands directory and pipe fds to a gevent hub that never runs here, so every `shutil.rmtree`
    leaks one fd per directory: the test session hit EMFILE at 1024 open files."""
    if "pyinfra_cli" not in sys.modules:
        from gevent import monkey

        patch_all = monkey.patch_all
        monkey.patch_all = lambda *args, **kwargs: None
        try:
            import pyinfra_cli  # noqa: F401
        finally:
            monkey.patch_all = patch_all
    import pyinfra_cli.exceptions
    import pyinfra_cli.inventory
    import pyinfra_cli.util
    return sys.modules["pyinfra_cli"]


def load_inventory(path: str | Path, limit=None, override_data: dict | None = None) -> list:
    """The pyinfra hosts of an inventory file, with group data applied and --limit honoured."""
    from pyinfra.api import State
    from pyinfra.context import ctx_state

    cli = _pyinfra_cli()
    CliError, make_inventory = cli.exceptions.CliError, cli.inventory.make_inventory

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: inventory file not found")
    # make_inventory reads group_data/ beside the inventory and in the working directory, as the
    # pyinfra CLI does; it needs a State in context to execute the inventory's Python.
    with ctx_state.use(State()):
        try:
            inventory = make_inventory(str(path), override_data=override_data or None, cwd=os.getcwd())
        except CliError as error:
            raise ConfigError(f"{path}: {error}") from None
    return _apply_limit(inventory, split_patterns(limit))


# --- targets ------------------------------------------------------------------------------


class Unreachable(RuntimeError):
    """A host's probes could not run (SSH failed, no sh, ...)."""


class Target:
    """One host under verification: its expectations (`settings`), its testinfra host, and the
    probe output of each group, read once."""

    def __init__(self, name: str, settings: Settings, connect: Callable[[], Any], backend: str = ""):
        self.name = name
        self.settings = settings
        self.backend = backend
        self._connect = connect
        self._host = None
        self._probe = checks.Probe(name)
        self._lock = threading.Lock()
        self._unreachable: str | None = None  # why the host could not be reached, once it was tried

    def __repr__(self) -> str:
        return f"<Target {self.name} {self.backend}>"

    @property
    def host(self):
        """The testinfra host (testinfra's `host` fixture, for tests of your own)."""
        if self._host is None:
            self._host = self._connect()
        return self._host

    def run_script(self, script: str) -> str:
        """Run a probe script with sh on the host; its own failures are in its sections."""
        result = self.host.run("sh -c %s", script)
        if not result.stdout.strip() and result.rc != 0:
            raise RuntimeError(f"{self.name}: the probe could not run (exit {result.rc}): "
                               f"{result.stderr.strip()[-500:]}")
        return result.stdout

    def probe(self, *groups: str) -> checks.Probe:
        """The probe output of `groups`, running each missing group once.

        Raises Unreachable when the host cannot be reached (tried once: later calls fail at once).
        """
        with self._lock:
            if self._unreachable:
                raise Unreachable(self._unreachable)
            try:
                for group in groups:
                    self._load(group)
            except Exception as error:
                self._unreachable = f"cannot run the probes on {self.name} ({self.backend}): {error}"
                raise Unreachable(self._unreachable) from None
        return self._probe

    def _load(self, group: str) -> None:
        if group in self._probe.loaded:
            return
        if group == "patches":
            self._load("host")
            script = checks.patches_script(self.settings, checks.patch_record_for(self._probe))
        else:
            script = checks.SCRIPTS[group](self.settings)
        self._probe.sections.update(checks.parse_sections(self.run_script(script)))
        self._probe.loaded.add(group)

    def judge(self, name: str, *args) -> checks.Outcome:
        """The outcome of one check of servestack/checks.py on this host."""
        check = checks.CHECKS_BY_NAME[name]
        return check.judge(self.settings, self.probe(*check.groups), *args)

    def check(self, name: str, *args) -> checks.Outcome:
        """Judge a check and report it to pytest: fail or skip with the check's own words."""
        import pytest

        __tracebackhide__ = True  # pytest reports the test's line, not this one

        try:
            outcome = self.judge(name, *args)
        except Unreachable as error:
            pytest.fail(str(error), pytrace=False)
        if outcome.status == checks.FAILED:
            pytest.fail(outcome.detail, pytrace=False)
        if outcome.status == checks.SKIPPED:
            pytest.skip(outcome.detail)
        return outcome


def _settings(name: str, data: dict) -> Settings:
    return settings_from_data(name, data)


def targets_from_inventory(path: str | Path, limit=None, override_data: dict | None = None) -> list[Target]:
    """A Target per inventory host in the limit; every host's settings validated first."""
    hosts = load_inventory(path, limit, override_data)
    problems, targets = [], []
    for host in hosts:
        address = str(host.data.get("ssh_hostname") or host.name)
        if address.endswith(PLACEHOLDER_SUFFIX):
            problems.append(f"host {host.name}: '{address}' is a placeholder from the example inventory: "
                            "edit inventory.py")
            continue
        try:
            backend = backend_for(host)
            targets.append(Target(host.name, _settings(host.name, host.data.dict()), backend.connect,
                                  backend.describe()))
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError(f"{path}: cannot verify:\n" + "\n".join(problems))
    return targets


def targets_from_testinfra(hostspecs: list[str], data: dict | None = None, **options) -> list[Target]:
    """A Target per testinfra --hosts entry, expectations from the manifest and `data` (--host-data)."""
    import testinfra

    targets = []
    for host in testinfra.get_hosts(hostspecs, **options):
        name = host.backend.get_pytest_id()
        targets.append(Target(name, _settings(name, dict(data or {})), lambda host=host: host, name))
    return targets


def prefetch(plan: dict[Target, set[str]], workers: int = PREFETCH_WORKERS) -> None:
    """Run each target's probe groups, hosts in parallel (a fleet takes about as long as one host).

    Errors are left for the tests, which hit them again and report them per host.
    """
    def load(target: Target, groups: set[str]) -> None:
        try:
            target.probe(*[group for group in checks.GROUPS if group in groups])
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(plan)))) as pool:
        for future in [pool.submit(load, target, groups) for target, groups in plan.items()]:
            future.result()


def parse_host_data(items: Iterable[str]) -> dict:
    """KEY=VALUE overrides, parsed as pyinfra's --data parses them."""
    parse_cli_arg = _pyinfra_cli().util.parse_cli_arg
    data = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--host-data {item!r}: expected KEY=VALUE")
        data[key] = parse_cli_arg(value)
    return data


# --- servestack verify: the per-host table ------------------------------------------------


@dataclass
class Results:
    """What the suite reported: check -> host -> (status, detail), in the order checks ran."""

    cells: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)

    def add(self, check: str, host: str, status: str, detail: str) -> None:
        if host not in self.hosts:
            self.hosts.append(host)
        row = self.cells.setdefault(check, {})
        if row.get(host, ("",))[0] != checks.FAILED:  # a teardown report never hides a failure
            row[host] = (status, detail)

    def counts(self) -> dict[str, int]:
        totals = {checks.PASSED: 0, checks.FAILED: 0, checks.SKIPPED: 0}
        for row in self.cells.values():
            for status, _ in row.values():
                totals[status] += 1
        return totals


def _report_detail(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, "Skipped: reason")
        return longrepr[2].removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    return text.removeprefix("Failed: ")


class ResultsCollector:
    """pytest plugin: keeps each (check, host) outcome from the reports."""

    def __init__(self):
        self.results = Results()

    def pytest_runtest_logreport(self, report) -> None:
        properties = dict(report.user_properties)
        if "servestack_check" not in properties:
            return
        if report.when == "call" or report.outcome != "passed":
            status = {"passed": checks.PASSED, "failed": checks.FAILED, "skipped": checks.SKIPPED}[report.outcome]
            detail = "" if status == checks.PASSED else _report_detail(report)
            self.results.add(properties["servestack_check"], properties["servestack_host"], status, detail)


def _catalogue_order(check: str) -> tuple[int, str]:
    """Rows in the order of servestack/checks.py's catalogue (GPU, toolkit, release, service)."""
    names = [check.name for check in checks.CHECKS]
    base = check.partition("[")[0]
    return (names.index(base) if base in names else len(names), check)


_CELLS = {checks.PASSED: "[green]pass[/]", checks.FAILED: "[bold red]FAIL[/]", checks.SKIPPED: "[yellow]skip[/]"}


def render(results: Results, console) -> None:
    """The table (a row per check, a column per host), then every failure and skip with its reason."""
    from rich.table import Table

    table = Table(title="servestack verify", show_lines=False)
    table.add_column("check", no_wrap=True)
    for host in results.hosts:
        table.add_column(host, justify="center")
    rows = sorted(results.cells.items(), key=lambda item: _catalogue_order(item[0]))
    for check, row in rows:
        table.add_row(check, *[_CELLS[row[host][0]] if host in row else "" for host in results.hosts])
    console.print(table)
    for check, row in rows:
        for host, (status, detail) in row.items():
            if status != checks.PASSED:
                colour = "red" if status == checks.FAILED else "yellow"
                console.print(f"[{colour}]{status}[/] {host} {check}: ", end="")
                console.print(detail, markup=False, highlight=False)
    totals = results.counts()
    console.print(f"{totals[checks.PASSED]} passed, {totals[checks.FAILED]} failed, "
                  f"{totals[checks.SKIPPED]} skipped on {len(results.hosts)} host(s)")


def verify_main(inventory: str, limit: str | None = None, junit: str | None = None,
                extra_args: Iterable[str] = ()) -> int:
    """`servestack verify`: run tests/verify against the inventory, print the per-host table.

    Returns pytest's exit status (0: every check passed or was skipped with its reason).
    """
    import pytest
    from rich.console import Console

    load_inventory(inventory, limit)  # bad input fails here, with servestack's message
    args = [str(VERIFY_TESTS), "--inventory", str(inventory), "-q", "--tb=no", "-rN", "-p", "no:cacheprovider",
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args += [f"--limit={pattern}" for pattern in split_patterns(limit)]
    if junit:
        args.append(f"--junitxml={junit}")
    collector = ResultsCollector()
    status = pytest.main(args + list(extra_args), plugins=[collector])
    if collector.results.cells:
        render(collector.results, Console())
    return int(status)
