"""What the Hub lists of the model weights a host serves that the host lacks (the weights step's records
are read with facts/service.py `ServiceRecord`, one small `cat` each in every converge's batched read).

`WeightsPlan` asks the Hub (files/scripts/stage-weights.py `plan`, the host's python, standard
library only) and is read only when a record is missing or stale.
"""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

from servestack.scripts import python_script_command

SCRIPT = "stage-weights.py"


class WeightsPlan(FactBase):
    """
    What the Hub lists for each model and the host lacks (stage-weights.py `plan`'s JSON), or None when
    the host has no ``python``.

    + python: the host's interpreter (``venv_python``)
    + params: the script's PARAMS, a JSON text (endpoint, models_dir, models)
    """

    slow = True   # an HTTP request to the Hub

    def command(self, python: str, params: str) -> str:
        run = python_script_command(python, SCRIPT, "plan", params, site=False)
        return f"if command -v {shlex.quote(python)} >/dev/null 2>&1; then {run}; fi"

    def process(self, output):
        try:
            return json.loads(output[-1]) if output else None
        except ValueError:
            return None
