"""One way to carry several outputs in one remote command's output, and to split them again.

A section is printed as::

    @@servestack begin NAME
    <the command's output>
    <an empty line>
    @@servestack end NAME RC

The empty line keeps output without a final newline apart from the end marker; `split` drops it,
so a section's lines are what pyinfra would have read from the command alone (blank lines
included). RC is the command's exit status. Python builds sections with `framed`; shell scripts
in files/scripts with files/scripts/helpers.sh's `section`, and the Python tools sent to a host
(standard library only, they cannot import this module) with servestack/hostcode.py's `section`,
which prints `printed`'s lines (ml_env.py writes its `section_text` through its own `write_out`, which
outlives a closed stdout); one parser, `split`, serves them all, and no other module reads the
markers.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

BEGIN = "@@servestack begin "
END = "@@servestack end "


@dataclass(frozen=True)
class Section:
    """One section's output lines and exit status (None when the output was cut off)."""

    rc: int | None
    lines: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def framed(name: str, command: str) -> str:
    """Shell that runs `command` in a subshell (stdin closed) and prints its output as section `name`."""
    return (f"echo {shlex.quote(BEGIN + name)}; ( {command}\n) </dev/null; "
            f"printf '\\n{END}%s %s\\n' {shlex.quote(name)} \"$?\"")


def printed(name: str, text: str, rc: int = 0) -> tuple[str, ...]:
    """The lines of section `name` whose command printed `text` (no final line break) and exited `rc`."""
    return (BEGIN + name, *text.split("\n"), "", f"{END}{name} {rc}")


def split(lines) -> dict[str, Section]:
    """Every section in `lines`, by name (text outside sections is ignored). Sections nest: inside
    a section everything up to its own end line is its output, other sections' markers included
    (a script that frames its own output can be read in a batch). A section whose end never came
    (the command was cut off) has exit status None."""
    found: dict[str, Section] = {}
    name: str | None = None
    body: list[str] = []
    for line in lines:
        if name is None:
            if line.startswith(BEGIN):
                name, body = line[len(BEGIN):], []
            continue
        ended, _, rc = line[len(END):].rpartition(" ") if line.startswith(END) else ("", "", "")
        if ended != name:
            body.append(line)
            continue
        if body and body[-1] == "":
            body.pop()
        found[name] = Section(int(rc) if rc.lstrip("-").isdigit() else None, tuple(body))
        name = None
    if name is not None:
        found[name] = Section(None, tuple(body))
    return found
