"""What the host holds of the model weights it serves: the weights step's records, and (when a download
is due) what the Hub lists that the host lacks.

`WeightsRecords` is a `cat` of small files, cheap enough for every converge's batched read;
`WeightsPlan` asks the Hub (files/scripts/stage-weights.py `plan`, the host's python, standard
library only) and is read only when a record is missing or stale.
"""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

from servestack.scripts import python_script_command

SCRIPT = "stage-weights.py"
RECORD_MARK = "@@servestack weights-record "


class WeightsRecords(FactBase):
    """
    ``{record path: the weights step's record (a dict) or None}`` for each path.

    + paths: the records' files (``paths.weights_record_path``)
    """

    def command(self, paths: tuple[str, ...]) -> str:
        quoted = " ".join(shlex.quote(path) for path in paths)
        return f'for f in {quoted}; do echo "{RECORD_MARK}$f"; cat -- "$f" 2>/dev/null; echo; done'

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output) -> dict[str, dict | None]:
        records: dict[str, list[str]] = {}
        current = None
        for line in output:
            if line.startswith(RECORD_MARK):
                current = line[len(RECORD_MARK):]
                records[current] = []
            elif current is not None:
                records[current].append(line)
        return {path: _record("\n".join(lines)) for path, lines in records.items()}


def _record(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


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
