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

`use_frame_order` goes further for pyinfra's ordering itself: the same line numbers read from the
frames (`f_code.co_filename`, `f_lineno`: what `getframeinfo` reports for a frame of a source
file) without `inspect.stack()`, which also stats and reads every frame's source file (~1.5 ms per
operation call with pyinfra's ~40-frame stacks, ~20 ms of the controller's CPU per host).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import types

import pyinfra
from pyinfra.api.util import PYINFRA_INSTALL_DIR


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


def operation_order(state) -> list[int]:
    """`pyinfra.api.util.get_operation_order_from_stack(state)`, the same list, from the frames."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first, as pyinfra walks `reversed(inspect.stack())`
    start = 0
    if state.current_deploy_filename:
        # as pyinfra's loop: from the deploy file's first frame; when it is not on the stack, from
        # pyinfra's innermost frame (its own, which it skips): no frame
        start = next((index for index, frame in enumerate(frames)
                      if frame.f_code.co_filename == state.current_deploy_filename), len(frames))
    line_numbers = [state.current_op_file_number] if pyinfra.is_cli else []
    line_numbers += [frame.f_lineno for frame in frames[start:]
                     if not frame.f_code.co_filename.startswith(PYINFRA_INSTALL_DIR)]
    return line_numbers


def use_frame_order() -> None:
    """Make pyinfra order operations with `operation_order` (idempotent; config.py calls it)."""
    # the module (`pyinfra.api.operation` as an attribute is the decorator of that name)
    importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack = operation_order
