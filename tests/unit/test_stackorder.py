"""servestack.stackorder: pyinfra's per-operation stack inspection stops scanning sys.modules for
the deploy file, and still reads the same file names and line numbers."""

import inspect
import sys

from servestack.stackorder import index_deploy_file, module_name


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
