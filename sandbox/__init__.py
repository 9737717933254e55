"""Throwaway Debian hosts (systemd-nspawn + network namespaces) reached over real SSH.

See `Sandbox` for the lifecycle; `ensure_rootfs` builds the cached root filesystem.
"""

from sandbox.hosts import Host, Sandbox, SandboxError, default_state_dir
from sandbox.network import AddressCollision
from sandbox.rootfs import SUDO_USER, ensure_rootfs

__all__ = ["AddressCollision", "Host", "SUDO_USER", "Sandbox", "SandboxError", "default_state_dir", "ensure_rootfs"]
