"""Cheaper global operation arguments for pyinfra 3.10 (config.py calls both functions).

`pyinfra.api.arguments.pop_global_arguments` runs for every operation and fact call on every host
(~27 calls per host and stage here), a large share of the controller's work per host:

- each call asks `all_global_arguments()`, which evaluates `typing.get_type_hints` over pyinfra's
  argument classes (~0.35 ms). The answer is fixed by pyinfra's own code, so `cache_global_arguments`
  computes it once; callers still get a fresh list each time.
- each call looks every global argument (~32) up in `host.data`, and a lookup that finds nothing
  (nearly all of them) walks the host's six data sources, calling each source's function and
  raising a KeyError per source, then an AttributeError (a call took 275 us, 87 us with
  this; measured on the sandbox inventory). `fast_host_defaults`
  makes each call evaluate the six sources once and look every argument up in them, in
  `HostData`'s own order with its own copy: the same values, from the data as it is at that call.

The second depends on pyinfra's code, so it is applied only while the functions it replaces are
the ones it was written for (their source's sha256); otherwise pyinfra is left as it is.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from copy import copy

from pyinfra.api import arguments, facts
from pyinfra.api import host as host_api

_MARK = "_servestack_cached"
# sha256 of the sources `fast_host_defaults` stands in for (pyinfra 3.10.0).
REPLACED_SOURCES = {
    "pop_global_arguments": "a12a311539ff5068152b1c9c4578d77a8a893239a570f912768050a623069faf",
    "HostData.__getattr__": "87152f64f2a65e537473f169b0cfa4e0c39547ee4054d73bad6bbf97af313433",
}
# Modules that imported pop_global_arguments by name (pyinfra.api's `deploy` and `operation` names are
# the decorators, hence import_module).
_USERS = tuple(importlib.import_module(f"pyinfra.api.{name}") for name in ("arguments", "deploy", "facts", "operation"))


def cache_global_arguments() -> None:
    """Replace `all_global_arguments` where pyinfra looks it up with a cached copy (idempotent)."""
    if getattr(arguments.all_global_arguments, _MARK, False):
        return
    original = arguments.all_global_arguments
    computed = functools.cache(lambda: tuple(original()))

    def all_global_arguments() -> list[tuple[str, type]]:
        return list(computed())

    all_global_arguments.__doc__ = original.__doc__
    setattr(all_global_arguments, _MARK, True)
    arguments.all_global_arguments = all_global_arguments
    facts.all_global_arguments = all_global_arguments


def _source_sha256(function) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def replaceable() -> bool:
    """Whether pyinfra's functions are still the ones `pop_global_arguments` below mirrors."""
    original = getattr(arguments.pop_global_arguments, "__wrapped__", arguments.pop_global_arguments)
    return (_source_sha256(original) == REPLACED_SOURCES["pop_global_arguments"]
            and _source_sha256(host_api.HostData.__getattr__) == REPLACED_SOURCES["HostData.__getattr__"])


def _host_data_lookup(target):
    """`getattr(target.data, key, default_sentinel)` for many keys, the data sources evaluated once."""
    sources = list(host_api.extract_callable_datas(target.data.datas))

    def lookup(key):
        for data in sources:
            try:
                return copy(data[key])
            except KeyError:
                pass
        return arguments.default_sentinel

    return lookup


def pop_global_arguments(state, host, kwargs):
    """pyinfra 3.10's `pop_global_arguments`, its host data read through `_host_data_lookup`."""
    config = state.config
    if arguments.ctx_config.isset():
        config = arguments.ctx_config.get()
        assert config is not None

    cdkwargs = host.current_deploy_kwargs
    meta_kwargs = cdkwargs or {}
    host_data = _host_data_lookup(host)

    found = {}
    found_keys = []
    for key, type_ in arguments.all_global_arguments():
        argument_meta = arguments.all_argument_meta[key]
        handler = argument_meta.handler
        default = argument_meta.default(config)

        host_default = host_data(key)
        if host_default is not arguments.default_sentinel:
            default = host_default

        if key in kwargs:
            found_keys.append(key)
            value = kwargs.pop(key)
        else:
            value = meta_kwargs.get(key, default)

        if handler:
            value = handler(config, value)

        if value != default:
            arguments.raise_if_bad_type(value, type_, arguments.ArgumentTypeError, f"Invalid argument `{key}`:")

        found[key] = value
    return found, found_keys


def fast_host_defaults() -> bool:
    """Install `pop_global_arguments` above where pyinfra calls it (idempotent); False, changing
    nothing, when pyinfra's code is not what it mirrors."""
    if arguments.pop_global_arguments is pop_global_arguments:
        return True
    if not replaceable():
        return False
    pop_global_arguments.__wrapped__ = arguments.pop_global_arguments
    for module in _USERS:
        module.pop_global_arguments = pop_global_arguments
    return True
