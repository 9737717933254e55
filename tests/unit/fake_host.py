"""Operation tests through pyinfra's @fake connector, with the commands a test is about really run here."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.connectors.fake import FakeConnector
from pyinfra.connectors.util import CommandOutput, OutputLine


def fake_state(data: dict, config: Config | None = None, **options) -> State:
    """A connected State of one @fake host, `@fake/gpu1`, with host `data` (`options`: State's)."""
    inventory = Inventory((["@fake/gpu1"], {"fake_delay": 0, "fake_delay_jitter": 0, **data}))
    state = State(inventory, config or Config(), **options)
    state.print_noop_info = True
    connect_all(state)
    return state


def run_here(monkeypatch, ours: Callable[[str], bool], run: Callable[[str], subprocess.CompletedProcess]) -> None:
    """Commands `ours` picks are run by `run` (their output and status are the host's); the fake
    connector answers the others."""
    fake_lookup = FakeConnector._lookup_response

    def lookup(self, command):
        if not ours(command):
            return fake_lookup(self, command)
        result = run(command)
        lines = [OutputLine("stdout", line) for line in result.stdout.splitlines()]
        lines += [OutputLine("stderr", line) for line in result.stderr.splitlines()]
        return result.returncode == 0, CommandOutput(lines)

    monkeypatch.setattr(FakeConnector, "_lookup_response", lookup)


def read_keys(monkeypatch) -> list[str]:
    """The key of every `reads.fact` the code under test makes from now on (to compare with what a
    step's `host_reads` lists)."""
    from facts.batch import FactRequest
    from servestack import reads

    keys = []
    real = reads.fact

    def fact(host, cls, **kwargs):
        keys.append(FactRequest.of(cls, **kwargs).key)
        return real(host, cls, **kwargs)

    monkeypatch.setattr(reads, "fact", fact)
    return keys
