"""Refuse inventories that would silently act on the machine running pyinfra."""

import ipaddress
import socket

from servestack.errors import ConfigError

PLACEHOLDER_SUFFIX = ".example"


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


def refuse_local_targets(inventory) -> None:
    problems = [f"host {host.name}: {problem}" for host in inventory
                if (problem := target_problem(host))]
    if problems:
        raise ConfigError("refusing to run (nothing was changed on any host):\n" + "\n".join(problems))
