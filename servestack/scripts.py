"""Run the shell scripts of files/scripts on a host: each script's text, with its inputs.

Every non-trivial host-side script lives in files/scripts/NAME.sh with its contract (inputs,
outputs, exit codes) at its top. Python renders only the inputs: environment variables and
arguments, quoted. The script's text travels in the command itself (`bash -c TEXT NAME ARGS...`),
so nothing is uploaded and the command is the same on every host. The shell functions the scripts
share are in files/scripts/helpers.sh: a script's line `source ".../helpers.sh"` (HELPERS_LINE) is
replaced by that file's code (`helpers_code`).
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

from pyinfra.api import StringCommand

SCRIPTS = Path(__file__).resolve().parent.parent / "files" / "scripts"
HELPERS = "helpers.sh"
HELPERS_LINE = 'source "${BASH_SOURCE[0]%/*}/helpers.sh"'


@functools.cache
def script_text(name: str) -> str:
    """The script as it is sent to a host: its text, with the helpers' code in place of a line
    that sources them."""
    lines = (SCRIPTS / name).read_text().splitlines(keepends=True)
    return "".join(helpers_code() if line.rstrip("\n") == HELPERS_LINE else line for line in lines)


@functools.cache
def helpers_code() -> str:
    """helpers.sh without its comment lines and blank lines (the file documents them; every
    script that uses them carries this text in every command)."""
    lines = (SCRIPTS / HELPERS).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.strip() and not line.lstrip().startswith("#"))


def script_command(name: str, *args, env: dict | None = None) -> str:
    """`files/scripts/<name>` as one shell command: `VAR=value... bash -c TEXT NAME ARGS...`."""
    assignments = [f"{key}={shlex.quote(str(value))}" for key, value in (env or {}).items()]
    words = ["bash", "-c", shlex.quote(script_text(name)), shlex.quote(name), *(shlex.quote(str(a)) for a in args)]
    return " ".join(assignments + words)


def script(name: str, *args, env: dict | None = None) -> StringCommand:
    """`script_command` as a pyinfra command to yield."""
    return StringCommand(script_command(name, *args, env=env))


def atomic_write_command(path: str, text: str, mode: str = "644") -> str:
    """The one way to write a file on a host atomically: a temporary file beside it, then rename(2)."""
    return script_command("atomic-write.sh", path, mode, env={"CONTENT": text})


PYTHON_HEREDOC = "__SERVESTACK_PYTHON__"


def python_script_command(python: str, name: str, *args) -> str:
    """`files/scripts/<name>` (Python) run by the host's `python` with its site-packages (a release's
    own interpreter): `PYTHON -I - ARGS` with the file on standard input, nothing uploaded."""
    text = (SCRIPTS / name).read_text()
    if PYTHON_HEREDOC in text:
        raise AssertionError(f"{name} must not contain {PYTHON_HEREDOC}")
    words = " ".join(shlex.quote(str(argument)) for argument in args)
    return f"{shlex.quote(python)} -I - {words} <<'{PYTHON_HEREDOC}'\n{text}\n{PYTHON_HEREDOC}"
