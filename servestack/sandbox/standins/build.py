"""The whole tree the sandbox's artifact server serves, mirroring the manifest's URLs.

Each manifest URL `https://HOST/PATH` is served at `http://SERVER/HOST/PATH`, so pointing a host
at the sandbox only swaps the scheme and host part (`ArtifactSet.url`, `ArtifactSet.host_data`):

- HOST/.../local_installers/<runfile>: the stand-in CUDA runfile (runfile.py), and NVIDIA's
  .../docs/sidebar/md5sum.txt beside it;
- pypi.org/simple/: the cut-down real sglang (manifest version and 0.5.10), the real uv wheel,
  the real wheels `import sglang` needs, and stand-ins for every stack pin of those sglang
  releases (torch==2.9.1 as PyPI's CUDA 12.8 build, flashinfer 0.6.3, ...) and for the
  manifest's PyPI packages (flashinfer 0.6.4);
- download.pytorch.org/whl/cu130/ (manifest 'torch' index) and its cu128 sibling: stand-in
  torch/torchvision/torchaudio builds;
- flashinfer.ai/whl/cu130/: the stand-in flashinfer-jit-cache;
- github.com/.../sgl_kernel-<version>+cu130-...whl: the stand-in sgl-kernel, as a direct file;
- broken/<kind>/download.pytorch.org/whl/cu130/: the torch index with a broken torch wheel.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from packaging.requirements import Requirement
from packaging.version import Version

from servestack.sandbox.standins.index import normalize_project, write_simple_index
from servestack.sandbox.standins.pypi import fetch_wheels
from servestack.sandbox.standins.runfile import RunfileInfo, build_runfile, runfile_info, write_md5sum
from servestack.manifest import Stack
from servestack.sandbox.standins.sglang import UPSTREAM_PATCHED_VERSION, import_deps, requirements_of, sglang_wheel
from servestack.sandbox.standins.stack import manifest, old_label, reference_stack, target_label, with_label
from servestack.sandbox.standins.wheels import BROKEN_KINDS, broken_wheel, build_wheel, standin_wheel


def mirror_path(url: str) -> PurePosixPath:
    """Where the artifact tree holds what `url` names: its host and path ('pypi.org/simple')."""
    parts = urlsplit(url)
    return PurePosixPath(parts.netloc) / parts.path.strip("/")


def md5sum_url(runfile_url: str) -> str:
    """NVIDIA's md5sum.txt of the release a runfile URL belongs to (.../docs/sidebar/md5sum.txt)."""
    release = runfile_url.rsplit("/local_installers/", 1)[0]
    return f"{release}/docs/sidebar/md5sum.txt"


def old_torch_index_url() -> str:
    """The pre-upgrade sibling of the manifest's torch index (.../whl/cu128)."""
    return manifest().indexes["torch"].replace(target_label(), old_label())


@dataclass(frozen=True)
class ArtifactSet:
    """What build_artifacts produced; paths are absolute, under `root`."""

    root: Path
    runfile: Path
    runfile_info: RunfileInfo
    md5sum: Path
    indexes: dict[str, Path]
    wheels: dict[str, Path]
    broken_indexes: dict[str, Path] = field(default_factory=dict)

    def url(self, path: Path, base_url: str) -> str:
        """URL of `path` (under root) on an artifact server at `base_url` serving root."""
        return f"{base_url.rstrip('/')}/{Path(path).relative_to(self.root).as_posix()}"

    def host_data(self, base_url: str) -> dict[str, str]:
        """Host data pointing a host at this set on `base_url` (keys as in group_data/all.py).

        The stand-in runfile's size and checksums (`runfile_info`) differ from the manifest's;
        the sandbox has to put them in place of the manifest's separately.
        """
        data = {"cuda_runfile_url": self.url(self.runfile, base_url),
                "uv_index_url": self.url(self.indexes["pypi"], base_url)}
        for name in manifest().indexes:
            data[f"index_{name}_url"] = self.url(self.indexes[name], base_url)
        for name, wheel in self.wheels.items():
            data["wheel_url_" + normalize_project(name).replace("-", "_")] = self.url(wheel, base_url)
        return data


#: What a stand-in's unpinned requirement resolves to where no stack pins the project: the version a
#: real resolution of the stack picks under its exclude_newer bound (uv 0.13.9 against PyPI,
#: 2026-12-02: sglang 0.5.14's `cuda-python>=13.0` -> 13.3.1).
UNPINNED = {"cuda-python": "13.3.1"}


def _stack_version(name: str, stack: Stack) -> str:
    try:
        return Version(stack.package(name).version).public
    except KeyError:
        return UNPINNED[normalize_project(name)]


def _standins_required(requirements: list[Requirement], stack: Stack, real: set[str]) -> set[tuple[str, str]]:
    """(project, version) of the stand-ins `requirements` need, pins as pinned, unpinned ones at the
    stack's version; projects served as real wheels (`real`) left out."""
    wanted = set()
    for requirement in requirements:
        project = normalize_project(requirement.name)
        if project in real or "extra" in str(requirement.marker or ""):
            continue
        pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        wanted.add((project, pins[0] if pins else _stack_version(project, stack)))
    return wanted


