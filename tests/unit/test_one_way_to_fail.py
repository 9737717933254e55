"""Every operation and deploy function fails or refuses a host one way: servestack/hostrun.py's `fail_host`
(`yield from refuse(...)` in an operation's body), which prints the lines and keeps the reason for the recap.
Read from the source (ast), so that a new step cannot print a failure in red itself, fail hosts behind
pyinfra's back, or run `refuse`'s generator by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "operations").glob("*.py"), ROOT / "deploy.py", ROOT / "rollback.py"])


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def bypasses(tree: ast.AST) -> list[str]:
    """Each place that fails or refuses a host some other way than hostrun's, with its line."""
    found = []
    yielded_from = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.YieldFrom)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = _name(node.func)
            if any(keyword.arg == "fg" and isinstance(keyword.value, ast.Constant) and keyword.value.value == "red"
                   for keyword in node.keywords):
                found.append(f"line {node.lineno}: prints in red itself (hostrun.fail_host prints a failure)")
            if called == "error" and _name(getattr(node.func, "value", node.func)) == "logger":
                found.append(f"line {node.lineno}: logger.error (hostrun.fail_host prints a failure)")
            if called in ("fail_hosts", "_fail_at_prepare", "_remember", "refuse_now"):
                found.append(f"line {node.lineno}: {called} (fail the host with hostrun.fail_host)")
            if called == "refuse" and id(node) not in yielded_from:
                found.append(f"line {node.lineno}: refuse(...) not yielded from (its generator run by hand)")
        if isinstance(node, ast.Raise) and node.exc is not None and "PyinfraError" in ast.unparse(node.exc):
            found.append(f"line {node.lineno}: raises PyinfraError (fail the host with hostrun.fail_host)")
        if isinstance(node, ast.ImportFrom) and node.module == "servestack.hostrun":
            private = [alias.name for alias in node.names if alias.name.startswith("_")]
            if private:
                found.append(f"line {node.lineno}: imports hostrun's {', '.join(private)}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_operations_and_deploy_functions_fail_a_host_only_through_hostrun(path):
    assert bypasses(ast.parse(path.read_text(), str(path))) == []


def test_the_rules_catch_the_old_ways():
    old = '''
def _check(state, host):
    host.log_styled("toolkit check failed", fg="red", log_func=logger.error)
    return False

def _failed(state, host, problems):
    for command in refuse(host, problems):
        return command.execute(state, host, {})

def body():
    yield from refuse(host, ["fine"])
    host.state.fail_hosts({host})
'''
    assert sorted(line.split(":")[0] for line in bypasses(ast.parse(old))) == ["line 12", "line 3", "line 7"]
