"""SGLang for the sandbox: the REAL sglang wheel from PyPI with its Requires-Dist cut down.

Every file of the real wheel is kept (so patches apply to the real sources and
`import sglang` runs the real code); only METADATA changes, and RECORD with it:

- kept: the stack's pins with their real, conflicting versions (torch==2.9.1,
  torchaudio==2.9.1, torchvision, sgl-kernel==0.3.21, flashinfer_python==0.6.3,
  flashinfer_cubin==0.6.3, cuda-python==12.9 for 0.5.9), which the sandbox serves as stand-ins,
  and the packages `import sglang` itself imports (IMPORT_DEPS), served as real wheels;
- dropped: every other dependency (transformers, xgrammar, ...) and all extras.

The description starts with a line saying the wheel is a cut-down stand-in.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from servestack.sandbox.standins.index import normalize_project
from servestack.sandbox.standins.pypi import fetch_wheel
from servestack.sandbox.standins.stack import manifest
from servestack.sandbox.standins.wheels import record_hash, write_zip

#: The release that already carries the upstream fix of a servestack patch ('upstream patch' tests).
UPSTREAM_PATCHED_VERSION = "0.5.10"

#: What `import sglang` imports at top level beyond the standard library and the stack's stand-ins,
#: found by importing it in an empty venv until it succeeded (0.5.9 and 0.5.10; 0.5.14 with the
#: stand-in torch, torchvision and triton), plus transformers, a stack pin served as the real wheel
#: (what SGLang loads model configs with) and pillow, which torchvision requires.
IMPORT_DEPS = ("aiohttp", "ipython", "numpy", "pybase64", "pydantic", "requests", "tqdm", "transformers",
               "pillow")
IMPORT_DEPS_FROM_0_5_14 = IMPORT_DEPS + ("orjson", "fastapi")

#: Stack packages sglang pins that are not in the manifest (kept with their real pins).
EXTRA_STACK = ("cuda-python", "sglang-kernel")

NOTE = ("STAND-IN (servestack sandbox): the real sglang {version} wheel with Requires-Dist cut down to "
        "the serving stack's pins and the packages `import sglang` needs.")


def import_deps(version: str) -> tuple[str, ...]:
    """The real packages `import sglang` of `version` needs (IMPORT_DEPS)."""
    return IMPORT_DEPS_FROM_0_5_14 if Version(version) >= Version("0.5.14") else IMPORT_DEPS


def kept_projects(version: str) -> set[str]:
    """Normalized names of the requirements a cut-down sglang of `version` keeps."""
    stack = {package.name for package in manifest().all_packages()} | set(EXTRA_STACK)
    return {normalize_project(name) for name in stack | set(import_deps(version))} - {"sglang"}


def _keep(line: str, keep: set[str]) -> bool:
    requirement = Requirement(line.split(":", 1)[1].strip())
    return normalize_project(requirement.name) in keep and "extra" not in str(requirement.marker or "")


def cut_metadata(text: str, keep: set[str]) -> str:
    """METADATA `text` with only the Requires-Dist of projects in `keep`, no extras, and the note."""
    head, _, body = text.partition("\n\n")
    version = re.search(r"(?m)^Version: (.+)$", head)[1]
    lines = [line for line in head.split("\n")
             if not line.startswith("Provides-Extra:")
             and not (line.startswith("Requires-Dist:") and not _keep(line, keep))]
    return "\n".join(lines) + "\n\n" + NOTE.format(version=version) + "\n\n" + body


def _record_with(record: str, path: str, data: bytes) -> str:
    lines = [f"{path},{record_hash(data)},{len(data)}" if line.startswith(path + ",") else line
             for line in record.splitlines()]
    return "\n".join(lines) + "\n"


def cut_wheel(real: Path, dest_dir: Path, keep: set[str]) -> Path:
    """Rewrite the real sglang wheel `real` into `dest_dir` (same file name), METADATA cut down."""
    with zipfile.ZipFile(real) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    metadata = next(name for name in entries if re.fullmatch(r"[^/]+\.dist-info/METADATA", name))
    record = metadata.rsplit("/", 1)[0] + "/RECORD"
    entries[metadata] = cut_metadata(entries[metadata].decode(), keep).encode()
    entries[record] = _record_with(entries[record].decode(), metadata, entries[metadata]).encode()
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    return write_zip(Path(dest_dir) / Path(real).name, entries)


def sglang_wheel(version: str, dest_dir: Path) -> Path:
    """The cut-down wheel of sglang `version` (real wheel fetched from PyPI once) in `dest_dir`."""
    return cut_wheel(fetch_wheel("sglang", version), dest_dir, kept_projects(version))


def requirements_of(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel, parsed."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(name for name in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", name))
        head = archive.read(name).decode().partition("\n\n")[0]
    return [Requirement(line.split(":", 1)[1].strip()) for line in head.split("\n")
            if line.startswith("Requires-Dist:")]
