"""One remote read of a host's state per pyinfra stage, shared by every step (issue 8).

pyinfra 3.10 runs every fact an operation asks for as its own remote command, again for every
operation and again in each stage (prepare, execute). Here the steps ask `probe.fact(host, Fact,
**kwargs)` instead of `host.get_fact(Fact, **kwargs)`: the first read of a stage runs, in ONE
remote command (facts.probe.HostProbe), the requested fact plus every fact the steps declared they
will read (`expects`), each with its own command and parser; later reads come from the cache.

- Stages: the execute stage starts from what prepare read (`_seed`), except the verification
  probes, which judge the host as it is when the verify step runs. Nothing executes at prepare,
  so everything it read is the host's state before this run changes it: what execute would read
  first. Another run could change the host in between; it would take the host's lock to do so,
  and the lock counts its takes (facts/host.py): when the take this run makes (preflight's
  `host_ready`, before any step changes anything) is not the next one after what prepare read,
  every read is dropped and made again.
- Changes: an operation that yielded commands calls `changed(host, *facts)` after its last
  `yield` (at execute that code runs once the commands have run; at prepare nothing ran, and
  nothing is dropped); those facts are dropped and the
  next reader re-reads them, together with any other dropped or not yet read expected fact, in one
  command. The verification checks' facts are dropped on every change, and once the host changed
  in a stage they are no longer read ahead (the verify step reads them itself, once).
- A fact whose command fails inside the probe is read again on its own with `host.get_fact`, so
  pyinfra's own error handling applies exactly as before.
- The lock's take (`run_and_read_ahead`) carries the execute stage's read-ahead in the same remote
  command: the host is read under this run's lock, for one command fewer per host.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from weakref import WeakKeyDictionary

from facts.probe import FactRequest, HostProbe, ProbeRequest, split_probe_output, split_requests
from servestack.hostrun import run_remote
from servestack.settings import real_host

# Between a command's own output and the read-ahead's (`run_and_read_ahead`).
AHEAD = "@@probe-ahead"

# Steps declare the facts they read: provider(host) -> [FactRequest]; evaluated at each read-ahead.
_PROVIDERS: list[Callable] = []
# Facts read ahead only while the host has not changed in the stage (the verification probes).
_VOLATILE: set[type] = set()
# Facts read outside operations by deploy functions (see `decides`).
_DECIDING: set[type] = set()
_CACHE: "WeakKeyDictionary" = WeakKeyDictionary()   # state -> {(host, executing): _Stage}


class _Stage:
    def __init__(self):
        self.values: dict[str, object] = {}   # fact key -> its value, frozen (`_freeze`)
        self.dirty = False          # something changed on the host in this stage
        self.reads = 0              # HostProbe commands issued (for tests and the benchmark)


class _Held:
    """A value pickle cannot copy, kept as it is (`_thaw` deep-copies it)."""

    def __init__(self, value):
        self.value = value


def _freeze(value):
    """Values are kept pickled, so that every reader gets a copy of its own to change as it likes,
    for a third of what deepcopy of the cached value costs (a fleet's controller makes ~45 reads
    per host and run)."""
    try:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return _Held(value)


def _thaw(frozen):
    return copy.deepcopy(frozen.value) if isinstance(frozen, _Held) else pickle.loads(frozen)


def decides(*classes: type) -> None:
    """Declare facts read at prepare even under `pyinfra -y`, where operations are not run: those
    deploy functions read outside operations to decide what to add, and those a step reads at
    execute before preflight takes the lock (the take reads the rest, `run_and_read_ahead`)."""
    _DECIDING.update(classes)


def expects(provider: Callable, volatile: tuple[type, ...] = ()) -> Callable:
    """Register `provider(host) -> [FactRequest]`: facts a step will read (usable as a decorator)."""
    _PROVIDERS.append(provider)
    _VOLATILE.update(volatile)
    return provider


def _stage(host) -> _Stage:
    state = host.state
    stages = _CACHE.setdefault(state, {})
    key = (host.name, bool(state.is_executing))
    if key not in stages:
        stages[key] = _Stage()
        prepared = stages.get((host.name, False))
        if state.is_executing and prepared is not None:
            _seed(stages[key], prepared)
    return stages[key]


def _seed(executing: _Stage, prepared: _Stage) -> None:
    """The execute stage starts from prepare's reads, but for the volatile facts (see the top)."""
    executing.values = {name: value for name, value in prepared.values.items() if not _is_volatile(name)}


def _of_class(key: str, cls: type) -> bool:
    return key.startswith(f"{cls.__module__}.{cls.__name__}(")


def _is_volatile(key: str) -> bool:
    return any(_of_class(key, cls) for cls in _VOLATILE)


