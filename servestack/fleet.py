"""The one inventory loader and the one meaning of `--limit`, for every servestack command and the deploy.

`load_inventory` reads an inventory file as the pyinfra CLI does (pyinfra_cli's make_inventory: group data
beside the file and in the working directory). `limited` selects hosts as pyinfra's own `--limit` does
(pyinfra_cli/cli.py `_get_inventory_pattern_matches`): each pattern is a group name, else an fnmatch glob
over host names; the option is repeated for several. pyinfra does not split a pattern on commas and only
warns when one matches nothing, so a typo in one of two names would run on the other alone: servestack
refuses both, before any host is touched (`limit_problems`), in the deploy and in its own commands alike.
"""

from __future__ import annotations

import os
from fnmatch import fnmatch
from traceback import walk_tb
from pathlib import Path
from typing import Iterable

from pyinfra.api import State
from pyinfra.api.exceptions import NoGroupError
from pyinfra.api.inventory import Inventory
from pyinfra.context import ctx_state

from servestack.errors import ConfigError
from servestack.pyinfra_hooks import import_pyinfra_cli

LIMIT_HELP = ("a group name, a host name or a glob (as pyinfra's --limit); repeat --limit for several "
              "(a comma does not separate names)")


def load_inventory(path: str | Path, override_data: dict | None = None) -> Inventory:
    """The inventory file's hosts, group data applied; a missing or broken file is a ConfigError."""
    cli = import_pyinfra_cli()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: inventory file not found")
    # make_inventory executes the inventory's Python, which needs a State in context
    with ctx_state.use(State()):
        try:
            return cli.inventory.make_inventory(str(path), override_data=override_data or None, cwd=os.getcwd())
        except cli.exceptions.CliError as error:
            raise ConfigError(f"{path}: {error}") from None
        except Exception as error:  # noqa: BLE001 - only a file that fails to load is turned into a line
            message = broken_file_message(error)
            if message is None:
                raise
            raise ConfigError(message) from None


def broken_file_message(error: BaseException) -> str | None:
    """One line for an inventory or group-data file that fails to load (a Python error in it,
    wrapped by pyinfra's loader or raised directly): the file, the line and the error; None for
    any other exception (a bug, shown with its traceback)."""
    UnexpectedExternalError = import_pyinfra_cli().exceptions.UnexpectedExternalError
    if isinstance(error, UnexpectedExternalError):
        filename, inner = str(error.filename), error.exception
        frames = walk_tb(getattr(inner, "_traceback", None) or inner.__traceback__)
        lines = [line for frame, line in frames if frame.f_code.co_filename.endswith(os.path.basename(filename))]
        if isinstance(inner, SyntaxError):
            return _syntax_error_message(inner, filename)
        where = f"{filename} line {lines[-1]}" if lines else filename
        return f"{where}: {type(inner).__name__}: {inner}"
    if isinstance(error, SyntaxError):
        return _syntax_error_message(error, error.filename)
    return None


def _syntax_error_message(error: SyntaxError, filename: str | None) -> str:
    where = f"{filename or error.filename} line {error.lineno}" if error.lineno else str(filename or error.filename)
    return f"{where}: {type(error).__name__}: {error.msg}"


def _matches(inventory: Inventory, pattern: str) -> list:
    try:
        return list(inventory.get_group(pattern))
    except NoGroupError:
        return [host for host in inventory if fnmatch(host.name, pattern)]


def limit_problems(inventory: Inventory, patterns: Iterable[str]) -> list[str]:
    """One line per --limit pattern that selects no host (none: every pattern selects some)."""
    problems = []
    for pattern in patterns:
        if _matches(inventory, pattern):
            continue
        if "," in pattern:
            problems.append(f"--limit {pattern}: no group or host of the inventory is named that; a comma does not "
                            f"separate names: give --limit once per name ("
                            + " ".join(f"--limit {name.strip()}" for name in pattern.split(",") if name.strip())
                            + ")")
        else:
            problems.append(f"--limit {pattern}: no group or host of the inventory matches")
    return problems


def limited(inventory: Inventory, patterns: Iterable[str] = ()) -> list:
    """The inventory's hosts that the --limit patterns select, in inventory order (all without one)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    problems = limit_problems(inventory, patterns)
    if problems:
        raise ConfigError("\n".join(problems))
    if not patterns:
        return list(inventory)
    chosen = {host.name for pattern in patterns for host in _matches(inventory, pattern)}
    return [host for host in inventory if host.name in chosen]


def group_data_of(host) -> list[str]:
    """The groups whose data applies to `host`, in the order pyinfra applies it (a later one's value holds):
    "all" (the inventory's own data, group_data/all.py), then the host's groups that have data."""
    inventory = host.inventory
    groups = [group for group in host.groups if inventory.get_group_data(group)]
    return (["all"] if inventory.get_data() else []) + groups


def unused_group_data(inventory: Inventory) -> list[str]:
    """One line per group that has data but no host: pyinfra loads group_data/<group>.py for any name, and
    a group list renamed in the inventory leaves its data file applying to no host, without a word."""
    return [f"group data of '{name}' (group_data/{name}.py) applies to no host: the inventory has no group "
            f"'{name}' (renamed?)" for name, data in inventory.group_data.items()
            if data and name != "all" and not inventory.groups.get(name)]
