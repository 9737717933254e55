"""servestack/pyinfra_hooks.py: each place servestack reaches into pyinfra or paramiko beyond their
public API, with a test that fails when pyinfra changes under it.

This is the one test module that names pyinfra's private attributes: it checks that they are
still there and still do what the hooks rely on. SSH is checked on a real handshake over
loopback TCP (paramiko's own server); pyinfra_cli is read as source, not imported (importing it
monkey-patches the whole process with gevent).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import paramiko
import pytest
from paramiko import Transport
from pyinfra import state as state_proxy
from pyinfra.api import Config, FactBase, Inventory, State, operation
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.connect import connect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.connectors.ssh import SSHConnector
from pyinfra.context import ctx_state
from pyinfra.operations import files, server

from facts.batch import FactRequest
from servestack import pyinfra_hooks
from tests.unit.fake_host import fake_state


class _AcceptAnyKey(paramiko.ServerInterface):
    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL


@contextmanager
def ssh_server():
    """A paramiko SSH server on a loopback port accepting one connection with any key: its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    host_key = paramiko.ECDSAKey.generate()
    transports: list = []

    def serve():
        conn, _ = listener.accept()
        transport = Transport(conn)
        transport.add_server_key(host_key)
        transport.start_server(server=_AcceptAnyKey())
        transports.append(transport)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        thread.join(10)
        listener.close()
        for transport in transports:
            transport.close()


@contextmanager
def handshake():
    """A paramiko client connected to a paramiko server over loopback TCP (closed after)."""
    with ssh_server() as port:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect("127.0.0.1", port, username="u", pkey=paramiko.ECDSAKey.generate(),
                       allow_agent=False, look_for_keys=False)
        try:
            yield client
        finally:
            client.close()


def nodelay(client) -> int:
    return client.get_transport().sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


# --- 1. TCP_NODELAY: SSHConnector._connect ---------------------------------------------------------


def test_tcp_nodelay_is_set_on_the_connection():
    with handshake() as client:
        assert nodelay(client) == 0
        assert pyinfra_hooks.set_tcp_nodelay(client)
        assert nodelay(client) != 0
    assert not pyinfra_hooks.set_tcp_nodelay(None)


def test_a_connection_without_a_tcp_socket_is_left_alone():
    """A ProxyCommand connection talks through a pipe, not a TCP socket."""
    one, other = socket.socketpair()
    with one, other:
        client = SimpleNamespace(get_transport=lambda: SimpleNamespace(sock=one))
        assert not pyinfra_hooks.set_tcp_nodelay(client)
        assert not pyinfra_hooks.set_tcp_nodelay(SimpleNamespace(get_transport=lambda: None))


@pytest.fixture
def original_connect(monkeypatch):
    """Put SSHConnector._connect back as it was after the test."""
    monkeypatch.setattr(SSHConnector, "_connect", SSHConnector._connect)
    return SSHConnector._connect


def pyinfra_ssh_connect(tmp_path, port):
    """pyinfra's own SSH connection (connect_all) to the loopback server: the host."""
    key = paramiko.ECDSAKey.generate()
    key.write_private_key_file(str(tmp_path / "key"))
    (tmp_path / "ssh_config").write_text("")
    data = {"ssh_port": port, "ssh_user": "u", "ssh_key": str(tmp_path / "key"),
            "ssh_config_file": str(tmp_path / "ssh_config"),
            "ssh_known_hosts_file": str(tmp_path / "known_hosts"), "ssh_strict_host_key_checking": "no"}
    inventory = Inventory((["127.0.0.1"], data))
    state = State(inventory, Config())
    connect_all(state)
    target = inventory.get_host("127.0.0.1")
    assert target.connected and isinstance(target.connector, SSHConnector)
    return target


def test_pyinfras_ssh_connect_goes_through_the_connect_that_is_wrapped(original_connect, tmp_path):
    """`SSHConnector.connect` calls `_connect`, which leaves paramiko's client in `self.client`:
    wrapped, every pyinfra SSH connection gets TCP_NODELAY."""
    assert callable(SSHConnector._connect) and "self._connect()" in inspect.getsource(SSHConnector.connect)
    pyinfra_hooks.enable_tcp_nodelay()
    wrapped = SSHConnector._connect
    pyinfra_hooks.enable_tcp_nodelay()
    assert SSHConnector._connect is wrapped is not original_connect, "wrapped once"
    with ssh_server() as port:
        target = pyinfra_ssh_connect(tmp_path, port)
        try:
            assert nodelay(target.connector.client) != 0
        finally:
            target.connector.client.close()


def test_without_the_hook_pyinfra_leaves_nagle_on(original_connect, tmp_path):
    with ssh_server() as port:
        target = pyinfra_ssh_connect(tmp_path, port)
        try:
            assert nodelay(target.connector.client) == 0
        finally:
            target.connector.client.close()


# --- 2. validating host data before connecting: State.init ------------------------------------------


def _pyinfra_cli_source() -> ast.Module:
    location = importlib.util.find_spec("pyinfra_cli").submodule_search_locations[0]
    return ast.parse((Path(location) / "cli.py").read_text())


