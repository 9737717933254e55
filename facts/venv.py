"""What the host's ML environment looks like: venv_path, releases, activation history, backups, uv.

One fact, one SSH round trip: the host tool (files/scripts/ml_env.py `state`) prints a JSON object.
It never fails for "absent": a host without the configured python prints nothing (-> None).

Without the packages (what every converge reads), the shell first tries the memo the venv
operations kept in the state dir (servestack/memo.py): while `stat` shows every path the tool read
unchanged, the kept answer is printed and no python starts.
"""

from __future__ import annotations

import hashlib
import json

from pyinfra.api import FactBase

from operations.releases import TOOL, guarded_tool_command
from servestack import memo as memos

MEMO_FILE = "ml-env-state.memo"
MEMO_HEADER = "servestack-ml-env-memo 1"


def memo_path(state_dir: str) -> str:
    """Where the venv operations keep the state's memo."""
    return f"{state_dir.rstrip('/')}/{MEMO_FILE}"


def memo_write_command(state_dir: str, memo: str) -> str:
    """Keep the state's memo in the state dir (see servestack/memo.py)."""
    return memos.write_command(memo_path(state_dir), memo)


def state_command(python: str, params: dict) -> str:
    """The `state` tool command; without packages, answered from the kept memo while it holds.

    The memo is keyed by a digest of everything that shapes the answer besides the host's files:
    the tool's text, the interpreter's name, the params (with servestack/memo.py's text, which the
    tool runs to write the memo). Another servestack version or other settings read afresh.
    """
    if params.get("packages", True):
        return guarded_tool_command(python, "state", params)
    params = {**params, "memo": {"python": python, "lib": memos.source()}}
    text = json.dumps({"tool": TOOL.read_text(), "python": python, "params": params}, sort_keys=True)
    header = f"{MEMO_HEADER} {hashlib.sha256(text.encode()).hexdigest()}"
    params["memo"]["header"] = header  # the memo's first line
    reader = memos.reader(memo_path(params["state_dir"]), header)
    return f"if {reader}; then :; else {guarded_tool_command(python, 'state', params)}\nfi"


class MlEnvState(FactBase):
    """
    Returns a dict (or None when the host lacks ``python``):

    .. code:: python

        {
            "python": {"version": "3.11.2", "executable": "/usr/bin/python3"},
            "machine": "x86_64",
            "venv_path": {"path": "/opt/ml-env", "kind": "missing|link|broken-link|venv|other",
                          "target": ..., "realpath": ..., "release": "r-..." or None},
            "active": {"python": "3.11.2", "prefix": ..., "packages": {"torch": "2.9.1+cu128"}}
                      or {"error": ...} or None (also None with packages=False),
            "releases": {"r-...": {"status": "ok|failed|building|incomplete", "has_venv": True, ...}},
            "history": [{"release": ..., "previous": ..., "by": "deploy|rollback|adopt", "at": ...}],
            "backups": ["20260101T120000Z.json", ...],
            "latest_backup": {...} or None,
            "uv": "0.13.9" or None,
            "memo": "<the memo text>" or None,   # only when packages=False and the host's python answered
        }

    ``memo`` is bookkeeping, not the environment's state: the venv operations keep it on the host
    (operations/venv.py); an answer printed from the kept memo has no ``memo`` key.
    """

    probe_background = True  # starts python, unless its memo holds (facts/probe.py)

    def command(self, venv_path, releases_dir, state_dir, uv, python="python3", packages=True):
        # packages=False skips running the active env's python (the slowest part) when not needed
        params = {"venv_path": venv_path, "releases_dir": releases_dir, "state_dir": state_dir, "uv": uv,
                  "packages": packages}
        return state_command(python, params)

    def process(self, output):
        text = "\n".join(output).strip()
        return json.loads(text) if text else None


class MlEnvBackups(FactBase):
    """
    Summaries of the environment snapshots kept under ``<state_dir>/backups`` (oldest first):

    .. code:: python

        [{"file": ".../20260101T120000Z.json", "timestamp": "20260101T120000Z",
          "venv_path": "/opt/ml-env", "realpath": ..., "release": "r-..." or None,
          "python": "3.11.2", "packages": 143, "torch": "2.9.1+cu128", "reason": "before change"}]
    """

    def command(self, state_dir, python="python3"):
        return guarded_tool_command(python, "backups", {"state_dir": state_dir})

    def process(self, output):
        text = "\n".join(output).strip()
        return json.loads(text)["backups"] if text else []

    def default(self):
        return []
