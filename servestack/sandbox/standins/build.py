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

from packaging.version import Version

from servestack.sandbox.standins.index import normalize_project, write_simple_index
from servestack.sandbox.standins.pypi import fetch_wheels
from servestack.sandbox.standins.runfile import RunfileInfo, build_runfile, runfile_info, write_md5sum
from servestack.sandbox.standins.sglang import IMPORT_DEPS, UPSTREAM_PATCHED_VERSION, requirements_of, sglang_wheel
from servestack.sandbox.standins.stack import manifest, old_label, target_label, with_label
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


def _pinned_standins(sglang_wheels: list[Path]) -> list[tuple[str, str]]:
    """(project, version) of every stack package the sglang wheels require: pins as pinned,
    unpinned ones at the manifest's public version."""
    wanted = set()
    for wheel in sglang_wheels:
        for requirement in requirements_of(wheel):
            if normalize_project(requirement.name) in IMPORT_DEPS:
                continue
            pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            version = pins[0] if pins else Version(manifest().package(requirement.name).version).public
            wanted.add((normalize_project(requirement.name), version))
    return sorted(wanted)


def _import_dep_requirements(sglang_wheels: list[Path]) -> list[str]:
    return sorted({str(requirement) for wheel in sglang_wheels for requirement in requirements_of(wheel)
                   if normalize_project(requirement.name) in IMPORT_DEPS})


def _pypi_wheels(work: Path) -> list[Path]:
    """Everything the pypi-like index serves (see the module docstring)."""
    sglang_version = manifest().package("sglang").version
    sglang = [sglang_wheel(version, work / "sglang") for version in (sglang_version, UPSTREAM_PATCHED_VERSION)]
    standins = set(_pinned_standins(sglang))
    standins |= {(package.name, package.version) for package in manifest().packages
                 if package.index == "pypi" and package.name != "sglang"}
    built = [build_wheel(standin_wheel(name, version), work / "standins") for name, version in sorted(standins)]
    uv = fetch_wheels([f"uv=={manifest().uv['version']}"])
    deps = fetch_wheels(_import_dep_requirements(sglang), deps=True)
    return sglang + built + uv + deps


def _index_wheels(index: str, label: str, work: Path) -> list[Path]:
    """Stand-ins of the manifest packages of `index`, with their local label replaced by `label`."""
    return [build_wheel(standin_wheel(package.name, with_label(package.version, label)), work / label)
            for package in manifest().packages if package.index == index]


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
        for package in manifest().packages:
            if package.wheel:
                target = dest / mirror_path(package.wheel["x86_64"])
                built = build_wheel(standin_wheel(package.name, package.version), work / "direct")
                if built.name != target.name:
                    raise RuntimeError(f"stand-in {built.name} does not match the manifest's file {target.name}")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(built, target)
                wheels[package.name] = target
        broken = _write_broken_indexes(dest, torch_wheels, work)
    return ArtifactSet(dest, runfile, runfile_info(runfile), md5sum, indexes, wheels, broken)