def _expected(host, stage: _Stage) -> list[FactRequest]:
    requests = []
    for provider in _PROVIDERS:
        try:
            requests += provider(host) or []
        except Exception:  # a provider that cannot predict yet (e.g. no release known): read on demand
            continue
    if stage.dirty:
        requests = [request for request in requests if request.cls not in _VOLATILE]
    if not _operations_run(host):
        requests = [request for request in requests if request.cls in _DECIDING]
    return requests


def _operations_run(host) -> bool:
    """False at prepare under `pyinfra -y` (no change detection): operations do not run there,
    so only the facts the deploy functions decide on are read ahead."""
    state = host.state
    return bool(state.is_executing or state.should_check_for_changes())


def fact(host, cls: type, **kwargs):
    """`host.get_fact(cls, **kwargs)`, answered from this stage's probe of the host."""
    return facts(host, [FactRequest.of(cls, **kwargs)])[0]


def facts(host, wanted: list[FactRequest]) -> list:
    """Several facts' values; those this stage has not read yet are read in one probe command."""
    target = real_host(host)
    stage = _stage(target)
    missing = [request for request in wanted if request.key not in stage.values]
    if missing:
        _read(target, stage, missing)
    values = []
    for request in wanted:
        if request.key in stage.values:
            values.append(_thaw(stage.values[request.key]))
        else:  # its command failed in the probe: pyinfra's own handling
            values.append(target.get_fact(request.cls, **dict(request.kwargs)))
    return values


def cached(host, cls: type, **kwargs):
    """The fact's value if this stage already read it, else None (never reads the host)."""
    stage = _stage(real_host(host))
    value = stage.values.get(FactRequest.of(cls, **kwargs).key)
    return None if value is None else _thaw(value)


def _batches(host) -> bool:
    """pyinfra's @fake connector runs no shell and answers each command by a canned response
    (unit tests): there, facts are read one by one, as `get_fact` does, and still cached."""
    return type(host.connector).__name__ != "FakeConnector"


def _read(host, stage: _Stage, wanted: list[FactRequest]) -> None:
    if not _batches(host):
        for request in wanted:
            stage.values[request.key] = _freeze(host.get_fact(request.cls, **dict(request.kwargs)))
        return
    for request in _requests(host, stage, wanted):
        stage.reads += 1
        _store(stage, request, host.get_fact(HostProbe, request=request))


def _requests(host, stage: _Stage, wanted: list[FactRequest]) -> list[ProbeRequest]:
    """`wanted` and every expected fact this stage has not read, in as few commands as fit."""
    batch = {request.key: request for request in wanted}
    for request in _expected(host, stage):
        if request.key not in stage.values:
            batch.setdefault(request.key, request)
    return split_requests(list(batch.values()))


def _store(stage: _Stage, request: ProbeRequest, results: dict) -> None:
    for index, one in enumerate(request.facts):
        rc, lines = results.get(index, (None, []))
        if rc == 0 and lines != [_missing_marker()]:
            stage.values[one.key] = _freeze(one.value(lines))


def run_and_read_ahead(host, command: str) -> tuple[bool, list[str], list[str]]:
    """Run `command` now (`hostrun.run_remote`: the lock's take) and, once it succeeded, in the same
    remote command, the read-ahead this stage would make at its next read; (ok, stdout, stderr)
    of `command` alone. Whatever else the read needs (a probe too large for one command) waits
    for the next read, as does all of it when `command` fails."""
    target = real_host(host)
    stage = _stage(target)
    requests = _requests(target, stage, []) if _batches(target) else []
    if not requests:
        return run_remote(target, command)
    # the command's exit status is the take's: the read's own failures are the facts' (read alone later)
    both = f"( {command}\n) || exit $?\necho '{AHEAD}'\n( {requests[0].command()}\n)\nexit 0"
    ok, stdout, stderr = run_remote(target, both)
    if AHEAD not in stdout:
        return ok, stdout, stderr
    cut = stdout.index(AHEAD)
    stage.reads += 1
    _store(stage, requests[0], split_probe_output(stdout[cut + 1:]))
    return ok, stdout[:cut], stderr


def _missing_marker() -> str:
    from pyinfra.api.facts import _MISSING_COMMAND_MARKER
    return _MISSING_COMMAND_MARKER


def changed(host, *classes: type) -> None:
    """After an operation's commands ran: forget `classes` (every fact when none is named).

    At prepare, nothing ran (pyinfra only collects the commands): the host is still as read, and
    reading it again would cost a remote command for the same answer."""
    target = real_host(host)
    if not target.state.is_executing:
        return
    stage = _stage(target)
    stage.dirty = True
    for key in list(stage.values):
        if not classes or _is_volatile(key) or any(_of_class(key, cls) for cls in classes):
            del stage.values[key]


def reads(host) -> int:
    """How many probe commands this stage issued on the host so far."""
    return _stage(real_host(host)).reads
