"""What preflight (and `servestack doctor`) judges, as read from the host (operations/preflight.py
`read_preflight` reads it: the GPU, disk, lock and toolkit facts, in one remote command, then the
runfile's digest when an install is due and a runfile is there to check)."""

from __future__ import annotations

from dataclasses import dataclass, field

from facts.gpu import GpuReport
from facts.host import LockState
from facts.toolkit import Digest, ToolkitState


@dataclass(frozen=True)
class PreflightFacts:
    """What the host says: GPUs and driver, free space, the run lock, the toolkits (and arch)."""

    gpu: GpuReport
    disks: dict = field(default_factory=dict)
    lock: LockState = LockState()
    toolkit: ToolkitState | None = None
    runfile_digest: Digest | None = None      # read only when an install is due and a runfile is there
    service: tuple = ()         # (curl found, the unit's state, the service user's account, useradd found)

    @property
    def arch(self) -> str | None:
        return self.toolkit.arch if self.toolkit else None
