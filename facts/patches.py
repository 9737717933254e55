"""The state of servestack's source patches in a Python environment, in one round trip.

Patch sets live in files/patches/<package>/<version>/: NNNN-name.patch files (applied
in name order) and an optional checks.py (see files/patches/sglang/0.5.9/checks.py).
The fact ships servestack/patchlib.py (with servestack/memo.py, which it imports), every set of
the package and the mode to the environment's python as an inline script; the script reads the
installed version, picks that version's set and prints one JSON object (see patchlib.remote_main).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import shlex
import zlib
from pathlib import Path

from pyinfra.api import FactBase

from servestack import memo as memos
from servestack import patchlib

PATCH_ROOT = Path(__file__).resolve().parent.parent / "files" / "patches"
CHECKS_FILE = "checks.py"
SERIES_FILE = "series"
HEREDOC_END = "SERVESTACK_PATCHES_EOF"


def load_patch_sets(package: str, patch_root: str | Path = PATCH_ROOT) -> dict:
    """{version: {"patches": [[name, text], ...], "checks": source or None}} for package.

    A set is its directory's NNNN-*.patch files and checks.py, or, when the directory has a
    `series` file, the files it lists (paths relative to the package directory, one a line):
    a later version reuses the patch files of the version they were written for.
    """
    sets = {}
    package_dir = Path(patch_root) / package
    for set_dir in sorted(p for p in package_dir.glob("*") if p.is_dir()):
        files = _series(set_dir, package_dir) or sorted(set_dir.glob("*.patch")) + [set_dir / CHECKS_FILE]
        patches = [[p.stem, p.read_bytes().decode()] for p in files if p.suffix == ".patch"]
        checks = [p for p in files if p.name == CHECKS_FILE and p.is_file()]
        if patches:
            sets[set_dir.name] = {"patches": patches, "checks": checks[0].read_text() if checks else None}
    return sets


def _series(set_dir: Path, package_dir: Path) -> list[Path]:
    series = set_dir / SERIES_FILE
    if not series.is_file():
        return []
    lines = [line.strip() for line in series.read_text().splitlines()]
    return [package_dir / line for line in lines if line and not line.startswith("#")]


@functools.lru_cache(maxsize=8)
def _packed(text: str) -> str:
    """base64 of zlib-compressed `text` (compressing the engine and sets takes ~7 ms; a run asks
    for the same payload several times per host)."""
    return base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def memo_path(record_path: str) -> str:
    """Where the patches operation keeps the check's memo (servestack/patchlib.py says what it is)."""
    return f"{record_path}.memo"


def remote_command(python: str, mode: str, package: str, record_path: str | None, patch_root: str | Path,
                   memo: bool = True) -> str:
    """The shell command running patchlib.remote_main with the environment's python.

    `python -I -` reads the script from a quoted heredoc: no local paths or environment
    leak in, and the payload needs no shell quoting: the code and patch sets (base64 of
    zlib-compressed JSON, the same for every host, packed once per run) and this call's
    mode and paths (JSON, base64). A missing interpreter prints a sentinel instead of
    failing the command. A check with a record path first tries the memo the patches
    operation kept (see patchlib's memo), unless `memo` is False (verification judges the
    files themselves). The memo is keyed by the digest of both parts as sent.
    """
    shared = _shared_payload(package, str(patch_root))
    own = json.dumps({"mode": mode, "package": package, "record_path": record_path})
    script = "\n".join(
        [
            f"# servestack patches: {mode} {package}",
            "import base64, hashlib, json, sys, types, zlib",
            f"raw = zlib.decompress(base64.b64decode('{_packed(shared)}'))",
            f"own = base64.b64decode('{base64.b64encode(own.encode()).decode()}')",
            "payload = json.loads(raw)",
            "payload.update(json.loads(own))",
            "payload['digest'] = hashlib.sha256(raw + b'\\n' + own).hexdigest()",
            "memo = types.ModuleType('servestack.memo')",  # what the engine imports, from the payload
            "exec(compile(payload['memo'], 'servestack/memo.py', 'exec'), memo.__dict__)",
            "package = types.ModuleType('servestack')",
            "package.__path__, package.memo = [], memo",
            "sys.modules.update({'servestack': package, 'servestack.memo': memo})",
            "engine = types.ModuleType('servestack_patchlib')",
            "sys.modules[engine.__name__] = engine",
            "exec(compile(payload['engine'], 'servestack/patchlib.py', 'exec'), engine.__dict__)",
            "sys.exit(engine.remote_main(payload))",
        ]
    )
    absent = json.dumps({"python": python, "package": package, "installed": False, "python_missing": True})
    py = shlex.quote(python)
    run = f"{py} -I - <<'{HEREDOC_END}'\n{script}\n{HEREDOC_END}\n"
    if mode == "check" and record_path and memo:
        digest = hashlib.sha256(f"{shared}\n{own}".encode()).hexdigest()
        reader = memos.reader(memo_path(record_path), f"{patchlib.MEMO_HEADER} {digest}")
        run = f"if {reader}; then :; else {run}fi\n"
    return f"if [ -x {py} ]; then {run}else echo {shlex.quote(absent)}; fi"


def _shared_payload(package: str, patch_root: str) -> str:
    """The part of the payload every host gets: the package's patch sets, the engine, the memo code."""
    return json.dumps({"sets": load_patch_sets(package, patch_root), "engine": Path(patchlib.__file__).read_text(),
                       "memo": memos.source()})


def memo_write_command(record_path: str, memo: str) -> str:
    """Keep the check's memo beside the record (root's, like the record; see servestack/memo.py)."""
    return memos.write_command(memo_path(record_path), memo)


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
            "site_packages": "/opt/ml-env/lib/python3.12/site-packages",
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
        }

    ``installed`` is False (with ``python_missing`` when there is no interpreter) if
    the package is not installed there.
    """

    probe_background = True  # starts python, unless its memo holds (facts/probe.py)

    def command(
        self,
        python: str,
        package: str = "sglang",
        record_path: str | None = None,
        patch_root: str = str(PATCH_ROOT),
    ) -> str:
        return remote_command(python, "check", package, record_path, patch_root)

    def process(self, output: list) -> dict:
        return json.loads("\n".join(output))
