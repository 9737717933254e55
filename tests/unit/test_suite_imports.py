"""The suite runs with pytest's importlib mode, where every test file is imported under its bare name: a test
file that imports helpers from another test module by name (`from test_interrupted import ...`) gets whichever
file of that name pytest imported first. So a test module imported by name has a name no other test file has."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_test_module_imported_by_name_is_the_only_test_file_of_that_name():
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    names = Counter(path.stem for path in files)
    imported = {(path.relative_to(ROOT).as_posix(), node.module) for path in files
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("test_")}
    assert imported, "the integration tests share helpers this way (test_interrupted)"
    ambiguous = sorted((source, module) for source, module in imported if names[module] > 1)
    assert ambiguous == [], f"imported by a name several test files have: {ambiguous}"
