"""pyinfra's list of global operation arguments, computed once per process (config.py calls it).

`pyinfra.api.arguments.pop_global_arguments` runs for every operation and fact call on every host,
and each time asks `all_global_arguments()`, which evaluates `typing.get_type_hints` over
pyinfra's argument classes (~0.35 ms; ~27 calls per host and stage here). The answer is fixed by
pyinfra's own code, so it is computed once; callers still get a fresh list each time.
"""

from __future__ import annotations

import functools

from pyinfra.api import arguments, facts

_MARK = "_servestack_cached"


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
