"""servestack.argcache: pyinfra's global argument list is computed once and stays the same list."""

import typing

from pyinfra.api import arguments, facts

from servestack.argcache import cache_global_arguments


def test_global_arguments_are_computed_once_and_unchanged(monkeypatch):
    monkeypatch.setattr(arguments, "all_global_arguments", arguments.all_global_arguments)  # restored after
    monkeypatch.setattr(facts, "all_global_arguments", facts.all_global_arguments)
    expected = arguments.all_global_arguments()
    hints = []
    real = typing.get_type_hints
    monkeypatch.setattr(arguments, "get_type_hints", lambda *a, **k: hints.append(a) or real(*a, **k))

    cache_global_arguments()
    cache_global_arguments()  # idempotent: not a cache of the cache
    first, second = arguments.all_global_arguments(), facts.all_global_arguments()
    assert first == second == expected and first is not second
    first.clear()  # a caller changing its list changes nobody else's
    assert arguments.all_global_arguments() == expected
    assert len(hints) == 1


def test_pop_global_arguments_still_reads_host_data_and_kwargs(monkeypatch):
    monkeypatch.setattr(arguments, "all_global_arguments", arguments.all_global_arguments)
    monkeypatch.setattr(facts, "all_global_arguments", facts.all_global_arguments)
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory((["h1"], {}), )
    state = State(inventory, Config())
    host = inventory.get_host("h1")
    before = arguments.pop_global_arguments(state, host, {"_sudo": True, "other": 1})
    cache_global_arguments()
    kwargs = {"_sudo": True, "other": 1}
    after = arguments.pop_global_arguments(state, host, kwargs)
    assert after == before and kwargs == {"other": 1}
