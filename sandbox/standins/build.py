"""The whole tree the sandbox's artifact server serves, mirroring the manifest's URLs.

Each manifest URL `https://HOST/PATH` is served at `http://SERVER/HOST/PATH`, so pointing a host
at the sandbox only swaps the scheme and host part (`ArtifactSet.url`, `ArtifactSet.host_data`):

- HOST/.../local_installers/<runfile>: the stand-in CUDA runfile (runfile.py), and NVIDIA's
  .../docs/sidebar/md5sum.txt beside it;
- pypi.org/simple/: for each stack of the manifest, every package of its real resolution from
  PyPI (closure.py): the real sglang wheel and the real wheels SGLang imports before any GPU work
  (sglang.py), stand-ins carrying their real metadata for the rest (torch 2.11.0, the nvidia-*
  libraries, ...); the real sglang 0.5.10 (upstream patch tests) and uv wheels;
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
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from sandbox.standins import closure
from sandbox.standins.index import normalize_project, write_simple_index
from sandbox.standins.pypi import fetch_wheels
from sandbox.standins.runfile import RunfileInfo, build_runfile, runfile_info, write_md5sum
from sandbox.standins.sglang import UPSTREAM_PATCHED_VERSION, server_args_imports
from sandbox.standins.stack import manifest, old_label, target_label, with_label
from sandbox.standins.wheels import BROKEN_KINDS, CODE_STANDINS, broken_wheel, build_wheel, standin_wheel
from servestack.manifest import Stack


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


def stack_wheels(stack: Stack, work: Path) -> list[Path]:
    """What the pypi-like index serves for one stack: every package of its real resolution from PyPI
    (closure.resolve), real where SGLang imports it before any GPU work, else a stand-in carrying its
    real metadata (a code stand-in where one exists, metadata-only otherwise)."""
    lock = closure.resolve(stack)
    elsewhere = {normalize_project(package.name) for package in stack.packages if package.index != "pypi"}
    pins = {name: version for name, version in lock.items() if name not in elsewhere}
    metadata = closure.pypi_metadata(pins)
    roots = set(server_args_imports(pins["sglang"])) & set(pins)
    real = closure.requirements_closure(roots, metadata, stop=standin_projects(pins)) | {"sglang"}
    served = fetch_wheels(sorted(f"{name}=={pins[name]}" for name in real))
    served += [build_wheel(standin_wheel(name, pins[name], metadata[name]), work / "standins")
               for name in sorted(set(pins) - real)]
    return served


def standin_projects(pins: dict[str, str]) -> set[str]:
    """The projects served as stand-ins whatever needs them: those with code stand-ins and the CUDA
    libraries (nvidia-*, cuda-*)."""
    return {name for name in pins if name in CODE_STANDINS or name.startswith(("nvidia-", "cuda-"))}


def _version_of(wheel: Path) -> str:
    """The version a wheel's file name says."""
    return wheel.name.split("-")[1]


def _pypi_wheels(work: Path) -> tuple[list[Path], dict[str, str]]:
    """Everything the pypi-like index serves (see the module docstring), and each file's upload time:
    an hour before the earliest bound of the stacks that resolve it. So each stack resolves here what
    it resolves on PyPI: a version a later stack picks stays out of an earlier stack's resolution,
    as its real upload after that bound keeps it out there."""
    served, times = [], {}
    for stack in sorted(manifest().stacks.values(), key=lambda stack: stack.exclude_newer, reverse=True):
        before = (datetime.strptime(stack.exclude_newer, "%Y-%m-%dT%H:%M:%SZ") - timedelta(hours=1))
        for wheel in stack_wheels(stack, work):
            served.append(wheel)
            times[wheel.name] = before.strftime("%Y-%m-%dT%H:%M:%SZ")
    served += fetch_wheels([f"sglang=={UPSTREAM_PATCHED_VERSION}", f"uv=={manifest().uv['version']}"])
    return sorted(set(served)), times


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
    with tempfile.TemporaryDirectory(prefix="standin-artifacts-") as work_dir:
        work = Path(work_dir)
        torch_wheels = _index_wheels("torch", target_label(), work)
        indexes = {
            "pypi": write_simple_index(dest / mirror_path(manifest().indexes["pypi"]), *_pypi_wheels(work)),
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
