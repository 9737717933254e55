"""The verification suite's control side: pyinfra inventory -> testinfra hosts, their reads, the fleet table.

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

A target reads what its checks read (servestack/checks/readings.py: each group's facts, in one
remote command) once, and keeps it; every test judges from that. `servestack verify` runs the
same suite in-process and prints one table: a row per check, a column per host.

`servestack status` and `servestack backups` reach hosts the same way (`targets_from_inventory`,
then `read_all`: any facts, one remote command per host, hosts in parallel). Reports print on
`report_console()`: a terminal's width, or, when the output is not a terminal (CI logs, pipes),
wide enough that no table cell or reason is cut or wrapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from servestack.checks.catalogue import CHECKS, CHECKS_BY_NAME, base_name
from servestack.checks.outcome import FAILED, PASSED, SKIPPED, Outcome
from servestack.checks.readings import NEEDS, Readings, in_order, read_batch, read_groups
from servestack.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, ConfigError
from servestack.fleet import limited, load_inventory
from servestack.manifest import PROJECT_ROOT
from servestack.preconnect import inventory_problems
from servestack.settings import Settings, settings_from_data
from servestack.targets import PLACEHOLDER_SUFFIX, target_problem
from servestack.pyinfra_hooks import import_pyinfra_cli

VERIFY_TESTS = PROJECT_ROOT / "tests" / "verify"
SSH_CONTROL_PERSIST_S = 60
PREFETCH_WORKERS = 16
# A report's width when its output is not a terminal: no table cell or reason is cut or wrapped
# (rich's default there is 80 columns). Tables keep their natural width; text is not padded.
UNCUT_WIDTH = 10_000


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
    """A private directory for OpenSSH control sockets (one master connection per host), one per network
    namespace: the same address in another namespace is another machine (concurrent sandboxes)."""
    path = Path(tempfile.gettempdir()) / f"servestack-ssh-{os.getuid()}-{os.stat('/proc/self/ns/net').st_ino}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def _control_path(destination: str, options: list[str]) -> str:
    """The master connection's socket for `destination` reached with `options` (key, known hosts, config...).
    Not OpenSSH's %C, which hashes only local host, address, port, user and jump host: two fleets with the same
    private addresses, reached through other keys, known hosts or configs, would share a master and one
    would be read for the other."""
    digest = hashlib.sha256(json.dumps([destination, options]).encode()).hexdigest()[:24]
    return os.path.join(_control_dir(), digest)


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
    # One master connection per host for all its reads. Given in ssh_extra_args, which testinfra escapes.
    destination = f"ssh://{user}{hostname}{port}"
    options: list[tuple[str, Any]] = []
    if data.get("ssh_key"):
        options.append(("ssh_identity_file", os.path.expanduser(str(data["ssh_key"]))))
    if data.get("ssh_config_file"):
        options.append(("ssh_config", os.path.expanduser(str(data["ssh_config_file"]))))
    ssh_options = _ssh_options(name, data)
    multiplex = ["ControlMaster=auto", f"ControlPersist={SSH_CONTROL_PERSIST_S}s",
                 f"ControlPath={_control_path(destination, ssh_options + [value for _, value in options])}"]
    extra = " ".join(f"-o {shlex.quote(option)}" for option in ssh_options + multiplex)
    return Backend(destination, tuple([("ssh_extra_args", extra)] + options + _sudo_options(data)))


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


# --- targets ------------------------------------------------------------------------------


class Unreachable(RuntimeError):
    """A host's checks could not read it (SSH failed, no sh, ...)."""


UNREACHABLE = "cannot run the probes on"  # how an Unreachable's message begins


