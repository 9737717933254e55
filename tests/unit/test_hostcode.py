"""The code the Python host tools share (servestack/hostcode.py): what its writes leave behind, and how
a tool brings it to a host (servestack/scripts.py puts its code in place of the line that imports it)."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys

import pytest

from facts.patches import engine_source
from servestack import hostcode
from servestack.scripts import HOSTCODE_LINE, SCRIPTS, hostcode_code, script_text

ROOT = SCRIPTS.parents[1]
PYTHON_TOOLS = sorted(SCRIPTS.glob("*.py")) + [ROOT / "servestack" / "patchlib.py"]


def including(path) -> list[str]:
    """The names `path` imports from the shared host code, by its one include line."""
    lines = [line for line in path.read_text().splitlines() if HOSTCODE_LINE.match(line)]
    return HOSTCODE_LINE.match(lines[0])["names"].split(", ") if lines else []


def test_the_tools_that_frame_output_or_write_on_a_host_include_the_shared_code():
    users = {path.name: including(path) for path in PYTHON_TOOLS if including(path)}
    assert users == {
        "bench-client.py": ["section"], "ml_env.py": ["point_link", "section_text", "write_atomically"],
        "sglang-prestart.py": ["section"], "stage-weights.py": ["section"], "verify-http.py": ["section"],
        "verify-python.py": ["section"],
        "patchlib.py": ["move_into_place", "new_file_beside", "remove_if_there", "section"]}


def imported_packages(text: str) -> set[str]:
    """The top-level package of every import in `text`, wherever it stands."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


def top_level_names(text: str) -> set[str]:
    return {node.name for node in ast.parse(text).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("path", [path for path in PYTHON_TOOLS if including(path)], ids=lambda path: path.name)
def test_a_tool_is_sent_with_the_shared_code_in_place_of_its_import(path):
    raw = path.read_text()
    line = next(line for line in raw.splitlines() if HOSTCODE_LINE.match(line))
    before, _ = raw.split(line + "\n")
    sent = script_text(path)
    assert sent.startswith(before + hostcode_code(tuple(including(path))))
    assert set(including(path)) <= top_level_names(sent)


@pytest.mark.parametrize("path", PYTHON_TOOLS, ids=lambda path: path.name)
def test_no_tool_is_sent_with_an_import_of_servestack_in_any_form(path):
    """However a tool spells an import of servestack's (an alias, a comment after it, inside a function), what
    is sent has none: the hosts have no servestack."""
    assert "servestack" not in imported_packages(script_text(path))


@pytest.mark.parametrize("path", PYTHON_TOOLS, ids=lambda path: path.name)
def test_no_tool_defines_a_name_the_shared_code_defines(path):
    """Sent, a tool holds all of the shared code: a function of its own by the same name would replace it on
    hosts, and not where the tool lies."""
    assert top_level_names(path.read_text()) & top_level_names(hostcode_code(())) == set()


def test_the_shared_code_is_sent_without_its_module_docstring_and_refuses_a_name_it_lacks():
    code = hostcode_code(("section",))
    assert code.startswith("import os\nimport sys\n") and '"""The code the Python host tools share' not in code
    with pytest.raises(ValueError, match="servestack/hostcode.py defines no write_json"):
        hostcode_code(("section", "write_json"))


def test_a_tool_sent_runs_in_a_python_without_servestack():
    """-I -S: no site-packages, so nothing of servestack's can be imported; the sent text needs none."""
    run = subprocess.run([sys.executable, "-I", "-S", "-c", script_text("verify-http.py")],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (2, "usage: verify-http.py BASE REQUEST\n")


def test_write_atomically_writes_a_new_file_with_mode_644_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "record.json"
    hostcode.write_atomically(str(path), "{}\n")
    assert path.read_text() == "{}\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["record.json"]


def test_write_atomically_keeps_the_files_mode_and_writes_bytes_as_given(tmp_path):
    path = tmp_path / "unit"
    path.write_text("old\n")
    path.chmod(0o600)
    hostcode.write_atomically(str(path), b"new\x00\n")
    assert path.read_bytes() == b"new\x00\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_nothing_beside_it(tmp_path):
    path = tmp_path / "a-directory"
    path.mkdir()
    (path / "inside").write_text("x")
    with pytest.raises(OSError):
        hostcode.write_atomically(str(path), "text")   # rename(2) of a file over a non-empty directory fails
    assert sorted(os.listdir(tmp_path)) == ["a-directory"] and (path / "inside").read_text() == "x"


def test_a_link_where_the_new_file_goes_is_not_written_through(tmp_path):
    victim = tmp_path / "elsewhere"
    victim.write_text("keep\n")
    path = tmp_path / "record.json"
    (tmp_path / f"record.json.new.{os.getpid()}").symlink_to(victim)
    hostcode.write_atomically(str(path), "new\n")
    assert victim.read_text() == "keep\n" and path.read_text() == "new\n" and not path.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "record.json"]


def test_point_link_replaces_a_link_and_leaves_nothing_beside_it(tmp_path):
    link = tmp_path / "venv"
    link.symlink_to("releases/r-1")
    (tmp_path / f"venv.servestack-new.{os.getpid()}").symlink_to("left-by-a-killed-run")
    hostcode.point_link(str(link), "releases/r-2")
    assert os.readlink(link) == "releases/r-2" and sorted(os.listdir(tmp_path)) == ["venv"]


def test_the_patch_sums_cover_the_shared_code_the_engine_brings():
    """A host's patch record holds for the engine it was checked with: a change of the shared code is one."""
    assert hostcode_code(("section",)) in engine_source() and "from servestack.hostcode" not in engine_source()
