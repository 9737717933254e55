"""Everything preflight (and `servestack doctor`) checks, read in one remote command.

The command is the GPU, disk, lock and toolkit facts' commands, each in its own subshell and
section (facts.host.combine_sections); `process` hands each section to that fact's parser.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from facts.gpu import GpuReport, gpu_command, parse_gpu_output
from facts.host import LockState, combine_sections, disk_command, lock_read_command, parse_disks, parse_lock, split_sections
from facts.toolkit import ToolkitState, parse_toolkits, toolkits_command


@dataclass(frozen=True)
class PreflightFacts:
    """What the host says: GPUs and driver, free space, the run lock, the toolkits (and arch)."""

    gpu: GpuReport
    disks: dict = field(default_factory=dict)
    lock: LockState = LockState()
    toolkit: ToolkitState | None = None
    gpu_output: tuple[str, ...] = ()    # the GPU section as read (the verify step judges it too)

    @property
    def arch(self) -> str | None:
        return self.toolkit.arch if self.toolkit else None


class HostPreflight(FactBase):
    """GPUs, disk space for `disk_paths`, the lock in `state_dir`, and the CUDA toolkits.

    + state_dir: servestack's state directory (lock, records)
    + install_path, keep_paths, link_path: as for facts.toolkit.CudaToolkits
    + files: runfile paths to stat
    + disk_paths: paths whose filesystem's free space matters
    + toolkit: False leaves the toolkits out (``toolkit`` is then None): the deploy reads them as
      the toolkit step's own fact in the same probe, so that they are read once per run
    """

    probe_background = True  # starts nvidia-smi, df (facts/probe.py)

    def command(self, state_dir, install_path, keep_paths, link_path, files=(), disk_paths=(), toolkit=True):
        header = json.dumps({"install_path": install_path, "link_path": link_path, "toolkit": bool(toolkit)})
        sections = {
            "gpu": gpu_command(),
            "disk": disk_command(tuple(disk_paths)),
            "lock": lock_read_command(state_dir),
        }
        if toolkit:
            sections["toolkit"] = toolkits_command(install_path, tuple(keep_paths), link_path, state_dir, tuple(files))
        return f"echo {shlex.quote('args ' + header)}; " + combine_sections(sections)

    @staticmethod
    def default():
        return None

    def process(self, output):
        header = json.loads(output[0][5:]) if output and output[0].startswith("args ") else {}
        sections = split_sections(output[1:] if header else output)
        return PreflightFacts(
            gpu=parse_gpu_output(sections.get("gpu", [])),
            gpu_output=tuple(sections.get("gpu", [])),
            disks=parse_disks(sections.get("disk", [])),
            lock=parse_lock(sections.get("lock", [])),
            toolkit=parse_toolkits(header.get("install_path", ""), header.get("link_path", ""),
                                   sections.get("toolkit", [])) if header.get("toolkit", True) else None,
        )