class Target:
    """One host under verification: its expectations (`settings`), its testinfra host, and what
    its checks read of it (servestack/checks/readings.py), each group read once."""

    def __init__(self, name: str, settings: Settings, connect: Callable[[], Any], backend: str = ""):
        self.name = name
        self.settings = settings
        self.backend = backend
        self._connect = connect
        self._host = None
        self._readings = Readings(name)
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

    def run_command(self, command: str) -> str:
        """Run a command with sh on the host; its stdout (the facts it reads report their own failures)."""
        try:
            result = self.host.run("sh -c %s", command)
        except RuntimeError as error:   # testinfra's ssh backend raises its CommandResult when ssh failed
            failed = error.args[0] if error.args else None
            if failed is None or not hasattr(failed, "stderr"):
                raise
            raise RuntimeError(f"ssh exited {failed.rc}: {failed.stderr.strip()[-500:]}") from None
        if not result.stdout.strip() and result.rc != 0:
            raise RuntimeError(f"{self.name}: the command could not run (exit {result.rc}): "
                               f"{result.stderr.strip()[-500:]}")
        return result.stdout

    def read(self, *groups: str) -> Readings:
        """What the checks of `groups` read, reading the groups not read yet: in one command, but a
        group another one needs (readings.NEEDS) goes in a command before.

        Raises Unreachable when the host cannot be read (tried once: later calls fail at once).
        """
        with self._reading():
            self._read_missing(groups)
        return self._readings

    def read_facts(self, wanted: list) -> list:
        """The values of any facts (facts/batch.py `FactRequest`s), read now in one remote command
        (or as few as fit). Raises Unreachable as `read` does."""
        with self._reading():
            return read_batch(self.run_command, wanted)

    @contextmanager
    def _reading(self):
        """Reads one at a time; a host that could not be read once is not tried again."""
        with self._lock:
            if self._unreachable:
                raise Unreachable(self._unreachable)
            try:
                yield
            except Exception as error:
                self._unreachable = f"{UNREACHABLE} {self.name} ({self.backend}): {error}"
                raise Unreachable(self._unreachable) from None

    def _read_missing(self, groups) -> None:
        missing = [group for group in in_order(groups) if group not in self._readings.groups]
        needed = in_order(need for group in missing for need in NEEDS.get(group, ())
                          if need not in self._readings.groups)
        for wave in (needed, [group for group in missing if group not in needed]):
            if wave:
                read_groups(self._readings, self.settings, wave, lambda wanted: read_batch(self.run_command, wanted))

    def judge(self, name: str, *args) -> Outcome:
        """The outcome of one check of servestack/checks/catalogue.py on this host."""
        check = CHECKS_BY_NAME[name]
        return check.outcome(self.settings, self.read(*check.groups), *args)

    def check(self, name: str, *args) -> Outcome:
        """Judge a check and report it to pytest: fail or skip with the check's own words."""
        import pytest

        __tracebackhide__ = True  # pytest reports the test's line, not this one

        try:
            outcome = self.judge(name, *args)
        except Unreachable as error:
            pytest.fail(str(error), pytrace=False)
        if outcome.status == FAILED:
            pytest.fail(outcome.detail, pytrace=False)
        if outcome.status == SKIPPED:
            pytest.skip(outcome.detail)
        return outcome


def _settings(name: str, data: dict) -> Settings:
    return settings_from_data(name, data)


def targets_from_inventory(path: str | Path, limit: Iterable[str] | None = None, override_data: dict | None = None, *,
                           action: str = "verify", local: bool = True) -> list[Target]:
    """A Target per inventory host in the limit; every host's settings validated first.

    Every problem of every host is raised at once (ConfigError: "<path>: cannot <action>: ...").
    `local=False` also refuses the hosts servestack does not target unless told to (this machine,
    servestack/targets.py); placeholders of the example inventory are always refused."""
    hosts = limited(load_inventory(path, override_data), limit or ())
    settings, found = inventory_problems(hosts)
    problems, targets = [line for _index, line in found], []
    refused = {hosts[index].name for index, _line in found if index < len(hosts)}
    for host in hosts:
        if host.name in refused or host.name not in settings:
            continue
        address = str(host.data.get("ssh_hostname") or host.name)
        if address.endswith(PLACEHOLDER_SUFFIX):
            problems.append(f"host {host.name}: '{address}' is a placeholder from the example inventory: "
                            "edit inventory.py")
            continue
        if not local and (problem := target_problem(host)):
            problems.append(f"host {host.name}: {problem}")
            continue
        try:
            targets.append(target_for(host, settings[host.name]))
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError(f"{path}: cannot {action}:\n" + "\n".join(problems))
    return targets


