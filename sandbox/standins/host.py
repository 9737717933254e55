"""Dress a sandbox host's root directory, before it boots, as a GPU inference host before the upgrade.

`dress_gpu_host(root)` writes into the host's tree (e.g. the upper dir of its overlay):

- /usr/bin/nvidia-smi: the nvidia-smi stand-in (8x RTX PRO 6000 Blackwell by default);
- a boot unit making /dev/nvidiactl and /dev/nvidiaN stand-ins (plain files: what a loaded driver's
  kernel module makes, for the checks that look for them) when the stand-in's driver is loaded;
- /usr/local/cuda-12.8: a stand-in CUDA 12.8.1 toolkit, and /usr/local/cuda -> cuda-12.8;
- /opt/ml-env: a venv laid out as `uv venv` makes it on Debian bookworm's python3 3.11.2
  (pyvenv.cfg naming uv, bin/python -> /usr/bin/python3, lib64 -> lib), holding the stand-in
  torch, torchvision and torchaudio cu128 builds installed as uv installs them (INSTALLER "uv",
  REQUESTED, RECORD).
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version

from sandbox.standins.nvidia_smi import Gpu, render_nvidia_smi
from sandbox.standins.stack import (HOST_PYTHON, HOST_PYTHON_VERSION, OLD_CUDA_VERSION,
                                    OLD_NVCC_VERSION, manifest, old_label, package_version,
                                    with_label)
from sandbox.standins.toolkit import write_toolkit_tree
from sandbox.standins.wheels import build_wheel, record_hash, standin_wheel

OLD_TORCH_STACK = ("torch", "torchvision", "torchaudio")


def _inside(root: Path, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def install_nvidia_smi(root: Path, gpu: Gpu | None = None) -> Path:
    """Write the nvidia-smi stand-in at ROOT/usr/bin/nvidia-smi (mode 0755)."""
    path = _inside(root, "/usr/bin/nvidia-smi")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_nvidia_smi(gpu))
    path.chmod(0o755)
    return path


DEVICE_NODES_UNIT = "servestack-standin-gpu-nodes.service"


def install_device_nodes(root: Path, gpu: Gpu | None = None) -> Path | None:
    """Write, enabled, a unit that makes the stand-in GPUs' device nodes at boot (/dev is made anew
    then): /dev/nvidiactl and one /dev/nvidiaN per GPU, plain files. None when the stand-in's driver
    is not loaded: a host whose kernel module did not load has no nodes."""
    gpu = gpu or Gpu()
    if not gpu.driver_loaded:
        return None
    nodes = " ".join(["/dev/nvidiactl", *(f"/dev/nvidia{index}" for index in range(gpu.count))])
    unit = _inside(root, f"/etc/systemd/system/{DEVICE_NODES_UNIT}")
    _write(unit, f"""# STAND-IN for the NVIDIA kernel module's device nodes (servestack sandbox): \
plain files, no driver.
[Unit]
Description=servestack sandbox: stand-in NVIDIA device nodes
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/touch {nodes}
ExecStart=/usr/bin/chmod 0666 {nodes}

