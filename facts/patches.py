"""The state of servestack's source patches in a Python environment, in one round trip.

Patch sets live in files/patches/<package>/<version>/: NNNN-name.patch files (applied
in name order) and an optional checks.py (see files/patches/sglang/0.5.9/checks.py).
The fact runs servestack/patchlib.py with the environment's python (files/scripts/patch-check.sh,
which carries it: servestack/scripts.py), every set of the package its argument; the engine reads
the installed version, picks that version's set and prints one JSON object as the facts/framing.py
section `patchlib.RESULT` (see patchlib.main).

A set found in place leaves sums beside its record (patchlib `sums_path`): the sha256 of every file
that check read. files/scripts/patch-check.sh confirms them with `sha256sum -c` first and, while
they hold for the engine and set this controller sends, answers from the record (the section
SUMS_HOLD) instead of starting python; anything else runs the full check.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import zlib
from pathlib import Path

from pyinfra.api import FactBase

from facts.framing import split
from servestack import patchlib
from servestack.patchsets import PATCH_ROOT, load_patch_sets
from servestack.scripts import atomic_write_command, script_command, script_text

SCRIPT = "patch-check.sh"
SUMS_HOLD = "sums-hold"  # patch-check.sh's section when the sums hold: python, record path, the record


@functools.lru_cache(maxsize=8)
def _packed(text: str) -> str:
    """base64 of zlib-compressed `text` (a run asks for the same payload several times per host)."""
    return base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def engine_source() -> str:
    """The check's engine, servestack/patchlib.py, as it ships to the host (with the shared host code it
    brings: a change there is a change of the engine)."""
    return script_text(Path(patchlib.__file__))


def set_digests(sets: dict, engine: str) -> dict[str, str]:
    """{version: sha256 of the engine's source and that version's set}, for `load_patch_sets`'
    answer: what judged a set in place."""
    return {version: hashlib.sha256(json.dumps({"engine": engine, "set": patch_set}, sort_keys=True).encode())
            .hexdigest() for version, patch_set in sets.items()}


def remote_command(python: str, mode: str, package: str, record_path: str | None, patch_root: str | Path,
                   quick: bool = True) -> str:
    """The shell command running patchlib.main with the environment's python.

    files/scripts/patch-check.sh runs `python -I -c ENGINE SETS REQUEST`: the patch sets and their
    digests (base64 of zlib-compressed JSON, the same for every host, packed once per run) and this
    call's mode and paths (JSON, base64). A missing interpreter prints `installed: False,
    python_missing: True`. A check with a record path first confirms the sums a set in place left
    (see the module docstring), unless `quick` is False.
    """
    sets = load_patch_sets(package, patch_root)
    digests = set_digests(sets, engine_source())
    shared = json.dumps({"sets": sets, "digests": digests})
    request = json.dumps({"mode": mode, "package": package, "record_path": record_path})
    absent = json.dumps({"python": python, "package": package, "installed": False, "python_missing": True})
    quick = quick and mode == "check" and bool(record_path)
    headers = dict.fromkeys(f"{patchlib.SUMS_HEADER} {digest}" for digest in digests.values())
    env = {"PYTHON": python, "ABSENT": absent, "RECORD": record_path or "",
           "SUMS": patchlib.sums_path(record_path) if quick and record_path else "", "HEADERS": "\n".join(headers)}
    return script_command(SCRIPT, _packed(shared), base64.b64encode(request.encode()).decode(), env=env)


def sums_write_command(record_path: str, sums: str) -> str:
    """Keep the sums of a set found in place beside its record (patchlib `sums_path`)."""
    return atomic_write_command(patchlib.sums_path(record_path), sums)


def from_record(python: str, record_path: str, record: dict) -> dict:
    """The check's answer for a set its sums confirm in place: what the record says."""
    return {
        "python": python, "package": record["package"], "installed": True, "version": record["version"],
        "site_packages": None, "patch_set": record["version"],
        "patches": [{"name": p["name"], "sha256": p["sha256"], "state": p["state"], "conflict": None,
                     "check": "ok", "diff": "", "files": p["files"]} for p in record["patches"]],
        "record_path": record_path, "record": "current", "verified": "sums",
    }


class PatchStates(FactBase):
    """
    Returns the state of servestack's patch set for a package installed in an environment.

    + python: the environment's interpreter, e.g. ``/opt/ml-env/bin/python``
    + package: distribution name; its installed version selects the set
    + record_path: the JSON record to compare with; default ``<sys.prefix>/servestack-patches.json``
    + patch_root: local directory of ``<package>/<version>/`` patch sets

    .. code:: python

        {
            "python": "/opt/ml-env/bin/python", "package": "sglang",
            "installed": True, "version": "0.5.9",
            "site_packages": "/opt/ml-env/lib/python3.12/site-packages",   # None when answered from the record
            "patch_set": "0.5.9",             # None: no set for this version
            "patches": [{
                "name": "0001-sm120-torch-symm-mem", "sha256": "<of the patch file>",
                "state": "applicable",        # applied | applicable | upstream | conflict
                "conflict": None,             # or {"path", "hunk", "header", "reason"}
                "check": "ok",                # or why the patched sources fail their checks
                "diff": "--- a/...",          # for applicable patches
                "files": [{"path", "state", "sha256_before", "sha256"}],
            }],
            "record_path": "...", "record": "current",   # current | stale | missing
            "record_sha256": "...",           # of the record as the set has it once applied (python checked)
            "sums": "...",                    # a set in place, checked by python: its sums to keep
            "verified": "sums",               # instead of "sums": answered from the record, its sums held
        }

    ``installed`` is False (with ``python_missing`` when there is no interpreter) if
    the package is not installed there.
    """

    slow = True  # starts python, unless the sums hold

    def command(
        self,
        python: str,
        package: str = "sglang",
        record_path: str | None = None,
        patch_root: str = str(PATCH_ROOT),
    ) -> str:
        return remote_command(python, "check", package, record_path, patch_root)

    def process(self, output: list) -> dict:
        sections = split(output)
        held = sections.get(SUMS_HOLD)
        if held and len(held.lines) >= 2:
            return from_record(held.lines[0], held.lines[1], json.loads("\n".join(held.lines[2:])))
        return json.loads(sections[patchlib.RESULT].text)
