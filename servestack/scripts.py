"""The one way to ship and run code on a host: the code's text in the command, with its inputs.

Every non-trivial piece of host-side code lives in a file with its contract (inputs, outputs, exit
codes) at its top: shell scripts and Python tools in files/scripts/, and servestack/patchlib.py,
which the controller imports too. Python renders only the inputs: arguments and environment
variables, quoted. The code's text travels in the command itself, as the interpreter's `-c`
argument, so nothing is uploaded, nothing is left on the host and the command is the same on
every host:

    shell   `VAR=value... bash -c TEXT NAME ARGS...`            (`script_command`)
    Python  `VAR=value... PYTHON -I [-S] -c TEXT ARGS...`        (`python_script_command`)

A script brings the files it needs by the same means: its text names them by lines that work
where it lies (tests run the scripts from files/scripts), and those lines are replaced by the
files' text when it is sent (`script_text`):
- `source "${BASH_SOURCE[0]%/*}/helpers.sh"` (HELPERS_LINE): the shell functions the scripts share,
  files/scripts/helpers.sh, in its place;
- `NAME=$(<"${BASH_SOURCE[0]%/*}/PATH")` (a line alone): NAME set to the text of PATH, relative to
  files/scripts, quoted; a shell script runs a Python tool with `"$python" -I -c "$NAME" ARGS`;
- in a Python tool, `NAME = text_beside("PATH")` (a line alone; the tool defines `text_beside`, which
  reads PATH beside the tool where it lies): NAME set to the text of PATH as a string literal (the
  venv tool's release check, files/scripts/check_release.py, which it runs in the release's python);
- in a Python tool, `from servestack.hostcode import NAME, ...` (HOSTCODE_LINE, a line alone): the code
  the Python tools share, servestack/hostcode.py (their framing and atomic writes), in its place. Where it
  lies, such a tool runs in a python that imports servestack (the tests'); a shell script that reads it
  (the gate reads ml_env.py) is run as it is sent, as the tests run every script that gets past such a read.

The one exception is the service's secrets file (operations/service.py `secrets_file`): its
content travels by pyinfra's SFTP upload, because a secret must never sit in a command line, where
the host's process list and logs show it.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from pathlib import Path

from pyinfra.api import StringCommand

SCRIPTS = Path(__file__).resolve().parent.parent / "files" / "scripts"
HELPERS = "helpers.sh"
HELPERS_LINE = 'source "${BASH_SOURCE[0]%/*}/helpers.sh"'
TEXT_LINE = re.compile(r'^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=\$\(<"\$\{BASH_SOURCE\[0\]%/\*\}/(?P<path>[^"]+)"\)$')
PYTHON_TEXT_LINE = re.compile(r'^(?P<name>[A-Za-z_][A-Za-z0-9_]*) = text_beside\("(?P<path>[^"]+)"\)$')
HOSTCODE = Path(__file__).resolve().parent / "hostcode.py"
HOSTCODE_LINE = re.compile(r"^from servestack\.hostcode import (?P<names>\w+(, \w+)*)$")


@functools.cache
def script_text(name: str | Path) -> str:
    """The script as it is sent to a host: its text, with the helpers' code in place of a line that
    sources them and each file it reads into a variable (TEXT_LINE, PYTHON_TEXT_LINE) in place of that
    read (a file read so is sent as it would be itself)."""
    lines = (SCRIPTS / name).read_text().splitlines(keepends=True)
    return "".join(_sent_line(line.rstrip("\n")) or line for line in lines)


def _sent_line(line: str) -> str | None:
    """What a line that brings a file is replaced by; None for any other line."""
    if line == HELPERS_LINE:
        return helpers_code()
    read = TEXT_LINE.match(line)
    if read is not None:
        text = script_text(read["path"]).rstrip("\n")  # as `$(<PATH)` reads it: no final line breaks
        return f"{read['name']}={shlex.quote(text)}\n"
    read = PYTHON_TEXT_LINE.match(line)
    if read is not None:
        return f"{read['name']} = {script_text(read['path'])!r}\n"
    include = HOSTCODE_LINE.match(line)
    if include is not None:
        return hostcode_code(tuple(include["names"].split(", ")))
    return None


@functools.cache
def helpers_code() -> str:
    """helpers.sh without its comment lines and blank lines (the file documents them; every
    script that uses them carries this text in every command)."""
    lines = (SCRIPTS / HELPERS).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.strip() and not line.lstrip().startswith("#"))


def hostcode_code(names: tuple[str, ...]) -> str:
    """servestack/hostcode.py without its module docstring, for a tool that imports `names` from it
    (a name it does not define is an error here, not a NameError on a host)."""
    tree = ast.parse(_hostcode_text())
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in names if name not in defined]
    if missing:
        raise ValueError(f"servestack/hostcode.py defines no {', '.join(missing)}")
    first = tree.body[0] if tree.body else None
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str)
    lines = _hostcode_text().splitlines(keepends=True)
    return "".join(lines[first.end_lineno or 0:] if has_docstring and first else lines).strip("\n") + "\n"


@functools.cache
def _hostcode_text() -> str:
    return HOSTCODE.read_text()


def _assignments(env: dict | None) -> list[str]:
    return [f"{key}={shlex.quote(str(value))}" for key, value in (env or {}).items()]


def _quoted(args: tuple) -> list[str]:
    return [shlex.quote(str(argument)) for argument in args]


def script_command(name: str, *args, env: dict | None = None) -> str:
    """`files/scripts/<name>` as one shell command: `VAR=value... bash -c TEXT NAME ARGS...`."""
    words = ["bash", "-c", shlex.quote(script_text(name)), shlex.quote(name), *_quoted(args)]
    return " ".join(_assignments(env) + words)


def script(name: str, *args, env: dict | None = None) -> StringCommand:
    """`script_command` as a pyinfra command to yield."""
    return StringCommand(script_command(name, *args, env=env))


def python_script_command(python: str, name: str | Path, *args, env: dict | None = None, site: bool = True) -> str:
    """A Python tool (`files/scripts/<name>`, or a path) run by the host's `python`:
    `VAR=value... PYTHON -I [-S] -c TEXT ARGS...` (its arguments are sys.argv[1:]).

    -I ignores PYTHON* variables and the user's site-packages; `site=False` adds -S, for a tool that
    needs the standard library only (importing site is a cost on every converge). With `site`, the
    interpreter's own site-packages are there (a release's python and its packages).
    """
    flags = ["-I"] if site else ["-I", "-S"]
    words = [shlex.quote(python), *flags, "-c", shlex.quote(script_text(name)), *_quoted(args)]
    return " ".join(_assignments(env) + words)


def atomic_write_command(path: str, text: str, mode: str = "644") -> str:
    """The one way to write a file on a host atomically: a temporary file beside it, then rename(2)."""
    return script_command("atomic-write.sh", path, mode, env={"CONTENT": text})


def atomic_copy_command(source: str, path: str, mode: str = "644") -> str:
    """Copy the host's file `source` to `path` atomically, byte for byte (atomic-write.sh)."""
    return script_command("atomic-write.sh", path, mode, source)