[Install]
WantedBy=sysinit.target
""")
    wants = _inside(root, f"/etc/systemd/system/sysinit.target.wants/{DEVICE_NODES_UNIT}")
    wants.parent.mkdir(parents=True, exist_ok=True)
    if not wants.is_symlink():
        wants.symlink_to(f"/etc/systemd/system/{DEVICE_NODES_UNIT}")
    return unit


def install_old_toolkit(root: Path) -> Path:
    """Write the CUDA 12.8 stand-in at ROOT/usr/local/cuda-12.8 and point ROOT/usr/local/cuda at it."""
    release = Version(OLD_CUDA_VERSION).release
    name = f"cuda-{release[0]}.{release[1]}"
    toolkit = write_toolkit_tree(_inside(root, f"/usr/local/{name}"), OLD_CUDA_VERSION, OLD_NVCC_VERSION)
    link = _inside(root, "/usr/local/cuda")
    if link.is_symlink():
        link.unlink()
    link.symlink_to(name)
    return toolkit


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def write_uv_venv(venv: Path, venv_path: str) -> Path:
    """Lay out an empty venv at `venv` as `uv venv` creates it at `venv_path` on the hosts' python3."""
    uv_version = manifest().uv["version"]
    _write(venv / "pyvenv.cfg", f"home = /usr/bin\nimplementation = CPython\nuv = {uv_version}\n"
                                f"version_info = {HOST_PYTHON_VERSION}\ninclude-system-site-packages = false\n")
    _write(venv / ".gitignore", "*")
    _write(venv / "CACHEDIR.TAG", "Signature: 8a477f597d28d172789f06886806bc55")
    _write(venv / ".lock", "")
    _write(venv / "bin" / "activate", _ACTIVATE.replace("@VENV@", venv_path))
    (venv / "lib" / f"python{HOST_PYTHON}" / "site-packages").mkdir(parents=True, exist_ok=True)
    (venv / "lib64").symlink_to("lib")
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    for alias in ("python3", f"python{HOST_PYTHON}"):
        (venv / "bin" / alias).symlink_to("python")
    return venv


def install_wheel(wheel: Path, venv: Path) -> None:
    """Unpack a pure, script-less wheel into `venv` as uv does: files, INSTALLER 'uv', REQUESTED, RECORD."""
    site = venv / "lib" / f"python{HOST_PYTHON}" / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    if any(".data/" in name for name in entries):
        raise ValueError(f"{Path(wheel).name}: has a .data directory, which install_wheel does not handle")
    dist_info = next(name.split("/")[0] for name in entries if name.endswith(".dist-info/RECORD"))
    record = f"{dist_info}/RECORD"
    entries[f"{dist_info}/INSTALLER"] = b"uv"
    entries[f"{dist_info}/REQUESTED"] = b""
    lines = [f"{name},{record_hash(data)},{len(data)}" for name, data in entries.items() if name != record]
    entries[record] = ("\n".join(sorted(lines + [f"{record},,"])) + "\n").encode()
    for name, data in entries.items():
        target = site / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def install_ml_env(root: Path) -> Path:
    """Write the pre-upgrade /opt/ml-env (path from the manifest) with torch/vision/audio cu128 stand-ins."""
    venv_path = manifest().venv["path"]
    venv = write_uv_venv(_inside(root, venv_path), venv_path)
    with tempfile.TemporaryDirectory(prefix="standin-wheels-") as work:
        for name in OLD_TORCH_STACK:
            version = with_label(package_version(name), old_label())
            install_wheel(build_wheel(standin_wheel(name, version), Path(work)), venv)
    return venv


def dress_gpu_host(root: Path, *, gpu: Gpu | None = None, with_cuda_128: bool = True,
                   with_ml_env: bool = True) -> Path:
    """Make the host tree at `root` look like a GPU host before the upgrade (see the module docstring)."""
    root = Path(root)
    install_nvidia_smi(root, gpu)
    install_device_nodes(root, gpu)
    if with_cuda_128:
        install_old_toolkit(root)
    if with_ml_env:
        install_ml_env(root)
    return root


_ACTIVATE = '''# Activate the venv @VENV@ (source this file from a POSIX shell).
deactivate () {
    if [ -n "${_OLD_VIRTUAL_PATH:-}" ]; then PATH="$_OLD_VIRTUAL_PATH"; export PATH; unset _OLD_VIRTUAL_PATH; fi
    unset VIRTUAL_ENV VIRTUAL_ENV_PROMPT
    if [ "${1:-}" != "nondestructive" ]; then unset -f deactivate; fi
}
deactivate nondestructive
VIRTUAL_ENV='@VENV@'
export VIRTUAL_ENV
_OLD_VIRTUAL_PATH="$PATH"
PATH="$VIRTUAL_ENV/bin:$PATH"
export PATH
VIRTUAL_ENV_PROMPT="$(basename "$VIRTUAL_ENV")"
export VIRTUAL_ENV_PROMPT
hash -r 2>/dev/null || true
'''
