"""What preflight (and `servestack doctor`) judges, as read from the host (operations/preflight.py
`read_preflight` reads it: the GPU, disk, lock and toolkit facts, in one remote command)."""

from __future__ import annotations

from dataclasses import dataclass, field

from facts.gpu import GpuReport
from facts.host import LockState
from facts.toolkit import ToolkitState


@dataclass(frozen=True)
class PreflightFacts:
    """What the host says: GPUs and driver, free space, the run lock, the toolkits (and arch)."""

    gpu: GpuReport
    disks: dict = field(default_factory=dict)
    lock: LockState = LockState()
    toolkit: ToolkitState | None = None

    @property
    def arch(self) -> str | None:
        return self.toolkit.arch if self.toolkit else None
