"""What the NVIDIA driver says about a host's GPUs.

One remote command reads `nvidia-smi --query-gpu=... --format=csv,noheader` (one CSV line per
GPU) and, as a fallback for the driver version when nvidia-smi is missing or fails,
`/proc/driver/nvidia/version`. The command never fails: a missing tool, a driver that does
not answer, or "No devices were found" are reported in `GpuReport.error`.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

from pyinfra.api import FactBase

QUERY_FIELDS = ("index", "name", "compute_cap", "driver_version", "memory.total", "uuid", "pci.bus_id")
SMI_TIMEOUT_S = 60

_PROC_DRIVER = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it."""

    index: int
    name: str
    compute_cap: str
    driver_version: str
    memory_mib: int | None
    uuid: str
    bus_id: str

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.bus_id})"

    @property
    def capability(self) -> int | None:
        """The compute capability as sglang compares it (major * 10 + minor); None when nvidia-smi gave none."""
        match = re.fullmatch(r"(\d+)\.(\d)", self.compute_cap.strip())
        return int(match[1]) * 10 + int(match[2]) if match else None


@dataclass(frozen=True)
class GpuReport:
    """The GPUs the driver answers for, the driver version, or why there is no answer."""

    gpus: tuple[Gpu, ...] = ()
    driver_version: str | None = None
    error: str | None = None


def gpu_command() -> str:
    """Shell command printing `smi_exit N` + `smi <line>`, or `smi_missing`, then `proc <line>`."""
    fields = ",".join(QUERY_FIELDS)
    return (
        "if command -v nvidia-smi >/dev/null 2>&1; then "
        f"if command -v timeout >/dev/null 2>&1; then t='timeout {SMI_TIMEOUT_S}'; else t=''; fi; "
        f"out=$($t nvidia-smi --query-gpu={fields} --format=csv,noheader 2>&1); rc=$?; "
        # the prefixes with builtins (no sed): this runs on every converge
        'echo "smi_exit $rc"; printf "%s\\n" "$out" | while IFS= read -r l; do printf "smi %s\\n" "$l"; done; '
        "else echo smi_missing; fi; "
        "if [ -r /proc/driver/nvidia/version ]; then while IFS= read -r l || [ -n \"$l\" ]; do "
        "printf 'proc %s\\n' \"$l\"; done < /proc/driver/nvidia/version; fi; "
        "true"
    )


def _memory_mib(text: str) -> int | None:
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else None


def parse_gpu_query(lines: list[str]) -> list[Gpu]:
    """Parse `--query-gpu=<QUERY_FIELDS> --format=csv,noheader` lines (no header) into GPUs.

    Raises ValueError on a line that does not have one value per field.
    """
    gpus = []
    for row in csv.reader((line for line in lines if line.strip()), skipinitialspace=True):
        if len(row) != len(QUERY_FIELDS):
            raise ValueError(f"expected {len(QUERY_FIELDS)} values, got {row!r}")
        values = dict(zip(QUERY_FIELDS, (value.strip() for value in row)))
        gpus.append(Gpu(
            index=int(values["index"]),
            name=values["name"],
            compute_cap=values["compute_cap"],
            driver_version=values["driver_version"],
            memory_mib=_memory_mib(values["memory.total"]),
            uuid=values["uuid"],
            bus_id=values["pci.bus_id"],
        ))
    return gpus


def parse_proc_driver_version(text: str) -> str | None:
    """The driver version in `/proc/driver/nvidia/version`, or None."""
    match = _PROC_DRIVER.search(text)
    return match.group(1) if match else None


#: nvidia-smi's exit statuses, as its manual page words them (nvidia-smi(1), RETURN VALUE; e.g.
#: https://manpages.ubuntu.com/manpages/xenial/man1/alt-nvidia-384-smi.1.html).
SMI_EXITS = {
    2: "a supplied argument or flag is invalid",
    3: "the requested operation is not available on target device",
    4: "the current user does not have permission to access this device",
    6: "a query to find an object was unsuccessful",
    8: "a device's external power cables are not properly attached",
    9: "NVIDIA driver is not loaded",
    10: "NVIDIA kernel detected an interrupt issue with a GPU",
    12: "NVML shared library couldn't be found or loaded",
    13: "local version of NVML doesn't implement this function",
    14: "infoROM is corrupted",
    15: "the GPU has fallen off the bus or has otherwise become inaccessible",
    255: "other error or internal driver error occurred",
}


def _smi_error(exit_code: int, lines: list[str]) -> str:
    text = " ".join(line.strip() for line in lines if line.strip()) or "no output"
    if exit_code == 124:
        return f"nvidia-smi did not answer within {SMI_TIMEOUT_S} s (exit 124: the driver hangs)"
    meaning = f": {SMI_EXITS[exit_code]}" if exit_code in SMI_EXITS else ""
    return f"nvidia-smi failed (exit {exit_code}{meaning}): {text}"


def parse_gpu_output(lines: list[str]) -> GpuReport:
    """Turn the output of `gpu_command()` into a GpuReport."""
    smi_lines = [line[4:] for line in lines if line.startswith("smi ")]
    proc_text = "\n".join(line[5:] for line in lines if line.startswith("proc "))
    proc_driver = parse_proc_driver_version(proc_text)
    exits = [line.split()[1] for line in lines if line.startswith("smi_exit ")]
    if "smi_missing" in lines:
        return GpuReport(driver_version=proc_driver, error="nvidia-smi not found (no NVIDIA driver installed?)")
    if not exits:
        return GpuReport(driver_version=proc_driver, error="nvidia-smi gave no answer")
    exit_code = int(exits[0])
    if exit_code == 6:
        return GpuReport(driver_version=proc_driver, error="no GPU visible (nvidia-smi exit 6: No devices were found)")
    if exit_code == 0 and not any(line.strip() for line in smi_lines):
        return GpuReport(driver_version=proc_driver, error="no GPU visible (nvidia-smi exit 0 listed none)")
    if exit_code != 0:
        return GpuReport(driver_version=proc_driver, error=_smi_error(exit_code, smi_lines))
    try:
        gpus = parse_gpu_query(smi_lines)
    except ValueError as problem:
        return GpuReport(driver_version=proc_driver, error=f"unexpected nvidia-smi output: {problem}")
    driver = gpus[0].driver_version if gpus else proc_driver
    return GpuReport(gpus=tuple(gpus), driver_version=driver)


class NvidiaGpus(FactBase):
    """The host's GPUs and NVIDIA driver version (see `GpuReport`); never fails."""

    slow = True  # starts nvidia-smi, which wakes the driver for every GPU (facts/batch.py)
    once_per_run = True  # the hardware and its driver: no step, and no other run, changes them (servestack/reads.py)

    def command(self) -> str:
        return gpu_command()

    @staticmethod
    def default() -> GpuReport:
        return GpuReport(error="no answer from the host")

    def process(self, output: list[str]) -> GpuReport:
        return parse_gpu_output(output)
