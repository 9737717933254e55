"""The host-state probe: many facts' commands in one remote command (servestack/probe.py uses it).

A `ProbeRequest` is a list of facts (a `FactBase` class and its arguments). `HostProbe` runs each
fact's own command, unchanged, in its own subshell, and prints their outputs framed by markers
that carry each command's exit status: facts that start a slow program (a class attribute
`probe_background = True`: nvidia-smi, nvcc, python, an HTTP request) all at once in the
background, the others one after another meanwhile. `split_probe_output` gives each fact its
output lines back, and `FactRequest.value` turns them into the fact's value with the fact's own
`process` / `default`, as pyinfra's `get_fact` would. So a fact has one definition whether it is
read alone or in the probe.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field, is_dataclass

from pyinfra.api import FactBase, StringCommand
from pyinfra.api.facts import _MISSING_COMMAND_MARKER

BEGIN = "@@probe-begin "
END = "@@probe-end "
# One `sh -c` argument may not exceed 128 KiB (Linux MAX_ARG_STRLEN): larger probes are split.
MAX_COMMAND_CHARS = 100_000
_PREPARED: dict[tuple, tuple] = {}   # (fact class, FactRequest.key) -> (fact instance, its command)


def _keyable(value) -> str:
    """Arguments that are objects (a verification ProbeScript) are identified by all their fields."""
    text = json.dumps(asdict(value), sort_keys=True, default=str) if is_dataclass(value) else repr(value)
    return hashlib.sha256(text.encode()).hexdigest()


def _text(command) -> str:
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


@dataclass(frozen=True)
class FactRequest:
    """One fact to read: its class and arguments; `key` identifies it in the probe's cache."""

    cls: type
    kwargs: tuple = ()          # sorted (name, value) pairs

    @classmethod
    def of(cls, fact_cls: type, **kwargs) -> "FactRequest":
        return cls(fact_cls, tuple(sorted(kwargs.items())))

    @property
    def key(self) -> str:
        """Computed once per request (every read of the probe's cache asks for it)."""
        if "_key" not in self.__dict__:
            object.__setattr__(self, "_key", f"{self.cls.__module__}.{self.cls.__name__}"
                                             f"({json.dumps(self.kwargs, default=_keyable)})")
        return self.__dict__["_key"]

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def background(self) -> bool:
        return bool(getattr(self.cls, "probe_background", False))

    def command(self) -> str:
        """The fact's command as pyinfra runs it (with its `requires_command` guard)."""
        return self._prepared()[1]

    def _prepared(self) -> tuple:
        """(a fact instance whose `command` ran, the command): built once per fact and arguments in
        a run (`_PREPARED`), not once per host and read: a command is a function of its arguments,
        and building some costs the controller as much as reading their output (~10 ms per host)."""
        found = _PREPARED.get((self.cls, self.key))
        if found is None:
            fact = self.cls()
            found = _PREPARED[(self.cls, self.key)] = (fact, self._build(fact))
        return found

    def _build(self, fact) -> str:
        command = _text(fact.command(**dict(self.kwargs)) if callable(fact.command) else fact.command)
        required = fact.requires_command(**dict(self.kwargs)) if callable(fact.requires_command) \
            else fact.requires_command
        if required:
            command = (f"if command -v {_text(required)} >/dev/null 2>&1; then ( {command}\n); "
                       f"else echo '{_MISSING_COMMAND_MARKER}'; fi")
        return command

    def parts(self) -> tuple[str, str] | None:
        """(prelude, body) for a fact that reads something other facts read too (`probe_parts`, e.g.
        one `systemctl show` for the unit's state and the verification script): the probe runs each
        distinct prelude once, first, in its own shell (it only sets variables), then the body. None
        when the fact has no such read; its command runs as pyinfra would run it."""
        if "_parts" not in self.__dict__:
            fact = self._prepared()[0]
            split = fact.probe_parts(**dict(self.kwargs)) if hasattr(fact, "probe_parts") else None
            object.__setattr__(self, "_parts", tuple(split) if split and split[0] else None)
        return self.__dict__["_parts"]

    def probe_command(self) -> str:
        """The command as the probe runs it: its body after the shared preludes, or the whole command."""
        parts = self.parts()
        return parts[1] if parts else self.command()

    def value(self, lines: list[str]):
        """The fact's value from its output lines (its command exited 0), as `get_fact` makes it."""
        # a copy of the instance whose command ran: some pyinfra facts keep their arguments for
        # `process` (Sha256File: path)
        fact = copy.copy(self._prepared()[0])
        return fact.process(lines) if lines else fact.default()


