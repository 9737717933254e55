"""servestack's source patch sets, read from files/patches/<package>/<version>/.

A set is its directory's NNNN-name.patch files (applied in name order) and an optional checks.py,
or, when the directory has a `series` file, the files it lists. facts/patches.py ships them to a
host's environment; profiles.py checks that a profile's patches are in the set for its stack.
"""

from __future__ import annotations

from pathlib import Path

PATCH_ROOT = Path(__file__).resolve().parent.parent / "files" / "patches"
CHECKS_FILE = "checks.py"
SERIES_FILE = "series"


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
