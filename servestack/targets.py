"""Refuse inventories that would silently act on the machine running pyinfra."""

import ipaddress
import socket

from servestack.errors import ConfigError

PLACEHOLDER_SUFFIX = ".example"
REFUSAL = "refusing to run (nothing was changed on any host):"


def _is_local_address(name: str) -> bool:
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def target_problem(host) -> str | None:
    """Why this host must not be targeted as given, or None."""
    if host.data.get("servestack_allow_local"):
        return None
    if host.name.startswith("@local"):
        return ("targets this machine (@local); set servestack_allow_local = True in its host data "
                "if that is really meant")
    address = host.data.get("ssh_hostname") or host.name
    if _is_local_address(str(address)):
        return (f"'{address}' is this machine; set servestack_allow_local = True in its host data "
                "if that is really meant")
    if str(address).endswith(PLACEHOLDER_SUFFIX):
        return f"'{address}' is a placeholder from the example inventory: edit inventory.py"
    return None


def target_problems(inventory) -> list[tuple[int, str]]:
    """(host index, line) for each host that must not be targeted as given."""
    return [(index, f"host {host.name}: {problem}") for index, host in enumerate(inventory)
            if (problem := target_problem(host))]


def refuse_local_targets(inventory) -> None:
    problems = target_problems(list(inventory))
    if problems:
        raise ConfigError(REFUSAL + "\n" + "\n".join(line for _index, line in problems))
