"""servestack.stackorder: pyinfra's per-operation stack inspection stops scanning sys.modules for
the deploy file, and still reads the same file names and line numbers."""

import importlib
import inspect
import sys

from servestack.stackorder import index_deploy_file, module_name, operation_order, use_frame_order


def _frame_of(path):
    """Execute `path` as pyinfra executes a deploy file (compile + exec) and return its frame."""
    code = compile(path.read_text(), str(path), "exec")
    namespace = {"__file__": str(path), "sys": sys}
    exec(code, namespace)
    return namespace["frame"]


def _scans(frame, monkeypatch) -> int:
    """How many modules inspect examines to place `frame`'s file (0: answered from its cache)."""
    seen = []
    real = inspect.ismodule
    monkeypatch.setattr(inspect, "ismodule", lambda obj: (real(obj) and seen.append(obj)) or real(obj))
    info = inspect.getframeinfo(frame)
    monkeypatch.setattr(inspect, "ismodule", real)
    assert info.lineno == 2 and info.code_context == ["frame = sys._getframe()\n"]
    return len(seen)


def test_a_deploy_file_makes_inspect_scan_every_module_until_indexed(tmp_path, monkeypatch):
    deploy = tmp_path / "deploy.py"
    deploy.write_text("# a deploy file\nframe = sys._getframe()\n")
    frame = _frame_of(deploy)
    assert _scans(frame, monkeypatch) > 100          # every call, not only the first
    assert _scans(frame, monkeypatch) > 100

    name = index_deploy_file(str(deploy))
    try:
        _scans(frame, monkeypatch)                   # the first lookup caches the file's module
        assert _scans(frame, monkeypatch) == 0
        assert inspect.getmodule(frame) is sys.modules[name]
        assert index_deploy_file(str(deploy)) == name  # idempotent
    finally:
        sys.modules.pop(name, None)


def test_the_module_stands_for_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = index_deploy_file("deploy.py")
    try:
        assert name == module_name(str(tmp_path / "deploy.py"))
        assert sys.modules[name].__file__ == str(tmp_path / "deploy.py")
    finally:
        sys.modules.pop(name, None)


# --- pyinfra's operation order, read from the frames ---------------------------------------


class _State:
    def __init__(self, deploy_file, op_number=7):
        self.current_deploy_filename = deploy_file
        self.current_op_file_number = op_number


DEPLOY = '''# a deploy file calling "operations" through a helper, one call spread over lines
def step(order):
    return inner(
        order,
    )


def inner(order):
    return [order(), order()]


result = step(
    order,
)
'''


def _orders_from(tmp_path, deploy_file_name):
    """Both implementations called from the same frames of an exec'd deploy file."""
    from pyinfra.api.util import get_operation_order_from_stack

    path = tmp_path / "deploy.py"
    path.write_text(DEPLOY)
    state = _State(str(path) if deploy_file_name is None else deploy_file_name)
    calls = iter([lambda: get_operation_order_from_stack(state), lambda: operation_order(state)])
    namespace = {"order": lambda: next(calls)()}
    exec(compile(DEPLOY, str(path), "exec"), namespace)
    return namespace["result"]


def test_frame_order_is_the_order_pyinfra_reads_from_inspect(tmp_path, monkeypatch):
    import pyinfra

    for is_cli in (True, False):
        monkeypatch.setattr(pyinfra, "is_cli", is_cli)
        for deploy_file in (None, "/elsewhere/deploy.py", ""):  # found, not on the stack, no deploy file
            from_inspect, from_frames = _orders_from(tmp_path, deploy_file)
            assert from_frames == from_inspect, (is_cli, deploy_file)


def test_use_frame_order_replaces_what_pyinfras_operations_call():
    pyinfra_operation = importlib.import_module("pyinfra.api.operation")
    original = pyinfra_operation.get_operation_order_from_stack
    try:
        use_frame_order()
        use_frame_order()
        assert pyinfra_operation.get_operation_order_from_stack is operation_order
    finally:
        pyinfra_operation.get_operation_order_from_stack = original
