"""servestack.argcache: pyinfra's global argument list is computed once and stays the same list."""

import typing

import pytest
from pyinfra.api import arguments, facts

from servestack import argcache
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


@pytest.fixture
def restored(monkeypatch):
    """Every module's pop_global_arguments / all_global_arguments put back after the test."""
    for module in argcache._USERS:
        monkeypatch.setattr(module, "pop_global_arguments", module.pop_global_arguments)
    monkeypatch.setattr(arguments, "all_global_arguments", arguments.all_global_arguments)
    monkeypatch.setattr(facts, "all_global_arguments", facts.all_global_arguments)


def fleet():
    """Two hosts whose data sets global arguments at every level pyinfra reads them from."""
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory(
        (["plain", ("own", {"_sudo": True, "_sudo_user": "svc", "x": 1})], {"_timeout": 30}),
        gpus=(["own", "plain"], {"_retries": 2, "_sudo_user": "group-user"}),
        override_data={"_shell_executable": "bash"},
    )
    return State(inventory, Config()), inventory


def every_reading(state, inventory) -> list:
    from pyinfra.context import ctx_state

    results = []
    with ctx_state.use(state):
        for name in ("plain", "own"):
            target = inventory.get_host(name)
            for kwargs in ({}, {"_sudo": False, "_env": {"A": "1"}, "other": 1}, {"_retries": 5}):
                given = dict(kwargs)
                results.append((name, arguments.pop_global_arguments(state, target, given), given))
            target.data.x_override = "set during the run"
            target.data._sudo_password = "changed during the run"   # read back from then on
            results.append((name, arguments.pop_global_arguments(state, target, {}), {}))
            target.current_deploy_kwargs = {"_timeout": 99}
            target.current_deploy_data = {"_get_pty": True}         # a @deploy's data defaults
            results.append((name, arguments.pop_global_arguments(state, target, {}), {}))
    return results


def test_fast_host_defaults_reads_every_level_as_pyinfra_does(restored):
    before = every_reading(*fleet())
    assert argcache.fast_host_defaults() and argcache.fast_host_defaults()  # installed, idempotent
    assert all(module.pop_global_arguments is argcache.pop_global_arguments for module in argcache._USERS)
    after = every_reading(*fleet())
    assert after == before
    values = {name: found for name, (found, _), _ in before[:1] + before[5:6]}
    assert values["plain"]["_timeout"] == 30 and values["plain"]["_sudo_user"] == "group-user"
    assert values["own"]["_sudo"] is True and values["own"]["_sudo_user"] == "svc"
    assert values["own"]["_shell_executable"] == "bash" and values["own"]["_retries"] == 2


def test_fast_host_defaults_leaves_other_pyinfra_code_alone(restored, monkeypatch):
    monkeypatch.setitem(argcache.REPLACED_SOURCES, "pop_global_arguments", "0" * 64)
    original = arguments.pop_global_arguments
    assert not argcache.fast_host_defaults()
    assert all(module.pop_global_arguments is original for module in argcache._USERS)
