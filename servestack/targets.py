"""Refuse inventories that would silently act on the machine running pyinfra."""

import ipaddress
import socket

from servestack.errors import ConfigError

PLACEHOLDER_SUFFIX = ".example"
REFUSAL = "refusing to run (nothing was changed on any host):"
HOSTS_FILE = "/etc/hosts"
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _address(text: str):
    """`text` as an IP address, in every form the resolver takes for one (127.1, 2130706433,
    0x7f.0.0.1, ::ffff:127.0.0.1 as its IPv4 address), else None. No lookup is made."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(text))
        except (OSError, ValueError):
            return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _hosts_file_addresses(name: str, path: str = HOSTS_FILE) -> list:
    """The addresses /etc/hosts gives `name` (read here: no lookup goes over the network)."""
    found = []
    try:
        with open(path, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                address, *names = line.split("#", 1)[0].split() or [""]
                if name in (entry.lower() for entry in names) and (parsed := _address(address)):
                    found.append(parsed)
    except OSError:
        pass
    return found


def is_this_machine(name: str, hosts_file: str = HOSTS_FILE) -> bool:
    """Whether `name` (a host name or address, as in ssh_hostname) is this machine: a loopback or
    unspecified address in any spelling, a local name, this machine's host name, or a name
    /etc/hosts maps to such an address."""
    name = name.strip().lower().rstrip(".")
    own = socket.gethostname().lower()
    if name in LOCAL_NAMES or name.endswith(".localhost") or name in (own, own.split(".")[0]):
        return True
    address = _address(name)
    addresses = [address] if address else _hosts_file_addresses(name, hosts_file)
    return any(found.is_loopback or found.is_unspecified for found in addresses)


def target_problem(host) -> str | None:
    """Why this host must not be targeted as given, or None."""
    if host.data.get("servestack_allow_local"):
        return None
    if host.name.startswith("@local"):
        return ("targets this machine (@local); set servestack_allow_local = True in its host data "
                "if that is really meant")
    address = host.data.get("ssh_hostname") or host.name
    if is_this_machine(str(address)):
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
