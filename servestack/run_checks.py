"""The checks a servestack deploy or rollback makes before it touches any host, wherever pyinfra runs from.

pyinfra loads `config.py` from the directory it runs in, and from nowhere else (pyinfra_cli/cli.py
`_set_config`: `Path(state.cwd) / config_filename`, skipped when that file does not exist). In the
project's directory, config.py calls `before_connecting`: bad input (the inventory file, the manifest,
every targeted host's data, the guard against this machine, a prompt with standard input closed)
stops the run before any connection, and the run gets its recap.

Run from another directory (`proj/.venv/bin/pyinfra fleet/hosts.py proj/deploy.py`), pyinfra never
reads config.py. deploy.py and rollback.py then call `after_connecting` first: the same checks, once
per run, after pyinfra has connected and before any host is read or changed, with a line saying how
to have them run before connecting.
"""

from __future__ import annotations

import os
import sys
from weakref import WeakSet

from pyinfra import logger
from pyinfra_cli.exceptions import CliError

from servestack import runreport
from servestack.errors import ConfigError
from servestack.fleet import group_data_of, load_inventory, unused_group_data
from servestack.manifest import PROJECT_ROOT
from servestack.preconnect import inventory_file_problem, validate_connection_data, validate_targets
from servestack.pyinfra_hooks import cli_argument, enable_tcp_nodelay, validate_after_inventory_load

_CHECKED: "WeakSet" = WeakSet()   # the States whose run was checked

NOT_FROM_PROJECT = (f"pyinfra did not load servestack's config.py (it reads config.py from the current directory "
                    f"only): the inventory was checked after connecting. To check it before connecting, run "
                    f"pyinfra in {PROJECT_ROOT}, or pass --config {PROJECT_ROOT / 'config.py'}")


def check_run(state) -> None:
    """Every check of the run's input; raises ConfigError. Then follows the run for its recap."""
    say_group_data(state, dry=bool(cli_argument("dry")))
    validate_targets(state)
    problem = runreport.prompt_problem(sys.argv)
    if problem:
        raise ConfigError(problem)
    runreport.install(state)
    _CHECKED.add(state)


def say_group_data(state, dry: bool) -> None:
    """In a dry run, say which group data applied to each targeted host, and warn of group data that applies
    to no host: a renamed group list drops its data file without a word (pyinfra loads group_data/ from the
    inventory's folder and the current one, for any group name)."""
    if not dry:
        return
    for line in unused_group_data(state.inventory):
        logger.warning(line)
    for host in state.inventory:
        if state.is_host_in_limit(host):
            groups = group_data_of(host)
            logger.info(f"    [{host.name}] " + (f"group data: {', '.join(groups)}" if groups else "no group data"))


def _inventory_read(inventory) -> None:
    """Before pyinfra sets up the hosts' connections: connection data it would stop at naming no host."""
    try:
        validate_connection_data(inventory)
    except ConfigError as error:
        raise CliError(str(error)) from None


def _inventory_loaded(state) -> None:
    """A refusal is shown as the CLI's own errors are (`--> pyinfra error: ...`), not as an error
    raised at a line of servestack's code."""
    try:
        check_run(state)
    except ConfigError as error:
        raise CliError(str(error)) from None


def before_connecting(state) -> None:
    """config.py: refuse a missing or broken inventory file now, check the rest once pyinfra has loaded it."""
    unusable = inventory_file_problem(cli_argument("inventory")) or broken_inventory(cli_argument("inventory"))
    if unusable:   # shown as the CLI shows its own errors: an error raised here would name this line
        CliError(unusable).show()
        sys.exit(1)
    validate_after_inventory_load(state, _inventory_loaded, before_init=_inventory_read)
    enable_tcp_nodelay()


def broken_inventory(inventory: str | None) -> str | None:
    """One line for an inventory file (or its group data) that fails to load: pyinfra would print "An internal
    exception occurred", a traceback, and write pyinfra-debug.log. The file is loaded as every servestack
    command loads it; pyinfra then loads it again (an inventory is data: loading it twice changes nothing)."""
    if not inventory or not os.path.isfile(inventory):
        return None   # not a file: host names, or a missing file inventory_file_problem named
    try:
        load_inventory(inventory)
    except ConfigError as error:
        return str(error)
    return None


def after_connecting(state) -> None:
    """deploy.py and rollback.py, first: the run's checks, when config.py did not make them. A refusal
    ends the run here (exit 1, pyinfra's own for its errors), before any host is read or changed."""
    if state in _CHECKED:
        return
    logger.warning(NOT_FROM_PROJECT)
    try:
        check_run(state)
    except ConfigError as error:
        CliError(str(error)).show()
        sys.exit(1)
