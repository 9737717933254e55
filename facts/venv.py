"""What the host's ML environment looks like: venv_path, releases, activation history, backups, uv.

One fact, one SSH round trip: the host tool (files/scripts/ml_env.py `state`) prints a JSON object.
It never fails for "absent": a host without the configured python prints nothing (-> None).
"""

from __future__ import annotations

import json

from pyinfra.api import FactBase

from operations.releases import guarded_tool_command


class MlEnvState(FactBase):
    """
    Returns a dict (or None when the host lacks ``python``):

    + venv_path: the environment's path (``venv_path``), a link to the active release's venv
    + releases_dir: where the releases are kept (``venv_releases_dir``)
    + state_dir: servestack's state directory (activation history, backups)
    + uv: servestack's own uv binary (its version is reported)
    + python: the host's interpreter that runs the tool (``venv_python``)
    + packages: also list the active environment's packages (runs its python: slower)

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
        }
    """

    slow = True  # starts python

    def command(self, venv_path, releases_dir, state_dir, uv, python="python3", packages=True):
        params = {"venv_path": venv_path, "releases_dir": releases_dir, "state_dir": state_dir, "uv": uv,
                  "packages": packages}
        return guarded_tool_command(python, "state", params)

    def process(self, output):
        text = "\n".join(output).strip()
        return json.loads(text) if text else None


class MlEnvBackups(FactBase):
    """
    Summaries of the environment snapshots kept under ``<state_dir>/backups`` (oldest first):

    + state_dir: servestack's state directory
    + python: the host's interpreter that runs the tool (``venv_python``)

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
