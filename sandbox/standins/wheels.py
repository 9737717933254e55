"""Stand-in wheels: tiny real wheels with the real names, versions, local labels and tags.

They install with uv or pip like the real ones (zip with dist-info METADATA, WHEEL and RECORD)
but hold only the few attributes the deploy and its tests read: `torch.__version__`,
`torch.version.cuda` (from the local label), `torch.cuda.is_available()` (False here),
`flashinfer.__version__` and flashinfer's import-time version check of flashinfer-cubin and
flashinfer-jit-cache (the same conditions and messages as flashinfer 0.6.4's
`flashinfer/jit/env.py`). Every module docstring and METADATA Summary says it is a stand-in.
`broken_wheel()` derives a deliberately broken copy for failure tests.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
import sys
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
from packaging.tags import parse_tag
from packaging.version import Version

from sandbox.standins.index import normalize_project
from sandbox.standins.stack import OLD_CUDA_VERSION, package_version

#: Tags of the real wheels (x86_64, CPython 3.11 where the real ones are per-Python).
TORCH_TAG = "cp311-cp311-manylinux_2_28_x86_64"
SGL_KERNEL_TAG = "cp310-abi3-manylinux2014_x86_64"
JIT_CACHE_TAG = "cp39-abi3-manylinux_2_28_x86_64"
PURE_TAG = "py3-none-any"

_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class WheelSpec:
    """One wheel to build: its distribution name, version, tag, files (path -> text) and requirements."""

    name: str
    version: str
    tag: str
    files: dict[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    summary: str = ""
    extras: tuple[str, ...] = ()
    file_version: str = ""  # the version the file name says, where it is not METADATA's (sgl-kernel +cu130)

    @property
    def filename(self) -> str:
        return f"{normalize_dist(self.name)}-{self.file_version or self.version}-{self.tag}.whl"

    @property
    def dist_info(self) -> str:
        return f"{normalize_dist(self.name)}-{self.version}.dist-info"


def normalize_dist(name: str) -> str:
    """A distribution name as wheel file and dist-info names spell it ('flashinfer-python' -> 'flashinfer_python')."""
    return re.sub(r"[-_.]+", "_", name).lower()


def record_hash(data: bytes) -> str:
    """RECORD's hash notation: sha256=<urlsafe base64, no padding>."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_text(entries: dict[str, bytes], record_path: str) -> str:
    """RECORD for `entries` (path -> content), its own line last with no hash."""
    lines = [f"{path},{record_hash(data)},{len(data)}" for path, data in entries.items()]
    return "\n".join(lines + [f"{record_path},,"]) + "\n"


def write_zip(path: Path, entries: dict[str, bytes]) -> Path:
    """Write `entries` in order as a deterministic zip (fixed dates and modes)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, _ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return path


def _metadata(spec: WheelSpec) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {spec.name}", f"Version: {spec.version}",
             f"Summary: {spec.summary}", "Requires-Python: >=3.10"]
    lines += [f"Provides-Extra: {extra}" for extra in spec.extras]
    lines += [f"Requires-Dist: {requirement}" for requirement in spec.requires]
    return "\n".join(lines) + "\n\n" + spec.summary + "\n"


def _wheel_file(spec: WheelSpec) -> str:
    tags = sorted(str(tag) for tag in parse_tag(spec.tag))
    purelib = "true" if spec.tag == PURE_TAG else "false"
    lines = ["Wheel-Version: 1.0", "Generator: servestack-standins (1.0)", f"Root-Is-Purelib: {purelib}"]
    return "\n".join(lines + [f"Tag: {tag}" for tag in tags]) + "\n"


def build_wheel(spec: WheelSpec, dest_dir: Path) -> Path:
    """Build `spec` into `dest_dir` (byte-identical on every build); return the wheel's path."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    entries = {path: text.encode() for path, text in sorted(spec.files.items())}
    entries[f"{spec.dist_info}/METADATA"] = _metadata(spec).encode()
    entries[f"{spec.dist_info}/WHEEL"] = _wheel_file(spec).encode()
    record = f"{spec.dist_info}/RECORD"
    entries[record] = record_text(entries, record).encode()
    return write_zip(dest_dir / spec.filename, entries)


