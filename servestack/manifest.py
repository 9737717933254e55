"""Load and validate the stack manifest (`files/stack.toml`): the one place holding every pin.

Everything else (operations, facts, the sandbox, the verification suite) reads versions, URLs,
sizes and checksums from the `Manifest` returned here, never from literals of its own.
"""

from __future__ import annotations

import re
import sys
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from packaging.version import InvalidVersion, Version

from servestack.errors import ManifestError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MANIFEST = PROJECT_ROOT / "files" / "stack.toml"

ARCHITECTURES = ("x86_64", "aarch64")
_HEX = {"md5": 32, "sha256": 64}


@dataclass(frozen=True)
class Runfile:
    """One CUDA runfile: what to fetch and how to recognise it."""

    file: str
    url: str
    size: int
    md5: str
    sha256: str


@dataclass(frozen=True)
class Package:
    """One pinned Python package of the serving stack."""

    name: str
    version: str
    step: int
    index: str | None = None
    wheel: dict[str, str] | None = None

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Stack:
    """One Python serving stack: its pinned packages in install order, the CUDA its torch is built
    for (`torch.version.cuda`), and the upload-time bound of everything it resolves."""

    name: str
    packages: tuple[Package, ...]
    torch_cuda: str
    exclude_newer: str
    # the choices its sglang's argument parser allows, per servestack key (`service_<key>`): SERVER_CHOICES
    server_choices: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the oldest compute capability (major * 10 + minor) its sglang loads a quantization method on
    min_capability: tuple[tuple[str, int], ...] = ()
    # its sglang runs SGLang's adaptive speculation as servestack writes its config (profiles.py)
    adaptive_speculation: bool = False

    def choices(self, key: str) -> tuple[str, ...]:
        return dict(self.server_choices)[key]

    def min_capability_of(self, quantization: str) -> int | None:
        return dict(self.min_capability).get(quantization)

    def package(self, name: str) -> Package:
        for package in self.packages:
            if package.name == name:
                return package
        raise KeyError(name)


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest; `venv` and `service` (service defaults and profiles) are plain tables."""

    path: Path
    cuda: dict
    runfiles: dict[str, Runfile]
    gpu: dict
    uv: dict
    indexes: dict[str, str]
    stacks: dict[str, Stack]
    venv: dict
    service: dict

    def all_packages(self) -> tuple[Package, ...]:
        """Every package of every stack (a package pinned alike in two stacks once)."""
        unique = {(package.name, package.version): package
                  for stack in self.stacks.values() for package in stack.packages}
        return tuple(unique.values())


class _Reader:
    """Typed access to a TOML table that names the full key path in every error."""

    def __init__(self, path: Path, table: dict, prefix: str = ""):
        self.path, self.table, self.prefix = path, table, prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def fail(self, name: str, expected: str, got=None) -> ManifestError:
        shown = "" if got is None else f", got {got!r}"
        return ManifestError(f"{self.path}: key '{self.key(name)}': expected {expected}{shown}")

    def get(self, name: str, kind: type | tuple, expected: str):
        if name not in self.table:
            raise self.fail(name, f"{expected} (missing)")
        value = self.table[name]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise self.fail(name, expected, value)
        return value

    def version(self, name: str) -> str:
        value = self.get(name, str, "a version string like '13.0.1'")
        try:
            Version(value)
        except InvalidVersion:
            raise self.fail(name, "a PEP 440 version like '13.0.1' or '2.9.1+cu130'", value) from None
        return value

    def url(self, name: str) -> str:
        value = self.get(name, str, "an http(s) URL")
        if not re.match(r"^https?://[^\s/]+/\S*$", value):
            raise self.fail(name, "an http(s) URL", value)
        return value

    def checksum(self, name: str) -> str:
        value = self.get(name, str, f"{_HEX[name]} lowercase hex digits")
        if not re.fullmatch(rf"[0-9a-f]{{{_HEX[name]}}}", value):
            raise self.fail(name, f"{_HEX[name]} lowercase hex digits", value)
        return value

    def positive_int(self, name: str) -> int:
        value = self.get(name, int, "a positive integer")
        if value <= 0:
            raise self.fail(name, "a positive integer", value)
        return value

    def flag(self, name: str) -> bool:
        """An optional key, true or false; false where it is absent."""
        return self.get(name, bool, "true or false") if name in self.table else False

    def abs_path(self, name: str) -> str:
        value = self.get(name, str, "an absolute path")
        if not value.startswith("/"):
            raise self.fail(name, "an absolute path", value)
        return value

    def sub(self, name: str) -> "_Reader":
        return _Reader(self.path, self.get(name, dict, "a table"), self.key(name) + ".")

    def only(self, allowed: set[str]) -> None:
        for name in self.table:
            if name not in allowed:
                raise self.fail(name, f"one of the known keys {sorted(allowed)} (unknown key)")


def _runfile(reader: _Reader) -> Runfile:
    reader.only({"file", "url", "size", "md5", "sha256"})
    runfile = Runfile(
        file=reader.get("file", str, "a file name ending in .run"),
        url=reader.url("url"),
        size=reader.positive_int("size"),
        md5=reader.checksum("md5"),
        sha256=reader.checksum("sha256"),
    )
    if not runfile.file.endswith(".run") or "/" in runfile.file:
        raise reader.fail("file", "a file name ending in .run", runfile.file)
    if not runfile.url.endswith("/" + runfile.file):
        raise reader.fail("url", f"a URL ending in /{runfile.file}", runfile.url)
    return runfile


def _cuda(reader: _Reader) -> tuple[dict, dict[str, Runfile]]:
    cuda = reader.sub("cuda")
    cuda.only({"version", "install_path", "nvcc_version", "min_driver", "link_path", "keep",
               "installer_flags", "log_path", "extract_bytes", "install_bytes", "runfile"})
    values = {
        "version": cuda.version("version"),
        "install_path": cuda.abs_path("install_path"),
        "nvcc_version": cuda.version("nvcc_version"),
        "min_driver": cuda.version("min_driver"),
        "link_path": cuda.abs_path("link_path"),
        "keep": cuda.get("keep", list, "a list of toolkit versions like ['12.8']"),
        "installer_flags": cuda.get("installer_flags", list, "a list of installer flags"),
        "log_path": cuda.abs_path("log_path"),
        "extract_bytes": cuda.positive_int("extract_bytes"),
        "install_bytes": cuda.positive_int("install_bytes"),
    }
    if not all(isinstance(flag, str) and flag.startswith("--") for flag in values["installer_flags"]):
        raise cuda.fail("installer_flags", "a list of installer flags like '--silent'", values["installer_flags"])
    for kept in values["keep"]:
        if not isinstance(kept, str) or not re.fullmatch(r"\d+\.\d+", kept):
            raise cuda.fail("keep", "toolkit versions like '12.8'", kept)
    if not values["nvcc_version"].startswith(_major_minor(values["version"])):
        raise cuda.fail("nvcc_version", f"a version of the {values['version']} toolkit",
                        values["nvcc_version"])
    table = cuda.sub("runfile")
    table.only(set(ARCHITECTURES))
    runfiles = {arch: _runfile(table.sub(arch)) for arch in table.table}
    if not runfiles:
        raise cuda.fail("runfile", "at least one architecture table like [cuda.runfile.x86_64]")
    return values, runfiles


def _major_minor(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def _packages(reader: _Reader, indexes: dict[str, str]) -> tuple[Package, ...]:
    packages: list[Package] = []
    for number, table in enumerate(reader.get("packages", list, "an array of [[packages]]")):
        if not isinstance(table, dict):
            raise reader.fail(f"packages[{number}]", "a [[packages]] table", table)
        item = _Reader(reader.path, table, reader.key(f"packages[{number}]") + ".")
        item.only({"name", "version", "step", "index", "wheel"})
        index = table.get("index")
        if index is not None and index not in indexes:
            raise item.fail("index", f"one of the [indexes] names {sorted(indexes)}", index)
        wheel = None
        if "wheel" in table:
            wheels = item.sub("wheel")
            wheels.only(set(ARCHITECTURES))
            wheel = {arch: wheels.url(arch) for arch in wheels.table}
        if (index is None) == (wheel is None):
            raise item.fail("index", "exactly one of 'index' or a [packages.wheel] table")
        packages.append(Package(name=item.get("name", str, "a package name"),
                                version=item.version("version"),
                                step=item.positive_int("step"), index=index, wheel=wheel))
    names = [package.name for package in packages]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise reader.fail("packages", "each package once", duplicates)
    return tuple(sorted(packages, key=lambda package: package.step))


# An RFC 3339 UTC instant, as uv's --exclude-newer takes it.
_INSTANT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


# sglang flags whose values its argument parser limits to a list (`choices=`): the stack's [server_choices]
# copies each list from its sglang's srt/server_args.py (tests/unit/test_real_stack.py reads the real wheel).
SERVER_CHOICES = {"quantization": "--quantization", "kv_cache_dtype": "--kv-cache-dtype",
                  "attention_backend": "--attention-backend"}


def _server_choices(reader: _Reader) -> tuple[tuple[str, tuple[str, ...]], ...]:
    table = reader.sub("server_choices")
    table.only(set(SERVER_CHOICES))
    expected = "a non-empty list of the values its sglang's argument parser accepts"
    choices = []
    for key in SERVER_CHOICES:
        values = table.get(key, list, expected)
        if not values or not all(isinstance(value, str) for value in values):
            raise table.fail(key, expected, values)
        choices.append((key, tuple(values)))
    return tuple(choices)


def _min_capability(reader: _Reader, quantizations: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    if "min_capability" not in reader.table:
        return ()
    table = reader.sub("min_capability")
    table.only(set(quantizations))
    return tuple((method, table.positive_int(method)) for method in table.table)


def _stack(reader: _Reader, name: str, indexes: dict[str, str]) -> Stack:
    reader.only({"torch_cuda", "exclude_newer", "packages", "server_choices", "min_capability", "adaptive_speculation"})
    packages = _packages(reader, indexes)
    torch_cuda = reader.get("torch_cuda", str, "the CUDA version torch.version.cuda reports, like '13.0'")
    if not re.fullmatch(r"\d+\.\d+", torch_cuda):
        raise reader.fail("torch_cuda", "the CUDA version torch.version.cuda reports, like '13.0'", torch_cuda)
    exclude_newer = reader.get("exclude_newer", str, "an RFC 3339 UTC time like '2026-02-24T00:00:00Z'")
    if not _INSTANT.fullmatch(exclude_newer):
        raise reader.fail("exclude_newer", "an RFC 3339 UTC time like '2026-02-24T00:00:00Z'", exclude_newer)
    torch = next((package for package in packages if package.name == "torch"), None)
    if torch is None:
        raise reader.fail("packages", "a torch entry (the venv step checks its CUDA build)",
                          [package.name for package in packages])
    label = Version(torch.version).local
    if label is not None and label != "cu" + torch_cuda.replace(".", ""):
        raise reader.fail("packages", f"torch's local label to name the stack's torch_cuda {torch_cuda} "
                          f"(+cu{torch_cuda.replace('.', '')}) or no label", torch.version)
    choices = _server_choices(reader)
    return Stack(name=name, packages=packages, torch_cuda=torch_cuda, exclude_newer=exclude_newer,
                 server_choices=choices, min_capability=_min_capability(reader, dict(choices)["quantization"]),
                 adaptive_speculation=reader.flag("adaptive_speculation"))


def _stacks(reader: _Reader, indexes: dict[str, str]) -> dict[str, Stack]:
    table = reader.sub("stacks")
    if not table.table:
        raise reader.fail("stacks", "at least one stack table like [stacks.\"sglang-0.5.9\"]")
    return {name: _stack(table.sub(name), name, indexes) for name in table.table}


def parse_manifest(path: Path, data: dict) -> Manifest:
    """Validate a manifest's parsed TOML; raise ManifestError naming the file and the first bad key.

    The [venv] and [service] tables (the latter with its service profiles, [service.profiles."name"])
    are read as plain tables here: servestack/keys.py checks them against the host-data keys they
    are the defaults of (`check_manifest_defaults`)."""
    reader = _Reader(path, data)
    reader.only({"schema", "cuda", "gpu", "uv", "indexes", "stacks", "venv", "service"})
    if reader.get("schema", int, "the schema number 1") != 1:
        raise reader.fail("schema", "the schema number 1", data["schema"])
    cuda, runfiles = _cuda(reader)
    indexes_reader = reader.sub("indexes")
    indexes = {name: indexes_reader.url(name) for name in indexes_reader.table}
    gpu = reader.sub("gpu")
    gpu.only({"compute_capability", "count"})
    uv = reader.sub("uv")
    uv.only({"version", "index_url"})
    return Manifest(
        path=path,
        cuda=cuda,
        runfiles=runfiles,
        gpu={"compute_capability": gpu.get("compute_capability", str, "a capability like '12.0'"),
             "count": gpu.positive_int("count")},
        uv={"version": uv.version("version"), "index_url": uv.url("index_url")},
        indexes=indexes,
        stacks=_stacks(reader, indexes),
        venv=reader.get("venv", dict, "a table"),
        service=reader.get("service", dict, "a table"),
    )


@lru_cache(maxsize=8)
def load_manifest(path: str | Path = DEFAULT_MANIFEST) -> Manifest:
    """Read and validate a manifest file (cached per path)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: cannot read the manifest: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ManifestError(f"{path}: not valid TOML: {error}") from None
    return parse_manifest(path, data)
