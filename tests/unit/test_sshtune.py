"""servestack/sshtune.py: what config.py does to every pyinfra SSH connection, checked on a real
SSH handshake over loopback TCP (paramiko's own server offering OpenSSH's cipher order)."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager

import paramiko
import pytest
from paramiko import Transport

from servestack import sshtune

# OpenSSH 9's default server order, less chacha20-poly1305 (which paramiko lacks)
OPENSSH_ORDER = ("aes128-ctr", "aes192-ctr", "aes256-ctr", "aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


class _AcceptAnyKey(paramiko.ServerInterface):
    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL


@pytest.fixture
def preferred_ciphers():
    saved = Transport._preferred_ciphers
    yield
    Transport._preferred_ciphers = saved


@contextmanager
def handshake():
    """A paramiko client connected to a paramiko server that offers OpenSSH's order (closed after)."""
    listener = socket.create_server(("127.0.0.1", 0))
    host_key, client_key = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    server: dict = {}

    def serve():
        conn, _ = listener.accept()
        transport = Transport(conn)
        transport.get_security_options().ciphers = OPENSSH_ORDER
        transport.add_server_key(host_key)
        transport.start_server(server=_AcceptAnyKey())
        server["transport"] = transport

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect("127.0.0.1", listener.getsockname()[1], username="u", pkey=client_key,
                   allow_agent=False, look_for_keys=False)
    thread.join(10)
    listener.close()
    try:
        yield client
    finally:
        client.close()
        server["transport"].close()


def test_the_client_agrees_on_aes_gcm_with_an_openssh_order_server(preferred_ciphers):
    before = Transport._preferred_ciphers
    order = sshtune.prefer_aes_gcm()
    assert order[:2] == sshtune.AEAD_CIPHERS and sorted(order) == sorted(before)
    assert sshtune.prefer_aes_gcm() == order  # idempotent
    with handshake() as client:
        assert client.get_transport().local_cipher == "aes128-gcm@openssh.com"


def test_without_it_paramiko_would_pick_aes_ctr_with_an_hmac(preferred_ciphers):
    with handshake() as client:
        assert client.get_transport().local_cipher == "aes128-ctr"


def test_tcp_nodelay_is_set_on_the_connection(preferred_ciphers):
    with handshake() as client:
        sock = client.get_transport().sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        assert sshtune.set_tcp_nodelay(client)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    assert not sshtune.set_tcp_nodelay(None)