def _stack_standins(sglang: Path, stack: Stack, work: Path) -> list[Path]:
    """The stand-ins of the pypi index one stack's sglang and pins need: its pins of the pypi index,
    every stand-in the cut-down sglang or the stack's other pins (torch's index, direct wheels)
    require, and what those require in turn."""
    real = {normalize_project(name) for name in import_deps(stack.package("sglang").version)}
    wanted = {(package.name, package.version) for package in stack.packages
              if package.index == "pypi" and normalize_project(package.name) not in real | {"sglang"}}
    wanted |= _standins_required(requirements_of(sglang), stack, real)
    for package in stack.packages:
        if package.index != "pypi":
            spec = standin_wheel(package.name, package.version)
            wanted |= _standins_required([Requirement(line) for line in spec.requires], stack, real)
    built: dict[tuple[str, str], Path] = {}
    while pending := sorted(wanted - built.keys()):
        for name, version in pending:
            built[(name, version)] = build_wheel(standin_wheel(name, version), work / "standins")
            wanted |= _standins_required(requirements_of(built[(name, version)]), stack, real)
    return list(built.values())


def _import_dep_requirements(sglang: Path) -> list[str]:
    real = {normalize_project(name) for name in import_deps(_version_of(sglang))}
    return sorted({str(requirement) for requirement in requirements_of(sglang)
                   if normalize_project(requirement.name) in real})


def _version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def _pypi_wheels(work: Path) -> list[Path]:
    """Everything the pypi-like index serves (see the module docstring)."""
    served = []
    stacks = list(manifest().stacks.values())
    # The release with upstream fixes ('upstream patch' tests) stands beside the reference stack.
    pairs = [(stack, stack.package("sglang").version) for stack in stacks]
    pairs.append((reference_stack(), UPSTREAM_PATCHED_VERSION))
    for stack, version in pairs:
        sglang = sglang_wheel(version, work / "sglang")
        served += [sglang, *_stack_standins(sglang, stack, work)]
        served += fetch_wheels(_import_dep_requirements(sglang) + ["pillow"], deps=True)
    served += fetch_wheels([f"uv=={manifest().uv['version']}"])
    return sorted(set(served))


def _index_wheels(index: str, label: str, work: Path) -> list[Path]:
    """Stand-ins of the manifest packages of `index`, with their local label replaced by `label`."""
    return [build_wheel(standin_wheel(package.name, with_label(package.version, label)), work / label)
            for package in manifest().all_packages() if package.index == index]


def _write_broken_indexes(root: Path, torch_wheels: list[Path], work: Path) -> dict[str, Path]:
    broken = {}
    for kind in BROKEN_KINDS:
        bad = [broken_wheel(wheel, work / kind, kind) if wheel.name.startswith("torch-") else wheel
               for wheel in torch_wheels]
        broken[kind] = write_simple_index(root / "broken" / kind / mirror_path(manifest().indexes["torch"]), bad)
    return broken


def build_artifacts(dest: Path, *, runfile_mode: str = "normal") -> ArtifactSet:
    """Build the served tree at `dest` (emptied first); return what is where.

    Fetches real wheels from PyPI on first use (cached, see pypi.py); builds everything else.
    """
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    real_runfile = manifest().runfiles["x86_64"]
    runfile = build_runfile(dest / mirror_path(real_runfile.url).parent, runfile_mode)
    md5sum = write_md5sum(dest / mirror_path(md5sum_url(real_runfile.url)), [runfile])
    with tempfile.TemporaryDirectory(prefix="standin-artifacts-") as work:
        work = Path(work)
        torch_wheels = _index_wheels("torch", target_label(), work)
        indexes = {
            "pypi": write_simple_index(dest / mirror_path(manifest().indexes["pypi"]), _pypi_wheels(work)),
            "torch": write_simple_index(dest / mirror_path(manifest().indexes["torch"]), torch_wheels),
            f"torch-{old_label()}": write_simple_index(dest / mirror_path(old_torch_index_url()),
                                                       _index_wheels("torch", old_label(), work)),
            "flashinfer": write_simple_index(dest / mirror_path(manifest().indexes["flashinfer"]),
                                             _index_wheels("flashinfer", target_label(), work)),
        }
        wheels = {}
        for package in manifest().all_packages():
            if package.wheel:
                target = dest / mirror_path(package.wheel["x86_64"])
                # the version the file name says (sgl-kernel's +cu130 is there only, not in METADATA)
                built = build_wheel(standin_wheel(package.name, _version_of(target)), work / "direct")
                if built.name != target.name:
                    raise RuntimeError(f"stand-in {built.name} does not match the manifest's file {target.name}")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(built, target)
                wheels[package.name] = target
        broken = _write_broken_indexes(dest, torch_wheels, work)
    return ArtifactSet(dest, runfile, runfile_info(runfile), md5sum, indexes, wheels, broken)