#: PyPI's torch is a CUDA 13.0 build from 2.11.0 on (torch/version.py of the 2.11.0 wheel: cuda =
#: '13.0'), a CUDA 12.8 build before (2.9.x, 2.10.x).
PYPI_TORCH_CUDA_13 = Version("2.11.0")


def cuda_of(version: str) -> str:
    """CUDA version a torch-family build targets: from its local label ('+cu130' -> '13.0'), else
    PyPI's default build of that version."""
    label = Version(version).local
    match = re.fullmatch(r"cu(\d+)(\d)", label or "")
    if match:
        return f"{match[1]}.{match[2]}"
    if Version(version).release >= PYPI_TORCH_CUDA_13.release:
        return "13.0"
    return ".".join(OLD_CUDA_VERSION.split(".")[:2])


KEPT_METADATA = Path(__file__).with_name("kept_metadata.toml")
PAYLOAD = Path(__file__).with_name("payload")
@lru_cache(maxsize=1)
def kept_metadata() -> dict:
    with open(KEPT_METADATA, "rb") as handle:
        return tomllib.load(handle)["wheels"]


def kept(name: str, version: str) -> dict:
    """The kept metadata of `name==version` ({} when none is kept)."""
    return kept_metadata().get(f"{normalize_project(name)}=={version}", {})


