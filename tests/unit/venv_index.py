"""A tiny local stack index for the venv tests: stand-in wheels served over HTTP on loopback.

Uses the sandbox's stand-in wheel builders (sandbox/standins) with the versions of the
manifest's reference stack (sglang-0.5.9), plus a stand-in sglang whose requirements are the real
0.5.9 pins of the stack (torch==2.9.1, flashinfer 0.6.3, sgl-kernel==0.3.21, transformers==4.57.1):
the conflicts the overrides must solve. What the stand-ins require in turn is served too
(tests/unit/standin_closure.py): torch +cu130's own nvidia-cudnn-cu13 9.13.0.50 (which the stack's
9.16.0.29 overrides), its other nvidia libraries and triton, numpy and pillow (torchvision's), and
what has no code stand-in as metadata-only wheels.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sandbox.standins.index import write_simple_index
from sandbox.standins.stack import reference_stack
from sandbox.standins.wheels import (PURE_TAG, WheelSpec, broken_wheel, build_wheel, other_bytes_wheel,
                                     standin_wheel)
from servestack.manifest import load_manifest
from tests.unit.standin_closure import build_with_requirements

SGLANG_PINS = ("torch==2.9.1", "torchaudio==2.9.1", "torchvision", "sgl-kernel==0.3.21",
               "flashinfer_python==0.6.3", "flashinfer_cubin==0.6.3", "transformers==4.57.1")

def _relabel(version: str, label: str | None) -> str:
    public = version.split("+")[0]
    return f"{public}+{label}" if label else public


@dataclass
class StackIndex:
    root: Path
    base_url: str

    def url(self, manifest_url: str) -> str:
        parts = urlsplit(manifest_url)
        return f"{self.base_url}/{parts.netloc}{parts.path}"

    def host_data(self) -> dict:
        manifest = load_manifest()
        data = {f"index_{name}_url": self.url(url) for name, url in manifest.indexes.items()}
        for package in reference_stack().packages:
            if package.wheel:
                key = "wheel_url_" + package.name.replace("-", "_")
                data[key] = self.url(package.wheel["x86_64"])
        return data


def build_index(root: Path, torch_label: str = "cu130", broken_torch: str | None = None,
                other_torch_bytes: bool = False) -> None:
    """Lay out pypi, torch, flashinfer indexes and the direct sgl-kernel wheel under `root` (a torch of other
    bytes under the same file name with `other_torch_bytes`: a mirror's)."""
    manifest = load_manifest()
    stack = reference_stack()
    work = root / ".work"
    pypi, torch_index = [], []
    sglang = WheelSpec("sglang", stack.package("sglang").version, PURE_TAG,
                       {"sglang/__init__.py": "__version__ = '%s'\n" % stack.package("sglang").version},
                       SGLANG_PINS, "stand-in sglang")
    pypi.append(build_wheel(sglang, work))
    torch_specs = [standin_wheel(p.name, _relabel(p.version, torch_label)) for p in stack.packages
                   if p.index == "torch"]
    torch_index = [build_wheel(spec, work / "torch") for spec in torch_specs]
    # sglang's own pins, the stack's pins of this index, and what each requires in turn (the torch
    # index's stand-ins too: their nvidia libraries, triton, filelock, ...), one wheel per requirement
    built: dict = {}
    wanted = [("torch", "2.9.1"), ("sgl-kernel", "0.3.21"), ("flashinfer-python", "0.6.3"),
              ("flashinfer-cubin", "0.6.3"), ("flashinfer-jit-cache", "0.6.4")]
    wanted += [(p.name, p.version) for p in stack.packages if p.index == "pypi" and p.name != "sglang"]
    for name, version in wanted:
        pypi += build_with_requirements(name, version, work / "pypi", built)
    for spec in torch_specs:
        pypi += build_with_requirements(spec.name, spec.version, work / "requirements", built)[1:]
    if broken_torch:
        torch_index = [broken_wheel(w, work / "broken", broken_torch) if w.name.startswith("torch-") else w
                       for w in torch_index]
    if other_torch_bytes:
        torch_index = [other_bytes_wheel(w, work / "other") if w.name.startswith("torch-") else w
                       for w in torch_index]
    fi = [build_wheel(standin_wheel(p.name, p.version), work / "fi") for p in stack.packages
          if p.index == "flashinfer"]

    def place(url, wheels):
        parts = urlsplit(url)
        write_simple_index(root / parts.netloc / parts.path.strip("/"), wheels)

    place(manifest.indexes["pypi"], pypi)
    place(manifest.indexes["torch"], torch_index)
    place(manifest.indexes["flashinfer"], fi)
    for package in stack.packages:
        if package.wheel:
            parts = urlsplit(package.wheel["x86_64"])
            target = root / parts.netloc / parts.path.strip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            # the version the file name says (sgl-kernel's +cu130 is there only, not in METADATA)
            version = target.name.split("-")[1]
            shutil.copy2(build_wheel(standin_wheel(package.name, version), work / "direct"), target)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(root: Path):
    """Serve `root` on 127.0.0.1 (an ephemeral port) in a thread; returns (server, base_url)."""
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
