"""TCP_NODELAY on pyinfra's SSH connections (called from config.py, so every pyinfra run has it).

Neither pyinfra 3.10 nor paramiko 4.0 sets TCP_NODELAY. Each remote command is a few small SSH
packets (channel open, exec request, window adjust, close), and Nagle's algorithm holds a small
packet back until the previous one is acknowledged, which the host's delayed ACK postpones by up to
40 ms: measured on sandbox hosts, ~48 ms per command without it, ~6.5 ms with it, and connecting
takes 36 ms instead of 80 ms (measured in the project notes on pyinfra). OpenSSH sets it on
interactive sessions for the same reason. Connections through a ProxyCommand (not a TCP socket)
are left alone.
"""

from __future__ import annotations

import socket

from pyinfra.connectors.ssh import SSHConnector

_MARK = "_servestack_tcp_nodelay"


def set_tcp_nodelay(client) -> bool:
    """Set TCP_NODELAY on a connected paramiko client's socket; False when it has no TCP socket."""
    transport = client.get_transport() if client is not None else None
    sock = getattr(transport, "sock", None)
    if not isinstance(sock, socket.socket) or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return True


def enable_tcp_nodelay() -> None:
    """Make every SSHConnector connection set TCP_NODELAY once connected (idempotent)."""
    if getattr(SSHConnector._connect, _MARK, False):
        return
    connect = SSHConnector._connect

    def _connect(self) -> None:
        connect(self)
        set_tcp_nodelay(self.client)

    setattr(_connect, _MARK, True)
    SSHConnector._connect = _connect