def target_for(host, settings: Settings) -> Target:
    """The Target reaching an inventory host as pyinfra would (its connector's testinfra backend);
    ConfigError for a connector the reports cannot use."""
    backend = backend_for(host)
    return Target(host.name, settings, backend.connect, backend.describe())


def targets_from_testinfra(hostspecs: list[str], data: dict | None = None, **options) -> list[Target]:
    """A Target per testinfra --hosts entry, expectations from the manifest and `data` (--host-data)."""
    import testinfra

    targets = []
    for host in testinfra.get_hosts(hostspecs, **options):
        name = host.backend.get_pytest_id()
        targets.append(Target(name, _settings(name, dict(data or {})), _connected(host), name))
    return targets


def _connected(host: Any) -> Callable[[], Any]:
    """A Target's `connect` for a testinfra host made already."""
    return lambda: host


def prefetch(plan: dict[Target, set[str]], workers: int = PREFETCH_WORKERS) -> None:
    """Read each target's groups, hosts in parallel (a fleet takes about as long as one host).

    Errors are left for the tests, which hit them again and report them per host.
    """
    def load(target: Target, groups: set[str]) -> None:
        try:
            target.read(*groups)
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(plan)))) as pool:
        for future in [pool.submit(load, target, groups) for target, groups in plan.items()]:
            future.result()


def read_all(targets: list[Target], wanted: Callable[[Target], list], workers: int = PREFETCH_WORKERS) -> dict:
    """{target name: the values of `wanted(target)`'s fact requests (`Target.read_facts`), or the
    Unreachable saying why that host could not be read}, hosts read in parallel, in the targets' order."""
    def load(target: Target):
        try:
            return target.read_facts(wanted(target))
        except Unreachable as error:
            return error

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(targets)))) as pool:
        futures = {target.name: pool.submit(load, target) for target in targets}
        return {name: future.result() for name, future in futures.items()}


def parse_host_data(items: Iterable[str]) -> dict:
    """KEY=VALUE overrides, parsed as pyinfra's --data parses them."""
    parse_cli_arg = import_pyinfra_cli().util.parse_cli_arg
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
        if row.get(host, ("",))[0] != FAILED:  # a teardown report never hides a failure
            row[host] = (status, detail)

    def unreachable_only(self) -> bool:
        """Whether every failure is a host that could not be read (no check failed on a host that was)."""
        failures = [detail for row in self.cells.values() for status, detail in row.values() if status == FAILED]
        return bool(failures) and all(detail.startswith(UNREACHABLE) for detail in failures)

    def unreachable(self) -> dict[str, tuple[str, int]]:
        """Each host that could not be read: why (its first such failure) and how many checks it failed so."""
        found: dict[str, tuple[str, int]] = {}
        for row in self.cells.values():
            for host, (status, detail) in row.items():
                if status == FAILED and detail.startswith(UNREACHABLE):
                    first, count = found.get(host, (detail, 0))
                    found[host] = (first, count + 1)
        return found

    def counts(self) -> dict[str, int]:
        """Checks passed, failed and skipped; a check not run on a host that could not be read is none of them."""
        totals = {PASSED: 0, FAILED: 0, SKIPPED: 0}
        for row in self.cells.values():
            for status, detail in row.values():
                if not (status == FAILED and detail.startswith(UNREACHABLE)):
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
            status = {"passed": PASSED, "failed": FAILED, "skipped": SKIPPED}[report.outcome]
            detail = "" if status == PASSED else _report_detail(report)
            self.results.add(properties["servestack_check"], properties["servestack_host"], status, detail)


def _catalogue_order(check: str) -> int:
    """Rows in the order of servestack/checks/catalogue.py (GPU, toolkit, release, service); a
    check's rows per subject (package_version[torch], ...) in the order they ran (the manifest's)."""
    names = [known.name for known in CHECKS]
    base = base_name(check)
    return names.index(base) if base in names else len(names)