def _function(module: ast.Module, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(module) if isinstance(node, ast.FunctionDef) and node.name == name)


def _calls(function: ast.FunctionDef) -> list[tuple[str, ast.Call]]:
    """The calls in `function`, in source order, named as written (`state.init`, `connect_all`)."""
    found = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    found.sort(key=lambda node: (node.lineno, node.col_offset))
    return [(ast.unparse(node.func), node) for node in found]


def test_the_cli_loads_config_py_then_calls_state_init_then_connects():
    """pyinfra's CLI: makes the State (the one `pyinfra.state` names), execs config.py (which wraps
    `state.init`), loads the inventory and calls `state.init(inventory, config, ...)`, then connects."""
    module = _pyinfra_cli_source()
    calls = _calls(_function(module, "_main"))
    names = [name for name, _ in calls]
    order = [names.index(name) for name in ("_setup_state", "_set_config", "make_inventory", "state.init",
                                            "connect_all")]
    assert order == sorted(order), names
    init = calls[names.index("state.init")][1]
    assert [ast.unparse(arg) for arg in init.args] == ["inventory", "config"]
    assert all(keyword.arg is not None for keyword in init.keywords)   # passed by name: **kwargs
    assert names.count("state.init") == 1
    assert "ctx_state.set" in [name for name, _ in _calls(_function(module, "_setup_state"))]
    assert "exec_file" in [name for name, _ in _calls(_function(module, "_set_config"))]


def test_state_init_takes_the_inventory_and_config_the_wrapper_passes_on():
    parameters = list(inspect.signature(State.init).parameters)
    assert parameters[:3] == ["self", "inventory", "config"]


def test_validation_runs_once_the_state_has_its_inventory():
    seen = []

    def validate(state):
        seen.append((state.initialised, len(state.inventory)))

    state = State()
    with ctx_state.use(state):   # the CLI sets it for the run; config.py wraps `pyinfra.state`
        pyinfra_hooks.validate_after_inventory_load(state_proxy, validate)
        assert seen == []
        state.init(Inventory((["@fake/a", "@fake/b"], {})), Config(), initial_limit=None)
    assert seen == [(True, 2)]


def test_a_validation_that_raises_stops_state_init():
    def refuse(state):
        raise ValueError("bad host data")

    state = State()
    pyinfra_hooks.validate_after_inventory_load(state, refuse)
    with pytest.raises(ValueError, match="bad host data"):
        state.init(Inventory((["@fake/a"], {})), Config())


def test_a_check_before_init_runs_before_pyinfra_sets_up_the_connectors():
    """State.init sets up each host's connector and stops at the first bad value naming no host: the
    check that names the host has to come first."""
    seen = []

    def before_init(inventory):
        seen.append(("before", len(inventory), state.initialised))
        raise ValueError("host a: bad ssh_port")

    state = State()
    pyinfra_hooks.validate_after_inventory_load(state, seen.append, before_init=before_init)
    with pytest.raises(ValueError, match="host a: bad ssh_port"):
        state.init(Inventory((["@fake/a"], {})), Config())
    assert seen == [("before", 1, False)]


# --- 3. the deploy file as a module: inspect's file -> module lookup --------------------------------


def _exec_file(path: Path, source: str, namespace: dict) -> None:
    path.write_text(source)
    exec(compile(source, str(path), "exec"), namespace)   # as pyinfra_cli's exec_file does


def test_an_indexed_deploy_file_is_found_by_inspect(tmp_path):
    path = tmp_path / "deploy.py"
    found: dict = {}
    source = "import inspect\nFOUND['module'] = inspect.getmodule(inspect.currentframe())\n"
    _exec_file(path, source, {"FOUND": found})
    assert found["module"] is None               # unknown: inspect scans every module for it
    name = pyinfra_hooks.index_deploy_file(str(path))
    try:
        assert pyinfra_hooks.index_deploy_file(str(path)) == name   # idempotent
        assert sys.modules[name].__file__ == str(path.resolve())
        _exec_file(path, source, {"FOUND": found})
        assert found["module"] is sys.modules[name]
    finally:
        del sys.modules[name]


def test_pyinfra_orders_operations_by_inspecting_the_deploy_files_frames(tmp_path, monkeypatch):
    """pyinfra's operation order comes from `inspect` frame info, which looks up each frame's module by
    its file: the lookup the index answers."""
    looked_up: list = []
    getmodule = inspect.getmodule

    def recording(obj, _filename=None):
        module = getmodule(obj, _filename)
        looked_up.append((_filename, module))
        return module

    monkeypatch.setattr(inspect, "getmodule", recording)
    path = tmp_path / "deploy_order.py"
    source = ("from pyinfra.api.util import get_operation_order_from_stack\n"
              "ORDER = get_operation_order_from_stack(STATE)\n")
    name = pyinfra_hooks.index_deploy_file(str(path))
    try:
        namespace = {"STATE": State()}
        _exec_file(path, source, namespace)
        assert namespace["ORDER"][-1] == 2       # the line in the deploy file
        assert (str(path), sys.modules[name]) in looked_up
    finally:
        del sys.modules[name]


