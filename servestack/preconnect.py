"""Validate the inventory the moment pyinfra has loaded it, before any host connects
(config.py hooks `validate_targets` there: servestack/pyinfra_hooks.py).

Everything that can be refused without a connection is refused here, in one message, one line per
problem, every host's problems at once: the manifest, the host data (types, strict keys,
consistency), the secrets `service_secret_env` names (they must be set in this machine's
environment, which the secrets file is written from), targets that would act on this machine, and
a `rollout_batch` that differs between the targeted hosts (pyinfra runs an operation's batches with one
`_parallel` for all its hosts, and stops a run whose hosts give two with an error naming neither).
"""

import os
from pathlib import Path
from typing import get_type_hints

from pyinfra.api.exceptions import ConnectorDataTypeError
from pyinfra.api.util import raise_if_bad_type

from servestack.errors import ConfigError
from servestack.fleet import limit_problems
from servestack.pyinfra_hooks import cli_argument
from servestack.settings import check_inventory, secret_problems
from servestack.targets import REFUSAL, target_problems


PASSWORD_REFUSAL = ("'ssh_password': servestack's reports (status, verify, backups, bench) reach hosts with OpenSSH "
                    "in batch mode, which cannot use a password: give the host an ssh_key (and remove ssh_password)")


def connection_problems(host) -> list[str]:
    """What in the host's connection data no command can use: a value of a key of its pyinfra connector
    of the wrong type (pyinfra's own check, which the deploy meets when it sets up the connection:
    `ssh_port: "9"` is no int there either), and `ssh_password`, which servestack's reports cannot use."""
    data = host.data.dict()
    connector = getattr(host, "connector_cls", None)  # None: a stand-in for a host, without one
    hints = get_type_hints(connector.data_cls) if connector is not None else {}
    problems = []
    for key, expected in hints.items():
        if key in data:
            try:
                raise_if_bad_type(data[key], expected, ConnectorDataTypeError, key)
            except ConnectorDataTypeError:
                problems.append(f"host {host.name}: '{key}': pyinfra's {getattr(connector, '__name__', '')} expects "
                                f"{_type_name(expected)}, got {data[key]!r}")
    if data.get("ssh_password"):
        problems.append(f"host {host.name}: {PASSWORD_REFUSAL}")
    return problems


def _type_name(expected) -> str:
    return getattr(expected, "__name__", None) or str(expected)


def inventory_problems(hosts) -> tuple[dict, list[tuple[int, str]]]:
    """The one validation of an inventory's host data, for the deploy and every servestack command: the
    valid hosts' settings, and one (host index, line) per problem, in inventory order."""
    settings, problems = check_inventory(hosts)
    problems += [(index, line) for index, host in enumerate(hosts) for line in connection_problems(host)]
    problems.sort(key=lambda item: item[0])
    return settings, problems


def targets_problems(hosts, environ=None) -> list[str]:
    """Every line `validate_targets` refuses `hosts` with, in inventory order (none: they may run)."""
    settings, problems = inventory_problems(hosts)
    for index, host in enumerate(hosts):
        problems += [(index, line) for line in secret_problems(host.name, host.data.dict(), environ)]
    problems += target_problems(hosts)
    problems += [(len(hosts), line) for line in rollout_problems(hosts, settings)]
    problems.sort(key=lambda item: item[0])  # stable: each host's lines stay in that order
    return [line for _index, line in problems]


def rollout_problems(hosts, settings: dict) -> list[str]:
    """The targeted hosts restart as one roll-out, `rollout_batch` hosts at a time: one value for all."""
    by_value: dict[int, list[str]] = {}
    for host in hosts:
        if host.name in settings:
            by_value.setdefault(settings[host.name].rollout_batch, []).append(host.name)
    if len(by_value) <= 1:
        return []
    found = "; ".join(f"{value} on {_names(names)}" for value, names in sorted(by_value.items()))
    return [f"'rollout_batch': the hosts of one run restart as one roll-out and need the same value, got {found} "
            "(set it once for them all, e.g. in group_data/all.py, or --limit the run to hosts that share one)"]


def _names(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def validate_targets(state, environ=None) -> None:
    """Refuse the run, naming every problem of every host in its limit, before any connection; a
    --limit pattern that matches no host (pyinfra only warns, and runs on what the others matched);
    and a run with no host at all (an empty or misspelled inventory), which would otherwise do
    nothing and succeed: an emergency rollback with a typo must not report success."""
    if not list(state.inventory):
        raise ConfigError(f"{REFUSAL}\nno host to run on: the inventory has no hosts")
    limit_refusals = limit_problems(state.inventory, cli_argument("limit") or ())
    if limit_refusals:
        raise ConfigError(REFUSAL + "\n" + "\n".join(limit_refusals))
    hosts = [host for host in state.inventory if state.is_host_in_limit(host)]
    if not hosts:
        names = ", ".join(host.name for host in state.inventory)
        raise ConfigError(f"{REFUSAL}\nno host to run on: the --limit and --exclude given leave none of the "
                          f"inventory's hosts ({names})")
    problems = targets_problems(hosts, environ)
    if problems:
        raise ConfigError(REFUSAL + "\n" + "\n".join(problems))


def validate_connection_data(inventory) -> None:
    """Refuse, naming each host and key, the connection data pyinfra's State.init would stop at with an
    error naming neither (`Invalid connector data `ssh_port``): to be called before State.init."""
    problems = [line for host in inventory for line in connection_problems(host)]
    if problems:
        raise ConfigError(REFUSAL + "\n" + "\n".join(problems))


def inventory_file_problem(inventory: str | None) -> str | None:
    """Why the pyinfra command's inventory argument cannot be read, before pyinfra tries: a path (a name
    with a slash, or ending in .py) that is no file is a misspelled inventory file, which pyinfra would
    read as a module or host name, look up in DNS, and run on no host."""
    is_path = inventory is not None and ("/" in inventory or inventory.endswith(".py"))
    if inventory and is_path and not Path(inventory).is_file():
        return f"{inventory}: inventory file not found (in {os.getcwd()})"
    return None
