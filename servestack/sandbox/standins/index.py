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


#: The upload time the stand-in indexes give every file (`data-upload-time`, PEP 700, which uv reads
#: from HTML pages too): before every stack's exclude_newer bound, as the real files' are. uv drops a
#: file without one from a resolution under a bound. A file given as newer (`newer`) carries NEWER.
UPLOAD_TIME = "2025-01-01T00:00:00Z"
NEWER = "2099-01-01T00:00:00Z"
NEWER_LIST = "newer-files.txt"  # at the index's root: the files given NEWER, kept across additions


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


def write_simple_index(root: Path, wheels: list[Path], newer: frozenset[str] = frozenset()) -> Path:
    """Lay out a PEP 503 index of `wheels` at `root` (added to what is there); return `root`. Every
    file has UPLOAD_TIME, those named in `newer` (file names) NEWER."""
    root = Path(root)
    for wheel in wheels:
        directory = root / project_of(wheel)
        directory.mkdir(parents=True, exist_ok=True)
        _place(Path(wheel), directory)
    newer_list = root / NEWER_LIST
    newer = set(newer) | set(newer_list.read_text().split() if newer_list.exists() else ())
    if newer:
        newer_list.write_text("".join(f"{name}\n" for name in sorted(newer)))
    projects = sorted(path.name for path in root.iterdir() if path.is_dir())
    for project in projects:
        files = sorted(path for path in (root / project).iterdir() if path.suffix == ".whl")
        links = [(f"{quote(file.name)}#sha256={sha256_of(file)}", file.name) for file in files]
        times = {file.name: NEWER if file.name in newer else UPLOAD_TIME for file in files}
        (root / project / "index.html").write_text(_page(f"Links for {project}", links, times))
    (root / "index.html").write_text(_page("Simple index", [(f"{project}/", project) for project in projects]))
    return root