# --- 4. MISSING_COMMAND_MARKER: what a fact's requires_command guard prints --------------------------


class PrintsMarker(FactBase):
    def command(self, text):
        return f"echo {text}"

    def process(self, output):
        return "processed"

    @staticmethod
    def default():
        return "default"


class NeedsTool(FactBase):
    def command(self, tool):
        return "echo ran"

    def requires_command(self, tool):
        return tool


def test_the_marker_is_pyinfras():
    assert pyinfra_hooks.MISSING_COMMAND_MARKER == pyinfra_facts._MISSING_COMMAND_MARKER
    assert "_MISSING_COMMAND_MARKER" in inspect.getsource(pyinfra_facts._get_fact)


def test_get_fact_reads_exactly_the_marker_as_a_missing_command():
    marker = pyinfra_hooks.MISSING_COMMAND_MARKER
    fake = fake_state({"fake_responses": {"echo marker": [marker], "echo other": ["something"]}})
    target = fake.inventory.get_host("@fake/gpu1")
    assert target.get_fact(PrintsMarker, text="marker") == "default"
    assert target.get_fact(PrintsMarker, text="other") == "processed"


def test_a_batchs_guard_prints_what_pyinfras_own_guard_prints(tmp_path):
    """pyinfra's guard, as its get_fact sends it (recorded by the @fake connector), and the batch's
    guard print the same, tool missing or not."""
    fake = fake_state({})
    target = fake.inventory.get_host("@fake/gpu1")
    for tool, expected in (("no-such-tool-here", [pyinfra_hooks.MISSING_COMMAND_MARKER]), ("sh", ["ran"])):
        target.get_fact(NeedsTool, tool=tool)
        pyinfras = target.connector.executed_commands[-1]
        ours = FactRequest.of(NeedsTool, tool=tool).command()
        outputs = [subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout.splitlines()
                   for command in (pyinfras, ours)]
        assert outputs == [expected, expected], (pyinfras, ours)


# --- 5. inner: an operation's generator function, to `yield from` ----------------------------------


@operation()
def composed(path: str):
    yield from pyinfra_hooks.inner(server.shell)(commands=["echo composed"])
    yield from pyinfra_hooks.inner(files.directory)(path=path)


@operation()
def nested():
    yield from server.shell(commands=["echo nested"])


def test_inner_is_the_generator_function_behind_an_operation():
    assert pyinfra_hooks.inner(server.shell) is server.shell._inner
    assert inspect.isgeneratorfunction(pyinfra_hooks.inner(files.directory))
    assert inspect.isgeneratorfunction(pyinfra_hooks.inner(server.shell))


def test_an_operation_composes_others_through_inner():
    fake = fake_state({})
    target = fake.inventory.get_host("@fake/gpu1")
    add_op(fake, composed, path="/srv/composed")
    run_ops(fake)
    commands = target.connector.executed_commands
    assert "echo composed" in commands
    assert any("mkdir" in command and "/srv/composed" in command for command in commands), commands


def test_calling_an_operation_inside_another_is_refused_by_pyinfra():
    """Why `inner` is needed."""
    fake = fake_state({})
    with pytest.raises(Exception, match="Operation called within another operation"):
        add_op(fake, nested)


# --- 6. import_pyinfra_cli ---------------------------------------------------------------------


def test_the_cli_package_loads_without_patching_this_process_while_its_plain_import_patches():
    """pyinfra_cli's import monkey-patches the process with gevent (the `pyinfra` command needs it):
    import_pyinfra_cli gives the same modules and leaves os, socket and threading alone."""
    import subprocess
    import sys

    probe = ("import gevent.monkey as m; {imp}; "
             "print(m.is_module_patched('os'), m.is_module_patched('socket'), "
             "hasattr(sys.modules['pyinfra_cli'].inventory, 'make_inventory'))")
    ours = subprocess.run([sys.executable, "-c", "import sys; " + probe.format(
        imp="from servestack.pyinfra_hooks import import_pyinfra_cli; import_pyinfra_cli()")],
        capture_output=True, text=True, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    plain = subprocess.run([sys.executable, "-c", "import sys; " + probe.format(imp="import pyinfra_cli.inventory")],
                           capture_output=True, text=True)
    assert ours.stdout.split() == ["False", "False", "True"], ours.stderr
    assert plain.stdout.split() == ["True", "True", "True"], plain.stderr


# --- 7. cli_argument ----------------------------------------------------------------------------


def test_cli_argument_reads_the_pyinfra_commands_inventory_and_limit_patterns():
    """pyinfra's click command names its inventory argument `inventory` and its repeatable option `limit`."""
    pyinfra_hooks.import_pyinfra_cli()
    from pyinfra_cli.cli import cli

    context = cli.make_context("pyinfra", ["fleet.py", "deploy.py", "--limit", "gpu-a", "--limit", "gpu_hosts"])
    with context:
        assert pyinfra_hooks.cli_argument("inventory") == "fleet.py"
        assert tuple(pyinfra_hooks.cli_argument("limit")) == ("gpu-a", "gpu_hosts")
    assert pyinfra_hooks.cli_argument("limit") is None
