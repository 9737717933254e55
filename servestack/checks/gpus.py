"""What the GPUs must be, judged once for preflight (before anything changes: operations/preflight.py
`check_gpus`, `check_compute_capability`) and for the GPU checks of the verification suite.

`GpuExpectation` holds what host data and the manifest expect (gpu_count, gpu_compute_capability,
the driver minimum of the CUDA release) and says which GPUs or drivers differ; each caller words
its verdict, naming those GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from facts.gpu import Gpu, GpuReport
from servestack.checks.outcome import Fail
from servestack.checks.parse import version_or_none
from servestack.settings import Settings


def capability(text: str) -> tuple[int, ...] | None:
    """A compute capability ("9.0") as numbers, or None when it is not one."""
    try:
        return tuple(int(part) for part in text.strip().split("."))
    except ValueError:
        return None


@dataclass(frozen=True)
class GpuExpectation:
    count: int
    capability: str
    min_driver: str

    @classmethod
    def of(cls, settings: Settings) -> "GpuExpectation":
        return cls(settings.gpu_count, settings.gpu_compute_capability, settings.manifest.cuda["min_driver"])

    def count_differs(self, report: GpuReport) -> bool:
        return len(report.gpus) != self.count

    def other_capability(self, report: GpuReport) -> list[Gpu]:
        """The GPUs whose compute capability is not the expected one."""
        return [gpu for gpu in report.gpus if capability(gpu.compute_cap) != capability(self.capability)]

    def drivers(self, report: GpuReport) -> list[str]:
        """The driver versions the GPUs report (several only in a host mid-upgrade)."""
        return sorted({gpu.driver_version for gpu in report.gpus})

    def old_drivers(self, report: GpuReport) -> list[str]:
        """The drivers older than the minimum (one that is not a version counts as older)."""
        return [driver for driver in self.drivers(report)
                if (version_or_none(driver) or Version("0")) < Version(self.min_driver)]


# --- the verification checks -------------------------------------------------------------------


def _gpus(settings: Settings, readings) -> GpuReport:
    """The GPUs the driver answers for. Host data always expects some (gpu_count >= 1), so a
    driver that does not answer fails the check, with nvidia-smi's own cause."""
    if not readings.gpu.gpus:
        raise Fail(no_driver_answer(settings, readings.on, readings.gpu.error))
    return readings.gpu


def no_driver_answer(settings: Settings, on: str, cause: str | None) -> str:
    """Why a GPU check fails on a host whose driver does not answer (shared by every GPU check)."""
    return f"no NVIDIA driver answers {on}, host data expects gpu_count = {settings.gpu_count}: {cause}"


def driver_version(settings: Settings, readings) -> str:
    report, expect = _gpus(settings, readings), GpuExpectation.of(settings)
    drivers = ", ".join(expect.drivers(report))
    if expect.old_drivers(report):
        raise Fail(f"driver {drivers} {readings.on} is older than the manifest minimum {expect.min_driver} "
                   f"(CUDA {settings.cuda_version} needs it)")
    return f"driver {drivers} >= {expect.min_driver}"


def gpu_capability(settings: Settings, readings) -> str:
    report, expect = _gpus(settings, readings), GpuExpectation.of(settings)
    other = expect.other_capability(report)
    if other:
        raise Fail(f"expected compute capability {expect.capability} {readings.on}: "
                   + "; ".join(f"{gpu.describe()} reports {gpu.compute_cap}" for gpu in other))
    return f"{len(report.gpus)} GPU(s) report compute capability {expect.capability}"


def gpu_count(settings: Settings, readings) -> str:
    report, expect = _gpus(settings, readings), GpuExpectation.of(settings)
    if expect.count_differs(report):
        raise Fail(f"nvidia-smi lists {len(report.gpus)} GPU(s) {readings.on}, host data gpu_count is "
                   f"{expect.count}")
    return f"{len(report.gpus)} GPU(s), as gpu_count says"