def declared(name: str, version: str, metadata: dict | None = None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(Requires-Dist, Provides-Extra) the real wheel declares: from `metadata` (PyPI's, as
    closure.pypi_metadata reads it) or the kept metadata; None when neither knows it."""
    if metadata is not None:
        return tuple(metadata.get("requires_dist") or ()), tuple(metadata.get("provides_extra") or ())
    known = kept(name, version)
    return (tuple(known["requires"]), tuple(known.get("extras", ()))) if known else None


def _payload(name: str) -> str:
    return (PAYLOAD / name).read_text()


def _note(name: str, version: str) -> str:
    return f"STAND-IN for {name} {version} (servestack sandbox): version metadata only, no CUDA code"


def torch_wheel(version: str) -> WheelSpec:
    """torch `version` ('2.9.1+cu130'): torch.version.cuda of that build, the cuDNN of the installed
    nvidia-cudnn wheel, the stand-in nvidia-smi's GPUs SIMULATED (payload/torch_gpus.py), placeholders
    for the rest (payload/torch_init.py)."""
    note = _note("PyTorch", version)
    files = {"torch/__init__.py": _payload("torch_init.py").replace("@NOTE@", note),
             "torch/version.py": _torch_version_py(version), "torch/_standin.py": _payload("standin.py"),
             "torch/_standin_gpus.py": _payload("torch_gpus.py")}
    return WheelSpec("torch", version, TORCH_TAG, files, (), note)


def _torch_version_py(version: str) -> str:
    """torch/version.py as real torch writes it. `__version__` has the build's local label even where the wheel's
    version has none (PyPI's 2.11.0 wheel: Version 2.11.0, torch.__version__ '2.11.0+cu130')."""
    cuda = cuda_of(version)
    runtime = version if Version(version).local else f"{version}+cu{cuda.replace('.', '')}"
    return ("from typing import Optional\n\n"
            "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']\n"
            f"__version__ = '{runtime}'\ndebug = False\ncuda: Optional[str] = '{cuda}'\n"
            "git_version = 'standin'\nhip: Optional[str] = None\nrocm: Optional[str] = None\n"
            "xpu: Optional[str] = None\n")


def torch_companion_wheel(name: str, version: str, torch_version: str) -> WheelSpec:
    """torchvision or torchaudio `version` (requiring torch==`torch_version` unless its real
    requirements are known) with placeholders for its other names."""
    note = _note(name, version)
    files = {f"{name}/__init__.py": (f'"""{note}."""\nfrom {name} import _standin, version\n\n'
                                     f"__version__ = version.__version__\n_standin.install(__name__)\n"),
             f"{name}/version.py": f'__version__ = "{version}"\ncuda = "{cuda_of(version)}"\n',
             f"{name}/_standin.py": _payload("standin.py")}
    return WheelSpec(name, version, TORCH_TAG, files, (f"torch=={torch_version}",), note)


def triton_wheel(version: str) -> WheelSpec:
    """triton `version`: the names SGLang imports, as placeholders (no GPU, no compiler)."""
    note = _note("triton", version)
    files = {"triton/__init__.py": (f'"""{note}."""\nfrom triton import _standin\n\n__version__ = "{version}"\n\n\n'
                                    "def jit(function=None, **options):\n"
                                    "    return (lambda f: f) if function is None else function\n\n\n"
                                    "def cdiv(a, b):\n    return -(-a // b)\n\n\n"
                                    "def next_power_of_2(n):\n    return 1 << (int(n) - 1).bit_length()\n\n\n"
                                    "_standin.install(__name__)\n"),
             "triton/_standin.py": _payload("standin.py"),
             "triton/runtime/__init__.py": _TRITON_RUNTIME.replace("@NOTE@", note)}
    return WheelSpec("triton", version, TORCH_TAG, files, (), note)


def nvidia_cudnn_wheel(name: str, version: str) -> WheelSpec:
    """nvidia-cudnn-cu13/-cu12 `version`: no library, only its version (what the stand-in torch reads)."""
    return WheelSpec(name, version, "py3-none-manylinux_2_27_x86_64", {}, (), _note(name, version))


def sgl_kernel_wheel(version: str, dist: str = "sgl-kernel") -> WheelSpec:
    """sgl-kernel (or its successor `dist` 'sglang-kernel'): module sgl_kernel with __version__ and
    placeholders for the kernels SGLang imports from it once torch sees (the stand-in's simulated) GPUs.
    A kept `metadata_version` is what METADATA says where the file name has a label (+cu130)."""
    note = _note(dist, version)
    metadata_version = kept(dist, version).get("metadata_version", version)
    files = {"sgl_kernel/__init__.py": (f'"""{note}."""\nfrom sgl_kernel import _standin\n\n'
                                        f'__version__ = "{Version(version).public}"\n_standin.install(__name__)\n'),
             "sgl_kernel/_standin.py": _payload("standin.py")}
    return WheelSpec(dist, metadata_version, SGL_KERNEL_TAG, files, (), note,
                     file_version=version if metadata_version != version else "")


#: A sandbox knob, not flashinfer's: while this file exists on a host, importing the stand-in flashinfer
#: waits. A venv build's release checks import it (files/scripts/check_release.py), so a test holds a
#: build there for as long as it needs (tests/integration/test_interrupted.py), instead of racing it.
FLASHINFER_IMPORT_HOLD = "/etc/servestack-sandbox/flashinfer-import-hold"
_HOLD = (f"import os as _os\nimport time as _time\n\nwhile _os.path.lexists({FLASHINFER_IMPORT_HOLD!r}):"
         "  # SANDBOX KNOB (tests)\n    _time.sleep(0.2)\n")


def flashinfer_python_wheel(version: str) -> WheelSpec:
    """flashinfer-python `version` with the real import-time version check of its companions, placeholders
    for the kernels SGLang imports once torch sees GPUs (and the sandbox's hold, FLASHINFER_IMPORT_HOLD)."""
    note = _note("flashinfer-python", version)
    files = {
        "flashinfer/__init__.py": (f'"""{note}."""\n{_HOLD}from .version import __version__ as __version__\n'
                                   "from . import jit as jit\nfrom flashinfer import _standin\n\n"
                                   "_standin.install(__name__)\n"),
        "flashinfer/_standin.py": _payload("standin.py"),
        "flashinfer/version.py": f'__version__ = "{version}"\n',
        "flashinfer/jit/__init__.py": "from . import env as env\n",
        "flashinfer/jit/env.py": _FLASHINFER_ENV.replace("@NOTE@", note),
    }
    return WheelSpec("flashinfer-python", version, PURE_TAG, files, ("torch",), note)


def flashinfer_cubin_wheel(version: str) -> WheelSpec:
    """flashinfer-cubin `version`: module flashinfer_cubin with __version__ and get_cubin_dir()."""
    note = _note("flashinfer-cubin", version)
    files = {"flashinfer_cubin/__init__.py": _COMPANION.format(note=note, version=version, getter="get_cubin_dir",
                                                              subdir="cubins")}
    return WheelSpec("flashinfer-cubin", version, PURE_TAG, files, (), note)


def flashinfer_jit_cache_wheel(version: str) -> WheelSpec:
    """flashinfer-jit-cache `version` ('0.6.4+cu130'): module flashinfer_jit_cache, get_jit_cache_dir()."""
    note = _note("flashinfer-jit-cache", version)
    files = {"flashinfer_jit_cache/__init__.py": _COMPANION.format(note=note, version=version,
                                                                  getter="get_jit_cache_dir", subdir="jit_cache")}
    return WheelSpec("flashinfer-jit-cache", version, JIT_CACHE_TAG, files, (), note)


def metadata_only_wheel(name: str, version: str) -> WheelSpec:
    """A wheel with no files but its metadata: a package the sandbox serves but nothing imports there
    (a CUDA library, a kernel package, what only the GPU server loads). Tagged py3-none-any: a sandbox
    host (CPython 3.11, x86_64, glibc 2.36) accepts it as it accepts the real platform wheel."""
    return WheelSpec(name, version, PURE_TAG, {}, (), _note(name, version))


#: The projects whose stand-ins hold code (the rest of a stack is served real, or metadata-only).
def _builders(version: str) -> dict:
    torch = Version(package_version("torch")).public
    return {
        "torch": lambda: torch_wheel(version),
        "torchvision": lambda: torch_companion_wheel("torchvision", version, torch),
        "torchaudio": lambda: torch_companion_wheel("torchaudio", version, torch),
        "sgl-kernel": lambda: sgl_kernel_wheel(version),
        "sglang-kernel": lambda: sgl_kernel_wheel(version, "sglang-kernel"),
        "flashinfer-python": lambda: flashinfer_python_wheel(version),
        "flashinfer-cubin": lambda: flashinfer_cubin_wheel(version),
        "flashinfer-jit-cache": lambda: flashinfer_jit_cache_wheel(version),
        "triton": lambda: triton_wheel(version),
        "nvidia-cudnn-cu13": lambda: nvidia_cudnn_wheel("nvidia-cudnn-cu13", version),
        "nvidia-cudnn-cu12": lambda: nvidia_cudnn_wheel("nvidia-cudnn-cu12", version),
    }


CODE_STANDINS = frozenset(_builders("0"))


def standin_wheel(name: str, version: str, metadata: dict | None = None) -> WheelSpec:
    """The stand-in of project `name` (any spelling) at `version`, declaring what the real wheel
    declares (`metadata` from PyPI, else the kept metadata); a project without a code stand-in
    is metadata-only."""
    project = normalize_project(name)
    builder = _builders(version).get(project)
    spec = builder() if builder else metadata_only_wheel(name, version)
    known = declared(project, version, metadata)
    return dataclasses.replace(spec, requires=known[0], extras=known[1]) if known else spec


BROKEN_KINDS = ("corrupt_zip", "bad_metadata")


def broken_wheel(wheel: Path, dest_dir: Path, kind: str) -> Path:
    """A broken copy of `wheel` under the same file name in `dest_dir`.

    kind: "corrupt_zip" (the file cut in half: not a zip any more) or "bad_metadata" (METADATA
    names another version than the file name). Both make `uv pip install` fail. (A wrong RECORD
    hash does not: uv 0.13.9 installs such a wheel without complaint.)
    """
    if kind not in BROKEN_KINDS:
        raise ValueError(f"broken wheel kind {kind!r}: expected one of {BROKEN_KINDS}")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / Path(wheel).name
    data = Path(wheel).read_bytes()
    if kind == "corrupt_zip":
        out.write_bytes(data[: len(data) // 2])
        return out
    with zipfile.ZipFile(wheel) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    metadata = next(name for name in entries if name.endswith(".dist-info/METADATA"))
    entries[metadata] = re.sub(rb"(?m)^Version: .*$", b"Version: 0.0.0", entries[metadata], count=1)
    return write_zip(out, entries)


def other_bytes_wheel(wheel: Path, dest_dir: Path) -> Path:
    """A valid copy of `wheel` under the same file name in `dest_dir` with other bytes (one file more, in
    its RECORD too): what a mirror that does not serve the original would serve."""
    with zipfile.ZipFile(wheel) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    record = next(name for name in entries if name.endswith(".dist-info/RECORD"))
    package = next(name.split("/")[0] for name in entries if not name.split("/")[0].endswith(".dist-info"))
    entries[f"{package}/_served_by_a_mirror.py"] = b"# not the bytes the stack's index serves\n"
    entries[record] = record_text({name: data for name, data in entries.items() if name != record}, record).encode()
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    return write_zip(Path(dest_dir) / Path(wheel).name, entries)


# Real triton on a host without a GPU driver: asking for the active driver raises this.
_TRITON_RUNTIME = '''"""@NOTE@: no GPU driver, as on a host without one."""
from triton import _standin


class _Driver:
    @property
    def active(self):
        raise RuntimeError("0 active drivers ([]). There should only be one.")


driver = _Driver()
_standin.install(__name__)
'''

_COMPANION = '''"""{note}."""
import pathlib

__version__ = "{version}"


def {getter}():
    return pathlib.Path(__file__).parent / "{subdir}"
'''

# Mirrors flashinfer 0.6.4 flashinfer/jit/env.py: at import (of flashinfer), an installed
# flashinfer-cubin must have exactly flashinfer's version and an installed flashinfer-jit-cache a
# version starting with it, unless FLASHINFER_DISABLE_VERSION_CHECK is set; absent ones are fine.
_FLASHINFER_ENV = '''"""@NOTE@. Version checks as in flashinfer/jit/env.py."""
import importlib.util
import os
import pathlib

from ..version import __version__ as flashinfer_version

_MISMATCH = ("{package} version ({found}) does not match flashinfer version ({version}). "
             "Please install the same version of both packages. "
             "Set FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this check.")
FLASHINFER_BASE_DIR = pathlib.Path(os.getenv("FLASHINFER_WORKSPACE_BASE", pathlib.Path.home().as_posix()))
FLASHINFER_CACHE_DIR = FLASHINFER_BASE_DIR / ".cache" / "flashinfer"


def _get_cubin_dir():
    if importlib.util.find_spec("flashinfer_cubin") is not None:
        import flashinfer_cubin

        if not os.getenv("FLASHINFER_DISABLE_VERSION_CHECK") and flashinfer_version != flashinfer_cubin.__version__:
            raise RuntimeError(_MISMATCH.format(package="flashinfer-cubin", found=flashinfer_cubin.__version__,
                                                version=flashinfer_version))
        return pathlib.Path(flashinfer_cubin.get_cubin_dir())
    env_dir = os.getenv("FLASHINFER_CUBIN_DIR")
    return pathlib.Path(env_dir) if env_dir else FLASHINFER_CACHE_DIR / "cubins"


def _get_aot_dir():
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        import flashinfer_jit_cache

        found = flashinfer_jit_cache.__version__
        if not os.getenv("FLASHINFER_DISABLE_VERSION_CHECK") and not found.startswith(flashinfer_version):
            raise RuntimeError(_MISMATCH.format(package="flashinfer-jit-cache", found=found,
                                                version=flashinfer_version))
        return pathlib.Path(flashinfer_jit_cache.get_jit_cache_dir())
    return pathlib.Path(__file__).resolve().parents[1] / "data" / "aot"


FLASHINFER_CUBIN_DIR = _get_cubin_dir()
FLASHINFER_AOT_DIR = _get_aot_dir()
'''
