"""One way to ship and run code on a host, one host-side atomic write (docs/design.md "One way to do
each thing"), read from the source:

- the product (servestack/, operations/, facts/ and the entry files; not the test harness) sends code
  to a host only through servestack/scripts.py: no interpreter fed a heredoc or a `-c` text of its
  own, no `exec(compile(...))` of shipped source, no file's text in an environment variable;
- host-side Python renames over a path (os.replace, os.rename) only in servestack/hostcode.py's
  `move_into_place`, under its `write_atomically`, `point_link` and patchlib's all-or-none `replace_all`;
- the shell scripts rename into place only through helpers.sh (`move_into_place`, under
  `write_atomically`, `copy_atomically` and `point_link`); a bare `mv` elsewhere moves something
  aside (a timestamped name) or into a private staging directory, never over the path readers use.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from servestack.scripts import SCRIPTS

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT = ROOT / "servestack" / "scripts.py"
ENTRY_FILES = ("deploy.py", "rollback.py", "config.py", "inventory.py")
HARNESS = (ROOT / "servestack" / "sandbox", ROOT / "servestack" / "rehearse")

# What shipping code some other way looks like in the product's source.
OTHER_WAYS = {
    "a heredoc fed to a command": re.compile(r"<<'"),
    "an interpreter given code of its own (-c TEXT, or - on stdin)": re.compile(r"-I (-S )?-(c)?[ '\"]"),
    "shipped source run by exec": re.compile(r"exec\(compile\("),
}
# A patch set's checks.py is data of the set: patchlib, on the host, runs it inside the engine.
EXEC_OF_A_SETS_CHECKS = ("servestack/patchlib.py", "load_checks")

# Host-side Python: the one function that renames over a path, in the code the tools share.
HOSTCODE = ROOT / "servestack" / "hostcode.py"
HOST_PYTHON = sorted(SCRIPTS.glob("*.py")) + [ROOT / "servestack" / "patchlib.py", HOSTCODE]
RENAMES_IN = {"hostcode.py": {"move_into_place"}}

# `mv ... DEST` where DEST is a timestamped name beside the old one, or the private staging directory
MOVE_ASIDE = re.compile(r'\bmv\b.*"([^"]*-\$(ts|stamp)|\$staged)"\s*(2>/dev/null)?\s*(;|\|\||&&|$)')


def product_files() -> list[Path]:
    files = [path for package in ("servestack", "operations", "facts")
             for path in sorted((ROOT / package).rglob("*.py"))]
    files += [ROOT / name for name in ENTRY_FILES if (ROOT / name).exists()]
    return [path for path in files if not any(path.is_relative_to(harness) for harness in HARNESS)]


def function_at(tree: ast.AST, line: int) -> str | None:
    """The innermost function holding `line`."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            if found is None or node.lineno > found.lineno:
                found = node
    return found.name if found else None


def other_ways(path: Path) -> list[str]:
    return other_ways_in(path.read_text(), path.relative_to(ROOT))


def other_ways_in(source: str, name: Path) -> list[str]:
    """Each string of the code (docstrings aside) or call that ships code another way."""
    tree = ast.parse(source)
    found = []
    for line, text in strings(tree):
        found += [f"{name}:{line}: {what}" for what, pattern in OTHER_WAYS.items() if pattern.search(text)]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "exec"
                and (str(name), function_at(tree, node.lineno)) != EXEC_OF_A_SETS_CHECKS):
            found.append(f"{name}:{node.lineno}: shipped source run by exec")
    return found


def strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant, f-strings' literal parts included, but docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def file_text_in_environment(path: Path) -> list[str]:
    """Items `"NAME": <a file's text>` of a dict (an environment: upper-case names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                    and re.fullmatch(r"[A-Z][A-Z0-9_]*", key.value) and is_file_text(value)):
                found.append(f"{path.relative_to(ROOT)}:{key.lineno}: {key.value} carries a file's text")
    return found


def is_file_text(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    return (isinstance(function, ast.Attribute) and function.attr == "read_text") or (
        isinstance(function, ast.Name) and function.id in {"script_text", "helpers_code"})


def renames(path: Path) -> list[tuple[int, str | None]]:
    """(line, function) of every os.replace / os.rename call."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, function_at(tree, node.lineno)) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"replace", "rename"} and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "os"]


