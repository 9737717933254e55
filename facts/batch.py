"""Several facts read in one remote command: each fact's own command and parser, unchanged.

A `FactRequest` names a fact class and its arguments. `FactBatch` runs each request's command as
pyinfra would (with its `requires_command` guard) in a section of its own (facts/framing.py), and
`FactRequest.value` turns a section back into the fact's value with the fact's own `process` /
`default`. So a fact has one definition whether it is read alone or in a batch. Facts that start a
slow program (a class attribute `slow = True`: nvidia-smi, nvcc, python, an HTTP request) run at
once in the background, the others one after another meanwhile: a batch takes about as long as
its slowest fact.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import shlex
from dataclasses import asdict, dataclass, is_dataclass

from pyinfra.api import FactBase, StringCommand
from pyinfra.api.exceptions import FactProcessError

from facts.framing import Section, framed, split
from servestack.pyinfra_hooks import MISSING_COMMAND_MARKER

# One `sh -c` argument may not exceed 128 KiB (Linux MAX_ARG_STRLEN): larger batches are split.
MAX_COMMAND_CHARS = 100_000


def _keyable(value) -> str:
    """Arguments that are objects (dataclasses) are identified by all their fields."""
    if is_dataclass(value) and not isinstance(value, type):
        text = json.dumps(asdict(value), sort_keys=True, default=str)
    else:
        text = repr(value)
    return hashlib.sha256(text.encode()).hexdigest()


def _text(command) -> str:
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


def _called(attribute, kwargs: dict):
    return attribute(**kwargs) if callable(attribute) else attribute


@dataclass(frozen=True)
class FactRequest:
    """One fact to read: its class and arguments (`key` names it in a batch and in servestack.reads)."""

    cls: type
    kwargs: tuple = ()          # sorted (name, value) pairs

    @classmethod
    def of(cls, fact_cls: type, **kwargs) -> "FactRequest":
        return cls(fact_cls, tuple(sorted(kwargs.items())))

    @functools.cached_property
    def key(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__name__}({json.dumps(self.kwargs, default=_keyable)})"

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def slow(self) -> bool:
        return bool(getattr(self.cls, "slow", False))

    def command(self) -> str:
        """The fact's command as pyinfra runs it, with its `requires_command` guard."""
        return self._rendered[1]

    @functools.cached_property
    def _rendered(self) -> tuple[FactBase, str]:
        """(the fact, its command): as in pyinfra, one fact object renders the command and then
        processes the output (some facts keep their arguments for `process`: Sha256File its path)."""
        fact, kwargs = self.cls(), dict(self.kwargs)
        command = _text(_called(fact.command, kwargs))
        required = _called(fact.requires_command, kwargs)
        if required:
            command = (f"if command -v {_text(required)} >/dev/null 2>&1; then ( {command}\n); "
                       f"else echo {shlex.quote(MISSING_COMMAND_MARKER)}; fi")
        return fact, command

    def value(self, section: Section):
        """The fact's value from its section, as `host.get_fact` makes it; raises `Unread` when the
        command failed (pyinfra's own reading then reports the failure)."""
        if not section.ok or list(section.lines) == [MISSING_COMMAND_MARKER]:
            raise Unread(self)
        fact = self._rendered[0]
        if not section.lines:
            return copy.deepcopy(fact.default())
        try:
            return fact.process(list(section.lines))
        except FactProcessError as error:   # read alone, pyinfra reports it as it always does
            raise Unread(self) from error


class Unread(Exception):
    """A fact whose command failed in a batch: read it alone (`host.get_fact`) for pyinfra's report."""

    def __init__(self, request: FactRequest):
        super().__init__(request.key)
        self.request = request


def batches(requests: list[FactRequest], quotes: int = 0) -> list[tuple[FactRequest, ...]]:
    """The requests in as few groups as fit in one remote command each. `quotes`: how many times the
    transport shell-quotes the command on its way (each quote turns a `'` into five characters, so a
    script full of them grows fast): sizes are measured as they arrive (testinfra's SSH backend with sudo
    quotes three times: `sh -c`, `sudo /bin/sh -c`, and its local `ssh ... CMD` run by /bin/sh)."""
    groups: list[list[FactRequest]] = [[]]
    size = 0
    for request in requests:
        length = len(quoted(request.command(), quotes)) + 100
        if groups[-1] and size + length > MAX_COMMAND_CHARS:
            groups.append([])
            size = 0
        groups[-1].append(request)
        size += length
    return [tuple(group) for group in groups if group]


def quoted(command: str, times: int) -> str:
    for _ in range(times):
        command = shlex.quote(command)
    return command


def section_name(index: int) -> str:
    return f"fact-{index}"


class FactBatch(FactBase):
    """
    Several facts in one remote command: ``{"fact-<index>": Section}``.

    + requests: a tuple of ``FactRequest`` (facts/batch.py ``batches`` keeps it small enough)
    """

    def command(self, requests: tuple[FactRequest, ...]) -> str:
        slow = [index for index, request in enumerate(requests) if request.slow]
        lines = ["d=$(mktemp -d) || exit 1"] if slow else []
        lines += [f"{{ {framed(section_name(index), requests[index].command())}; }} >\"$d/{index}\" &"
                  for index in slow]
        lines += [framed(section_name(index), request.command()) for index, request in enumerate(requests)
                  if index not in slow]
        if slow:
            lines += ["wait", "cat \"$d\"/*", "rm -rf \"$d\""]
        return "\n".join([*lines, "true"])

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output) -> dict[str, Section]:
        return split(output)
