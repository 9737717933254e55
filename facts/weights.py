"""What the Hub lists of the model weights a host serves that the host lacks (the weights step's records
are read with facts/service.py `ServiceRecord`, one small `cat` each in every converge's batched read).

`WeightsPlan` asks the Hub (files/scripts/stage-weights.py `plan`, the host's python, standard
library only) and is read only when a record is missing or stale. `StagedRevisions` lists every
revision staged on the host with its record (what the prune decides from and `servestack status` shows).
"""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

from facts.framing import split
from facts.service import parse_record
from servestack.scripts import python_script_command

SCRIPT = "stage-weights.py"
PLAN = "plan"   # the section its `plan` prints the plan in (facts/framing.py)


class WeightsPlan(FactBase):
    """
    What the Hub lists for each model and the host lacks (stage-weights.py `plan`'s section), or None when
    the host has no ``python``.

    + python: the host's interpreter (``venv_python``)
    + params: the script's PARAMS, a JSON text (endpoint, models_dir, models)
    """

    slow = True   # an HTTP request to the Hub

    def command(self, python: str, params: str) -> str:
        run = python_script_command(python, SCRIPT, "plan", params, site=False)
        return f"if command -v {shlex.quote(python)} >/dev/null 2>&1; then {run}; fi"

    def process(self, output):
        found = split(output).get(PLAN)
        try:
            return json.loads(found.text) if found else None
        except ValueError:
            return None



class StagedRevisions(FactBase):
    """
    Every revision the weights step staged under the models directory (``<dir>/<org>--<name>/<40 hex>``): a list
    of {"dir", "present", "record": dict | None}, by path. ``present``: the directory is there (a record without
    one: a pre-staged copy's, whose directory is elsewhere, or a directory removed by hand); ``record``: the
    step's record beside it (None: a download that never finished). Shell builtins only (a record is one
    line): it is in every converge's batched read, and in `servestack status`'s.

    + models_dir: ``service_models_dir``
    """

    def command(self, models_dir: str) -> str:
        return (f"for f in {shlex.quote(models_dir.rstrip('/') or '/')}/*--*/*; do "
                'd=${f%.verified.json}; n=${d##*/}; [ ${#n} -eq 40 ] || continue; '
                'case $n in *[!0-9a-f]*) continue ;; esac; '
                'if [ -d "$d" ] && [ ! -L "$d" ]; then [ "$d" = "$f" ] || continue; p=1; '
                'else [ "$d" != "$f" ] || continue; p=0; fi; '
                'r=; [ -f "$d.verified.json" ] && IFS= read -r r < "$d.verified.json"; '
                'printf \'%s\\t%s\\t%s\\n\' "$d" "$p" "$r"; done')

    @staticmethod
    def default() -> list:
        return []   # no output: nothing staged

    def process(self, output):
        staged = []
        for line in output:
            path, _, rest = line.partition("\t")
            present, _, text = rest.partition("\t")
            if path:
                staged.append({"dir": path, "present": present == "1",
                               "record": parse_record([text]) if text else None})
        return sorted(staged, key=lambda entry: entry["dir"])