_CELLS = {PASSED: ("pass", "green"), FAILED: ("FAIL", "bold red"), SKIPPED: ("skip", "yellow")}
_STATUS_STYLES = {FAILED: "red", SKIPPED: "yellow"}


def report_console(file=None, **options):
    """The Console a report prints on: the terminal's width on a terminal; otherwise (CI logs,
    pipes, files) UNCUT_WIDTH, so that every table cell and every reason is printed whole, each
    reason on one line."""
    from rich.console import Console

    console = Console(file=file, **options)
    if console.is_terminal:
        return console
    return Console(file=file, width=UNCUT_WIDTH, **options)


def render(results: Results, console) -> None:
    """The table (a row per check, named with its subject: `package_version[torch]`; a column per
    host), then every failure and skip with its whole reason, then the totals.

    Names and reasons are printed as text, never as rich markup (`[torch]` is not a style)."""
    from rich.table import Table
    from rich.text import Text

    rows = sorted(results.cells.items(), key=lambda item: _catalogue_order(item[0]))
    if rows:
        table = Table(title="servestack verify", show_lines=False)
        table.add_column("check", overflow="fold")
        for host in results.hosts:
            table.add_column(Text(host), justify="center", overflow="fold")
        for check, row in rows:
            table.add_row(Text(check), *[Text(*_CELLS[row[host][0]]) if host in row else Text("")
                                         for host in results.hosts])
        console.print(table)
    unreachable = results.unreachable()
    for host, (detail, checks) in unreachable.items():   # one line per host, not one per check it could not run
        console.print(Text.assemble(("unreachable", "bold red"), f" {host}: ", detail, f" ({checks} checks not run)"))
    for check, row in rows:
        for host, (status, detail) in row.items():
            if status != PASSED and not (status == FAILED and detail.startswith(UNREACHABLE)):
                console.print(Text.assemble((status, _STATUS_STYLES[status]), f" {host} {check}: ", detail))
    totals = results.counts()
    console.print(Text(f"{totals[PASSED]} passed, {totals[FAILED]} failed, {totals[SKIPPED]} skipped on "
                       f"{len(results.hosts)} host(s)" + ("" if rows else ": no check ran")
                       + (f"; {len(unreachable)} could not be reached" if unreachable else "")))


def verify_main(inventory: str, limit: Iterable[str] | None = None, junit: str | None = None,
                extra_args: Iterable[str] = ()) -> int:
    """`servestack verify`: run tests/verify against the inventory, print the per-host table.

    Returns the contract's exit status (servestack/errors.py): 0 every check passed or was skipped
    with its reason, 1 a check failed, 3 only hosts that could not be read failed; bad input is
    refused here, before pytest runs (ConfigError).
    """
    import pytest

    limit = list(limit or ())
    if not targets_from_inventory(inventory, limit):  # bad input fails here, with servestack's message
        raise ConfigError(f"{inventory}: cannot verify: the inventory has no hosts")
    args = [str(VERIFY_TESTS), "--inventory", str(inventory), "-q", "--tb=no", "-rN", "-p", "no:cacheprovider",
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args += [f"--limit={pattern}" for pattern in limit]
    if junit:
        args.append(f"--junitxml={junit}")
    collector = ResultsCollector()
    status = pytest.main(args + list(extra_args), plugins=[collector])
    render(collector.results, report_console())
    return contract_status(int(status), collector.results)


def contract_status(pytest_status: int, results: Results) -> int:
    """pytest's exit status (pytest.ExitCode) as the contract's (servestack/errors.py): its internal error
    (3, a bug, shown by pytest) is a failed run, not the contract's 3 (unreachable)."""
    if pytest_status == 0:
        return EXIT_OK
    if pytest_status == 1:  # TESTS_FAILED
        return EXIT_UNREACHABLE if results.unreachable_only() else EXIT_FAILED
    return {2: EXIT_INTERRUPTED, 4: EXIT_BAD_INPUT}.get(pytest_status, EXIT_FAILED)
