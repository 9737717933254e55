"""What the stand-ins read from the manifest (files/stack.toml) and know of the hosts.

Every version the deploy pins comes from the manifest here. The stand-ins hold only versions
the manifest does not describe: the *old* stack the upgrade starts from (CUDA 12.8.1, torch
cu128, below), the hosts' Python, and facts of upstream releases kept next to their use
(nvcc build strings in toolkit.py, the sglang release with upstream fixes in sglang.py).
"""

from __future__ import annotations

from packaging.version import Version

from servestack.manifest import Manifest, Stack, load_manifest

#: The CUDA toolkit the fleet runs before the upgrade (a runfile install of 12.8 Update 1).
OLD_CUDA_VERSION = "12.8.1"
OLD_NVCC_VERSION = "12.8.93"

#: The sandbox hosts' /usr/bin/python3 (Debian bookworm), which their venvs are built on.
HOST_PYTHON_VERSION = "3.11.2"
HOST_PYTHON = "3.11"


def manifest() -> Manifest:
    """The parsed default manifest."""
    return load_manifest()


def reference_stack() -> Stack:
    """The stack of the manifest's default service profile: what the fleet's hosts ran, in their
    CUDA 12.8 builds, before the upgrade."""
    service = manifest().service
    return manifest().stacks[service["profiles"][service["profile"]]["stack"]]


def package_version(name: str, stack: Stack | None = None) -> str:
    """The pinned version of package `name` (with its local label, if any) in `stack` (default: the
    reference stack)."""
    return (stack or reference_stack()).package(name).version


def cuda_label(cuda_version: str) -> str:
    """PyTorch-style local label of a CUDA version: '13.0.1' -> 'cu130', '12.8' -> 'cu128'."""
    release = Version(cuda_version).release
    return f"cu{release[0]}{release[1] if len(release) > 1 else 0}"


def with_label(version: str, label: str | None) -> str:
    """`version` with its local label replaced by `label` (None: no label)."""
    public = Version(version).public
    return f"{public}+{label}" if label else public


def target_label() -> str:
    """The local label of the target CUDA ('cu130')."""
    return cuda_label(manifest().cuda["version"])


def old_label() -> str:
    """The local label of the CUDA the fleet runs before the upgrade ('cu128')."""
    return cuda_label(OLD_CUDA_VERSION)