def test_the_product_ships_code_to_a_host_only_through_scripts_py():
    found = [problem for path in product_files() if path != TRANSPORT for problem in other_ways(path)]
    assert found == []


def test_no_files_text_travels_in_an_environment_variable():
    assert [problem for path in product_files() for problem in file_text_in_environment(path)] == []


def test_the_scan_sees_each_other_way():
    """What the scans look for, in the forms the code once had (so that they keep catching them)."""
    shapes = {
        "f\"{python} -I -S - {params} <<'{HEREDOC}'\\n{script}\\n{HEREDOC}\"":
            {"a heredoc fed to a command", "an interpreter given code of its own (-c TEXT, or - on stdin)"},
        "f\"{py} -I -c {probe} {mark}\"": {"an interpreter given code of its own (-c TEXT, or - on stdin)"},
        "'exec(compile(payload[\"engine\"], \"patchlib.py\", \"exec\"), engine.__dict__)'":
            {"shipped source run by exec"},
        "exec(compile(source, 'engine.py', 'exec'), namespace)": {"shipped source run by exec"},
    }
    for shape, caught in shapes.items():
        source = Path("shape.py")
        source_text = f"def ship():\n    return {shape}\n"
        assert {problem.split(": ", 1)[1] for problem in other_ways_in(source_text, source)} == caught, shape
    assert other_ways_in('def f():\n    """Runs `python -I -c TEXT` <<\'EOF\'."""\n', Path("doc.py")) == []
    tree = ast.parse('env = {"PROBE": script_text("verify-http.py"), "SS_TOOL": TOOL.read_text(), "x": y.read_text()}')
    assert [is_file_text(value) for value in tree.body[0].value.values] == [True, True, True]


def test_host_side_python_renames_over_a_path_only_in_the_shared_host_codes_move_into_place():
    found = {}
    for path in HOST_PYTHON:
        places = renames(path)
        assert {function for _, function in places} <= RENAMES_IN.get(path.name, set()), (path.name, places)
        found[path.name] = {function for _, function in places}
    assert found["hostcode.py"] == RENAMES_IN["hostcode.py"]


def path_renames(path: Path) -> list[tuple[int, str | None]]:
    """(line, function) of every `X.rename(...)` call (pathlib's)."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, function_at(tree, node.lineno)) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rename"]


def test_the_controller_renames_over_a_path_only_through_the_shared_move_into_place():
    """The controller's own files (the hashes it fixes, the runfile it downloads) are put in place the same way;
    the one other rename moves a file that failed verification aside, to a timestamped name."""
    assert {(path.name, function) for path in product_files() for _, function in renames(path)} == \
        {("hostcode.py", "move_into_place")}
    assert {(path.name, function) for path in product_files() for _, function in path_renames(path)} == \
        {("download.py", "reject")}


def test_shell_scripts_rename_into_place_only_through_the_helpers():
    helpers = (SCRIPTS / "helpers.sh").read_text()
    assert re.findall(r"\bmv\b[^\n]*", helpers) == ['mv -fT -- "$1" "$2"; }']   # move_into_place, and only it
    found = []
    for path in sorted(SCRIPTS.glob("*.sh")):
        if path.name == "helpers.sh":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
            if re.search(r"\bln -s", code) or (re.search(r"\bmv\b", code) and not MOVE_ASIDE.search(code)):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert found == []


def test_the_known_good_unit_is_copied_atomically_both_ways():
    """The gate keeps the unit as the last known-good one, and puts it back on a rollback, only with
    helpers.sh `copy_atomically`: a reader (systemd, the next gate) never sees half a unit."""
    gate = (SCRIPTS / "sglang-health-gate.sh").read_text()
    writes = [line.strip() for line in gate.splitlines()
              if '"$SS_GOOD_UNIT"' in line and not line.lstrip().startswith("#") and "[ " not in line]
    assert writes == ['install -d -m 755 -- "$SS_STATE_DIR" && copy_atomically "$SS_UNIT_PATH" "$SS_GOOD_UNIT" 644 &&',
                      'restore_good_unit() { copy_atomically "$SS_GOOD_UNIT" "$SS_UNIT_PATH" 644; }']
    assert not re.search(r'\b(cp|cat|tee)\b[^\n]*"\$SS_(GOOD_UNIT|UNIT_PATH)"', gate)
    assert not re.search(r'>\s*"\$SS_(GOOD_UNIT|UNIT_PATH)"', gate)
