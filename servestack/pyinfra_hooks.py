"""Every place servestack reaches into pyinfra or paramiko beyond their public API, and why.

Nothing else in the tree touches a private (`_name`) attribute of pyinfra or paramiko; each entry
here has a test in tests/unit/test_pyinfra_hooks.py that fails when pyinfra changes under it.

1. `enable_tcp_nodelay`: wraps `SSHConnector._connect` to set TCP_NODELAY on paramiko's socket.
   Neither pyinfra nor paramiko sets it, and Nagle's algorithm with the host's delayed ACK holds
   each remote command's small packets back by up to 40 ms.
2. `validate_after_inventory_load`: wraps `state.init` on the CLI's State (pyinfra has no hook
   between loading the inventory and connecting), so that bad host data stops the run before any
   connection.
3. `index_deploy_file`: registers the deploy file as a module, so that `inspect`'s file -> module
   lookup (pyinfra orders operations by their call stacks) finds it instead of scanning every
   loaded module for each frame.
4. `MISSING_COMMAND_MARKER`: pyinfra's `_MISSING_COMMAND_MARKER`, what a fact's `requires_command`
   guard prints; facts/batch.py guards facts in a batch the same way.
5. `inner`: an operation's `_inner`, pyinfra's documented way to compose operations
   (`yield from files.directory._inner(...)`).
6. `import_pyinfra_cli`: pyinfra's CLI package (its inventory loader and errors) imported without
   the gevent monkey-patching its import performs. The `pyinfra` command needs that patching;
   servestack's own commands and the tests do not, and patched, `os.close` hands directory and
   pipe fds to a gevent hub that never runs here: every `shutil.rmtree` leaks one fd per
   directory (a test session hit EMFILE).
7. `cli_argument`: an argument or option of the running `pyinfra` command (its inventory, its `--limit`
   patterns), from click's current context: pyinfra's CLI is a click command (pyinfra_cli/cli.py) and
   config.py runs inside it. The CLI keeps only the hosts the patterns matched and warns without stopping
   when one matches none; it reads an inventory argument that names no file as a module or host name, and
   looks that name up in DNS.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import types

import click
from pyinfra.api import facts as _pyinfra_facts
from pyinfra.connectors.ssh import SSHConnector

MISSING_COMMAND_MARKER: str = _pyinfra_facts._MISSING_COMMAND_MARKER
_MARK = "servestack_tcp_nodelay"


def set_tcp_nodelay(client) -> bool:
    """Set TCP_NODELAY on a connected paramiko client's socket; False when it has no TCP socket
    (a ProxyCommand connection)."""
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
    setattr(SSHConnector, "_connect", _connect)


def validate_after_inventory_load(state, validate, before_init=None) -> None:
    """Call `validate(state)` as soon as pyinfra's CLI has initialised `state` with the inventory,
    right before it connects (the bound `state.init` is wrapped on this one object); `before_init(inventory)`,
    when given, runs first: State.init sets up each host's connector and stops at the first bad value."""
    original_init = state.init

    def init_then_validate(inventory, config, **kwargs):
        if before_init is not None:
            before_init(inventory)
        original_init(inventory, config, **kwargs)
        validate(state)

    state.init = init_then_validate


def index_deploy_file(path: str) -> str:
    """Register `path` (a file pyinfra executes) as a module of that file (idempotent); its name."""
    absolute = os.path.abspath(path)
    name = "servestack._deploy_file_" + hashlib.sha256(absolute.encode()).hexdigest()[:12]
    if name not in sys.modules:
        module = types.ModuleType(name, f"stands for {absolute} in inspect's file -> module cache")
        module.__file__ = absolute
        sys.modules[name] = module
    return name


def inner(operation):
    """The generator function behind a pyinfra operation, to `yield from` inside another operation."""
    return operation._inner


def import_pyinfra_cli():
    """`pyinfra_cli` with `.exceptions`, `.inventory` and `.util` loaded, gevent left unpatched."""
    if "pyinfra_cli" not in sys.modules:
        from gevent import monkey

        patch_all = monkey.patch_all
        monkey.patch_all = lambda *args, **kwargs: None
        try:
            import pyinfra_cli  # noqa: F401
        finally:
            monkey.patch_all = patch_all
    import pyinfra_cli.exceptions
    import pyinfra_cli.inventory
    import pyinfra_cli.util
    return pyinfra_cli


def cli_argument(name: str):
    """The value of the running `pyinfra` command's argument or option `name` (None outside it)."""
    context = click.get_current_context(silent=True)
    return context.params.get(name) if context is not None else None
