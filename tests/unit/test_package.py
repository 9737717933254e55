"""What ships: the built wheel holds the product (servestack, operations, facts) and none of the test harness
(sandbox/: the sandbox hosts, the stand-ins, the rehearsal), and the installed command offers no harness command."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / ".tools" / "bin" / "uv"
PRODUCT_PACKAGES = ("servestack", "operations", "facts")
PRODUCT_SCRIPTS = ("deploy.py", "rollback.py", "config.py")
HARNESS_COMMANDS = ("rehearse", "up", "run", "exec", "down", "status")
# What never goes into a copy of the checkout: other environments, and earlier builds (setuptools puts whatever
# an earlier build left in build/ into the next wheel).
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".tools", ".whl", ".device", "build", "*.egg-info",
                                     "__pycache__", ".pytest_cache")


def built_wheel(source: Path, out: Path) -> list[str]:
    """The file names in the wheel `uv build` makes of a copy of this checkout (PyPI gives setuptools)."""
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    build = subprocess.run([str(UV), "build", "--wheel", "--out-dir", str(out), "--python", sys.executable,
                            str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    [wheel] = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_the_wheel_holds_the_product_and_none_of_the_test_harness(tmp_path):
    source = tmp_path / "checkout"
    names = built_wheel(source, tmp_path / "dist")
    product = {str(path.relative_to(source))
               for package in PRODUCT_PACKAGES for path in (source / package).rglob("*.py")}
    assert product and product <= set(names), sorted(product - set(names))
    harness = [name for name in names
               if name.startswith("sandbox/") or "/sandbox/" in name
               or any(word in name for word in ("rehearse", "standin", "fake_sglang_server", "kept_metadata"))]
    assert harness == []
    assert {name.split("/", 1)[0] for name in names} == {*PRODUCT_PACKAGES, "servestack-0.1.0.dist-info"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {*(alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names),
            *(node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module)}


def test_nothing_shipped_imports_the_harness():
    product = [*(ROOT / name for name in PRODUCT_SCRIPTS),
               *(path for package in PRODUCT_PACKAGES for path in (ROOT / package).rglob("*.py"))]
    harness = ("sandbox", "servestack.sandbox", "servestack.rehearse")
    importers = {str(path.relative_to(ROOT)): sorted(module for module in imported_modules(path)
                                                     if module.startswith(harness))
                 for path in product}
    assert {path: modules for path, modules in importers.items() if modules} == {}


def test_the_servestack_command_offers_no_harness_command():
    help_text = subprocess.run([sys.executable, "-m", "servestack.cli", "--help"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    commands = help_text.split("{", 1)[1].split("}", 1)[0].split(",")
    assert "doctor" in commands and "sandbox" not in commands and "rehearse" not in commands
    assert "sandbox" not in help_text and "rehearse" not in help_text


def test_the_harness_has_its_own_command_line_with_the_sandbox_and_the_rehearsal():
    help_text = subprocess.run([sys.executable, "-m", "sandbox", "--help"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    assert help_text.startswith("usage: python -m sandbox ")
    assert help_text.split("{", 1)[1].split("}", 1)[0].split(",") == list(HARNESS_COMMANDS)
