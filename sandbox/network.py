"""Network namespaces and addressing for sandbox hosts.

Topology: one controller namespace plus one namespace per host, each host
joined to the controller by a veth pair on its own /30 taken from the RFC 2544
benchmark range 198.18.0.0/15. No namespace gets a default route, and no
forwarding or NAT is set up, so traffic only flows between the controller and
each host. Addresses are checked against the machine's own routes, addresses
and resolvers before use.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

POOL = IPv4Network("198.18.0.0/15")
SUBNET_PREFIX = 30
#: Interface name of a host's end of its veth pair, inside the host namespace.
HOST_IFNAME = "eth0"
NETNS_DIR = Path("/run/netns")


class AddressCollision(RuntimeError):
    """The benchmark range cannot be used without clashing with the machine's network."""


@dataclass(frozen=True)
class UsedNetwork:
    """A network the machine already uses, and where it was seen."""

    network: IPv4Network
    source: str


@dataclass(frozen=True)
class Link:
    """Addresses of one controller<->host veth pair."""

    subnet: IPv4Network

    @property
    def controller(self) -> IPv4Address:
        """The controller's address on this pair: hosts reach the controller here."""
        return self.subnet.network_address + 1

    @property
    def host(self) -> IPv4Address:
        """The host's address."""
        return self.subnet.network_address + 2


def parse_routes(ip_json: str) -> list[UsedNetwork]:
    """Networks from `ip -j -4 route show table all` output (default routes skipped)."""
    used = []
    for route in json.loads(ip_json or "[]"):
        if route.get("dst", "default") == "default":
            continue
        text = f"route {route['dst']}" + (f" dev {route['dev']}" if "dev" in route else "")
        used.append(UsedNetwork(IPv4Network(route["dst"], strict=False), text))
    return used


def parse_addresses(ip_json: str) -> list[UsedNetwork]:
    """Networks of addresses from `ip -j -4 addr` output."""
    used = []
    for link in json.loads(ip_json or "[]"):
        for info in link.get("addr_info", []):
            if info.get("family", "inet") != "inet":
                continue
            cidr = f"{info['local']}/{info['prefixlen']}"
            used.append(UsedNetwork(IPv4Network(cidr, strict=False), f"address {cidr} on {link.get('ifname')}"))
    return used


def parse_resolvers(resolv_conf: str) -> list[UsedNetwork]:
    """IPv4 nameservers of a resolv.conf, as /32 networks."""
    used = []
    for match in re.finditer(r"^\s*nameserver\s+(\S+)", resolv_conf, re.MULTILINE):
        try:
            address = ipaddress.ip_address(match.group(1))
        except ValueError:
            continue
        if address.version == 4:
            used.append(UsedNetwork(IPv4Network(address), f"nameserver {address} in /etc/resolv.conf"))
    return used


def machine_networks() -> list[UsedNetwork]:
    """Everything the machine's own network namespace routes to, owns or resolves through."""
    routes = _ip("-j", "-4", "route", "show", "table", "all")
    addresses = _ip("-j", "-4", "addr")
    resolv = Path("/etc/resolv.conf")
    resolvers = resolv.read_text() if resolv.exists() else ""
    return parse_routes(routes) + parse_addresses(addresses) + parse_resolvers(resolvers)


def choose_links(count: int, used: Iterable[UsedNetwork], pool: IPv4Network = POOL) -> list[Link]:
    """Pick `count` /30 subnets from `pool` that overlap nothing in `used`.

    Raises AddressCollision naming the clashing entries when the pool cannot
    supply enough subnets.
    """
    clashing = [entry for entry in used if entry.network.overlaps(pool)]
    links: list[Link] = []
    for subnet in pool.subnets(new_prefix=SUBNET_PREFIX):
        if len(links) == count:
            break
        if not any(entry.network.overlaps(subnet) for entry in clashing):
            links.append(Link(subnet))
    if len(links) < count:
        seen = "; ".join(entry.source for entry in clashing) or "nothing"
        raise AddressCollision(
            f"cannot place {count} sandbox hosts in {pool}: only {len(links)} free /{SUBNET_PREFIX} "
            f"subnets; this machine already uses that range ({seen}). Free the range or remove the "
            "conflicting route/address/resolver before starting a sandbox."
        )
    return links


def netns_exists(name: str) -> bool:
    """Whether a named network namespace is registered under /run/netns."""
    return (NETNS_DIR / name).exists()


def create_netns(name: str) -> None:
    """Create a named network namespace with loopback up; fail if the name is taken."""
    if netns_exists(name):
        raise RuntimeError(f"network namespace {name} already exists; it belongs to another sandbox run")
    _ip("netns", "add", name)
    _ip("-n", name, "link", "set", "lo", "up")


def delete_netns(name: str) -> None:
    """Remove a named network namespace (and with it the veth ends inside it)."""
    if netns_exists(name):
        _ip("netns", "delete", name)


def connect(controller_ns: str, controller_ifname: str, host_ns: str, link: Link) -> None:
    """Create the veth pair between the controller and a host, address it and bring it up.

    Both ends are created directly inside their namespaces, so nothing ever
    appears in the machine's own namespace.
    """
    peer = ["peer", "name", HOST_IFNAME, "netns", host_ns]
    _ip("link", "add", controller_ifname, "netns", controller_ns, "type", "veth", *peer)
    prefix = f"/{link.subnet.prefixlen}"
    _ip("-n", controller_ns, "addr", "add", f"{link.controller}{prefix}", "dev", controller_ifname)
    _ip("-n", controller_ns, "link", "set", controller_ifname, "up")
    _ip("-n", host_ns, "addr", "add", f"{link.host}{prefix}", "dev", HOST_IFNAME)
    _ip("-n", host_ns, "link", "set", HOST_IFNAME, "up")


def netns_exec(name: str, argv: list[str]) -> list[str]:
    """Wrap `argv` so that it runs inside network namespace `name`."""
    return ["ip", "netns", "exec", name, *argv]


def _ip(*args: str) -> str:
    """Run `ip ARGS`, returning stdout and raising with ip's message on failure."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout
