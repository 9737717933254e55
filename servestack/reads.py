"""Facts read once per stage and host, and read again once an operation has changed the host.

pyinfra 3.10 runs every fact an operation asks for as a remote command of its own, in each stage
(prepare, execute). Operations here ask `reads.fact(host, Fact, **kwargs)`, pyinfra's
`host.get_fact(Fact, **kwargs)` with a memory:

- a value read in this stage is answered again, until an operation of this run has changed the
  host (pyinfra counts it: an operation that ran commands); the next read is then a new read. At
  prepare nothing runs, so everything read there is the host before this run;
- `read(host, requests)` reads several facts in ONE remote command (facts/batch.py): deploy.py
  lists what its steps read and has it read once at prepare and once at execute, right after
  the host's lock is taken (operations/preflight.py);
- a fact of the hardware (a class attribute `once_per_run = True`: the GPUs and their driver,
  which no step changes) read at prepare is answered from there at execute too: nvidia-smi is
  the slowest read of a real host;
- every reader gets a copy of its own (some change what they get);
- a fact whose command fails in a batch is read again on its own with `host.get_fact`, so
  pyinfra's own error handling applies.

Operations read before they yield: a read after an operation's own commands ran, inside the same
operation, would be answered from before them. Code that runs at execute after commands (a
FunctionCommand) reads with `host.get_fact` itself.
"""

from __future__ import annotations

import copy
from weakref import WeakKeyDictionary

from facts.batch import FactBatch, FactRequest, Unread, batches, section_name
from facts.framing import Section
from servestack.hostrun import real_host

_CUT = Section(None, ())   # a section missing from the output
_READS: "WeakKeyDictionary" = WeakKeyDictionary()   # State -> {(host name, executing): _Stage}


class _Stage:
    def __init__(self, changes: int):
        self.changes = changes          # operations that had changed the host when these were read
        self.values: dict[str, object] = {}
        self.commands = 0               # FactBatch commands issued (tests and bench/ count them)


def changes_so_far(host) -> int:
    """How many of this run's operations changed the host (ran commands) so far."""
    state = host.state
    count = 0
    for op_hash in state.ops.get(host, {}):
        meta = state.get_op_data_for_host(host, op_hash).operation_meta
        if meta.is_complete() and meta.did_change():
            count += 1
    return count


def _stage(host) -> _Stage:
    stages = _READS.setdefault(host.state, {})
    key = (host.name, bool(host.state.is_executing))
    changes = changes_so_far(host) if host.state.is_executing else 0
    if key not in stages or stages[key].changes != changes:
        kept = stages[key].commands if key in stages else 0
        stages[key] = _Stage(changes)
        stages[key].commands = kept
    return stages[key]


def fact(host, cls: type, **kwargs):
    """`host.get_fact(cls, **kwargs)`, unless this stage read it already (and nothing changed since)."""
    return read(host, [FactRequest.of(cls, **kwargs)])[0]


def read(host, requests: list[FactRequest]) -> list:
    """The requests' values; those not read in this stage yet are read in one remote command."""
    target = real_host(host)
    stage = _stage(target)
    _carry_from_prepare(target, stage, requests)
    missing = list({request.key: request for request in requests if request.key not in stage.values}.values())
    if missing:
        _read_into(target, stage, missing)
    return [copy.deepcopy(stage.values[request.key]) for request in requests]


def _carry_from_prepare(host, stage: _Stage, requests: list[FactRequest]) -> None:
    """At execute, what prepare read of the hardware (`once_per_run` facts)."""
    if not host.state.is_executing:
        return
    prepared = _READS.get(host.state, {}).get((host.name, False))
    for request in requests:
        if getattr(request.cls, "once_per_run", False) and prepared and request.key in prepared.values:
            stage.values.setdefault(request.key, prepared.values[request.key])


def _read_into(host, stage: _Stage, requests: list[FactRequest]) -> None:
    if not _batches(host):
        for request in requests:
            stage.values[request.key] = host.get_fact(request.cls, **dict(request.kwargs))
        return
    for group in batches(requests):
        stage.commands += 1
        sections = host.get_fact(FactBatch, requests=group)
        for index, request in enumerate(group):
            try:
                stage.values[request.key] = request.value(sections.get(section_name(index), _CUT))
            except Unread:
                stage.values[request.key] = host.get_fact(request.cls, **dict(request.kwargs))


def _batches(host) -> bool:
    """pyinfra's @fake connector (unit tests) answers each fact's own command by a canned response:
    there facts are read one by one, as `host.get_fact` does."""
    return type(host.connector).__name__ != "FakeConnector"


def commands(host) -> int:
    """How many batched reads this stage made on the host so far."""
    return _stage(real_host(host)).commands

