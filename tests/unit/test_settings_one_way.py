"""Every operation gets the host's settings one way: it reads `host_settings(host)` itself. Read from the
source (ast), so that a new operation cannot take the settings as an argument beside the ones that read them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "operations").glob("*.py"))


def _decorated(node: ast.FunctionDef, name: str) -> bool:
    return any(ast.unparse(decorator).split("(")[0].split(".")[-1] == name for decorator in node.decorator_list)


def settings_arguments(tree: ast.AST) -> list[str]:
    """Each @operation or @deploy function that takes the settings, or is called with them, with its line."""
    found = []
    decorated = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (_decorated(node, "operation") or _decorated(node, "deploy")):
            decorated.add(node.name)
            if any(arg.arg == "settings" for arg in node.args.args + node.args.kwonlyargs):
                found.append(f"line {node.lineno}: {node.name} takes settings (read host_settings(host) in it)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in decorated \
                and any(keyword.arg == "settings" for keyword in node.keywords):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)} is called with settings=")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.name)
def test_operations_read_the_settings_themselves(path):
    assert settings_arguments(ast.parse(path.read_text(), str(path))) == []


def test_the_rule_catches_settings_passed_as_an_argument():
    old = '''
@operation()
def unit(settings: Settings, release):
    yield "x"

@deploy("Service")
def service(release):
    unit(name="Unit", settings=host_settings(host), release=release)
'''
    assert [line.split(":")[0] for line in settings_arguments(ast.parse(old))] == ["line 3", "line 8"]