@dataclass(frozen=True)
class ProbeRequest:
    """Facts read by one `HostProbe` command; shown in pyinfra's log by their names only."""

    facts: tuple[FactRequest, ...] = field(default=())

    def __str__(self) -> str:
        return ", ".join(fact.name for fact in self.facts)

    def command(self) -> str:
        """The facts' shared reads (`FactRequest.parts`), then the background facts' commands at once
        (each in a subshell, its framed output to a file of a private temporary directory),
        meanwhile the others' one after another (each in a subshell, its framed output straight
        out), then the files: the probe takes about as long as its slowest fact. Framing costs a
        fork per fact (two and a file in the background) and no other program (each program
        started costs a host ~1.5 ms of CPU, and a fleet's no-op converge is mostly such reads);
        a fact that starts none costs less than a background fork."""
        background = [index for index, fact in enumerate(self.facts) if fact.background]
        lines = list(dict.fromkeys(parts[0] for fact in self.facts if (parts := fact.parts())))
        lines += ["d=$(mktemp -d) || exit 1"] if background else []
        lines += [f"{{ {self._framed(index)}; }} >\"$d/{index}\" &" for index in background]
        lines += [self._framed(index) for index in range(len(self.facts)) if index not in background]
        if background:
            lines += ["wait", "cat \"$d\"/*", "rm -rf \"$d\""]
        return "\n".join([*lines, "true"])

    def _framed(self, index: int) -> str:
        return (f"echo '{BEGIN}{index}'; ( {self.facts[index].probe_command()}\n) </dev/null; "
                f"printf '\\n{END}{index} %s\\n' \"$?\"")


def split_requests(facts: list[FactRequest]) -> list[ProbeRequest]:
    """Group facts into as few requests as fit in one remote command each."""
    groups: list[list[FactRequest]] = [[]]
    size = 0
    for fact in facts:
        length = len(fact.command()) + 64
        if groups[-1] and size + length > MAX_COMMAND_CHARS:
            groups.append([])
            size = 0
        groups[-1].append(fact)
        size += length
    return [ProbeRequest(tuple(group)) for group in groups if group]


def split_probe_output(lines: list[str]) -> dict[int, tuple[int | None, list[str]]]:
    """{index: (exit status or None when cut off, output lines)} from a probe's output.

    The end marker is printed after a newline, so that output without a final newline keeps it
    apart: output that had its final newline shows one empty line before the marker, dropped here
    (pyinfra's own reading gives the same lines, blank ones included)."""
    found: dict[int, tuple[int | None, list[str]]] = {}
    current, body = None, []
    for line in lines:
        if line.startswith(BEGIN):
            current, body = int(line[len(BEGIN):]), []
            found[current] = (None, body)
        elif line.startswith(END) and current is not None:
            index, _, rc = line[len(END):].partition(" ")
            if int(index) == current:
                if body and body[-1] == "":
                    body.pop()
                found[current] = (int(rc) if rc.strip().lstrip("-").isdigit() else None, body)
                current = None
        elif current is not None:
            body.append(line)
    return found


class HostProbe(FactBase):
    """
    Several facts in one remote command: ``{index: (exit status, output lines)}``.

    + request: a ``ProbeRequest``
    """

    def command(self, request: ProbeRequest) -> str:
        return request.command()

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return split_probe_output(output)
