"""PEP 503 "simple" package indexes laid out as static files (served by artifacts.py or as file://).

`write_simple_index(root, wheels)` copies each wheel to `root/<project>/<file>` and writes
`root/<project>/index.html` linking every file with a `#sha256=` fragment (URL-quoted, so
`+cu130` becomes `%2Bcu130` as on download.pytorch.org), plus `root/index.html` listing projects.
"""

from __future__ import annotations

import hashlib
import html
import json
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


#: The upload time a stand-in index gives a file it is told nothing of (`data-upload-time`, PEP 700,
#: which uv reads from HTML pages too; uv drops a file without one from a resolution under a bound).
#: build.py gives each stack's files a time before that stack's bound; NEWER is after every bound.
UPLOAD_TIME = "2025-01-01T00:00:00Z"
NEWER = "2099-01-01T00:00:00Z"
TIMES_FILE = "upload-times.json"  # at the index's root: the times given, kept across additions


def _page(title: str, links: list[tuple[str, str]], times: dict[str, str] | None = None) -> str:
    def anchor(href: str, text: str) -> str:
        stamp = f' data-upload-time="{times[text]}"' if times and text in times else ""
        return f'    <a href="{html.escape(href)}"{stamp}>{html.escape(text)}</a><br/>\n'
    anchors = "".join(anchor(href, text) for href, text in links)
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


def write_simple_index(root: Path, wheels: list[Path], upload_times: dict[str, str] | None = None) -> Path:
    """Lay out a PEP 503 index of `wheels` at `root` (added to what is there); return `root`. A file
    has the upload time `upload_times` (file name -> RFC 3339) gives it now or gave it before, else
    UPLOAD_TIME."""
    root = Path(root)
    for wheel in wheels:
        directory = root / project_of(wheel)
        directory.mkdir(parents=True, exist_ok=True)
        _place(Path(wheel), directory)
    times_file = root / TIMES_FILE
    times = {**(json.loads(times_file.read_text()) if times_file.exists() else {}), **(upload_times or {})}
    if times:
        _replace(times_file, json.dumps(times, indent=1, sort_keys=True))
    projects = sorted(path.name for path in root.iterdir() if path.is_dir())
    for project in projects:
        files = sorted(path for path in (root / project).iterdir() if path.suffix == ".whl")
        links = [(f"{quote(file.name)}#sha256={sha256_of(file)}", file.name) for file in files]
        page_times = {file.name: times.get(file.name, UPLOAD_TIME) for file in files}
        _replace(root / project / "index.html", _page(f"Links for {project}", links, page_times))
    _replace(root / "index.html", _page("Simple index", [(f"{project}/", project) for project in projects]))
    return root


def _replace(path: Path, text: str) -> None:
    """Write `path` as a new file (a hard-linked copy of a tree keeps the old page)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)
