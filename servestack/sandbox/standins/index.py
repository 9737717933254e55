"""PEP 503 "simple" package indexes laid out as static files (served by artifacts.py or as file://).

`write_simple_index(root, wheels)` copies each wheel to `root/<project>/<file>` and writes
`root/<project>/index.html` linking every file with a `#sha256=` fragment (URL-quoted, so
`+cu130` becomes `%2Bcu130` as on download.pytorch.org), plus `root/index.html` listing projects.
"""

from __future__ import annotations

import hashlib
import html
import re
import shutil
from pathlib import Path
from urllib.parse import quote


def normalize_project(name: str) -> str:
    """PEP 503 normalized project name ('Flashinfer_Python' -> 'flashinfer-python')."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    """Normalized project name of a wheel file, from its file name."""
    return normalize_project(Path(wheel).name.split("-", 1)[0])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _page(title: str, links: list[tuple[str, str]]) -> str:
    anchors = "".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br/>\n' for href, text in links)
    return (f"<!DOCTYPE html>\n<html>\n  <head><title>{html.escape(title)}</title></head>\n"
            f"  <body>\n    <h1>{html.escape(title)}</h1>\n{anchors}  </body>\n</html>\n")


def _place(wheel: Path, directory: Path) -> Path:
    """Hard-link (or copy) `wheel` into `directory`."""
    target = directory / wheel.name
    if target.exists():
        target.unlink()
    try:
        target.hardlink_to(wheel)
    except OSError:
        shutil.copy2(wheel, target)
    return target


def write_simple_index(root: Path, wheels: list[Path]) -> Path:
    """Lay out a PEP 503 index of `wheels` at `root` (added to what is there); return `root`."""
    root = Path(root)
    for wheel in wheels:
        directory = root / project_of(wheel)
        directory.mkdir(parents=True, exist_ok=True)
        _place(Path(wheel), directory)
    projects = sorted(path.name for path in root.iterdir() if path.is_dir())
    for project in projects:
        files = sorted(path for path in (root / project).iterdir() if path.suffix == ".whl")
        links = [(f"{quote(file.name)}#sha256={sha256_of(file)}", file.name) for file in files]
        (root / project / "index.html").write_text(_page(f"Links for {project}", links))
    (root / "index.html").write_text(_page("Simple index", [(f"{project}/", project) for project in projects]))
    return root
