"""STAND-IN for PyTorch's CUDA device layer (servestack sandbox): SIMULATED GPUs, no CUDA code.

The stand-in torch sees the GPUs the sandbox host's stand-in nvidia-smi lists, as real torch sees
what the driver answers for: when that stand-in answers, `torch.cuda` reports its GPUs (count, name,
compute capability, memory), and the few tensor operations servestack's verify check runs
(files/scripts/verify-python.py: `arange`, `ones`, `*`, `@`, `.sum()`, `.item()`) are computed in
Python on the controller's behalf. When it does not answer (a host given a driver that is not
loaded), or when nvidia-smi is not the sandbox's stand-in (a real one is never taken for it), torch
sees no GPU and warns as real torch does. Results here are simulated, never a GPU's.
"""

import functools
import os
import shutil
import subprocess
import warnings

STANDIN_SMI_MARK = "STAND-IN for NVIDIA's nvidia-smi"
# real torch's words: the error of a device query, and is_available()'s warning (its c10 source location left out)
NO_DRIVER = ("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a "
             "driver from http://www.nvidia.com/Download/index.aspx")
NO_DRIVER_WARNING = "CUDA initialization: " + NO_DRIVER


class Gpu:
    def __init__(self, name, major, minor, memory_mib):
        self.name, self.major, self.minor = name, major, minor
        self.total_memory = memory_mib * 1024 * 1024
        self.multi_processor_count = 0


def gpus():
    """The GPUs torch sees: the driver's, less those CUDA_VISIBLE_DEVICES hides."""
    return tuple(driver_gpus()[index] for index in visible(len(driver_gpus())))


@functools.lru_cache(maxsize=1)
def driver_gpus():
    """The stand-in nvidia-smi's GPUs; () when there is none or it does not answer."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return ()
    try:
        with open(path, errors="replace") as script:
            if STANDIN_SMI_MARK not in script.read(8192):
                return ()
        answer = subprocess.run([path, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ()
    if answer.returncode != 0:
        return ()
    found = []
    for line in answer.stdout.splitlines():
        name, capability, memory = (part.strip() for part in line.rsplit(",", 2))
        major, minor = capability.split(".")
        found.append(Gpu(name, int(major), int(minor), int(memory)))
    return tuple(found)


def visible(count):
    """The ordinals CUDA_VISIBLE_DEVICES leaves visible, as the CUDA runtime reads it: indexes up to the first
    entry that is not one of these GPUs (real torch on an H200 with 'none': no GPU, and no warning)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return range(count)
    indexes = []
    for entry in listed.split(","):
        if not entry.strip().isdigit() or int(entry) >= count:
            break
        indexes.append(int(entry))
    return indexes


def is_available():
    if not driver_gpus():
        warnings.warn(NO_DRIVER_WARNING, UserWarning, stacklevel=2)
    return bool(gpus())


def device_count():
    return len(gpus())


def _index(device):
    """The ordinal of `device`: None, 3, "cuda", "cuda:3" or a torch.device."""
    if isinstance(device, str):
        return int(device.partition(":")[2] or 0)
    if device is None or isinstance(device, int):
        return device or 0
    return device.index or 0


def _gpu(device=None):
    index = _index(device)
    if not gpus():
        raise RuntimeError(NO_DRIVER)
    if not 0 <= index < len(gpus()):
        raise RuntimeError("CUDA error: invalid device ordinal")
    return gpus()[index]


def get_device_capability(device=None):
    gpu = _gpu(device)
    return (gpu.major, gpu.minor)


def get_device_name(device=None):
    return _gpu(device).name


def get_device_properties(device=None):
    return _gpu(device)


def mem_get_info(device=None):
    gpu = _gpu(device)
    return (gpu.total_memory, gpu.total_memory)


def current_device():
    _gpu(0)
    return 0


def set_device(device):
    _gpu(device)


def synchronize(device=None):
    _gpu(device)


class SimulatedTensor:
    """A flat tensor of numbers on a simulated GPU: only what the verify check computes."""

    def __init__(self, values, shape, device):
        self.values, self.shape, self.device = list(values), tuple(shape), device

    def __mul__(self, factor):
        return SimulatedTensor([value * factor for value in self.values], self.shape, self.device)

    def __matmul__(self, other):
        rows, inner = self.shape
        cols = other.shape[1]
        values = [sum(self.values[r * inner + k] * other.values[k * cols + c] for k in range(inner))
                  for r in range(rows) for c in range(cols)]
        return SimulatedTensor(values, (rows, cols), self.device)

    def sum(self):
        return SimulatedTensor([sum(self.values)], (), self.device)

    def item(self):
        return self.values[0]


def _on(device):
    if device is None or not str(getattr(device, "type", device)).startswith("cuda"):
        raise NotImplementedError("the stand-in torch computes only on its simulated CUDA devices")
    _gpu(device)
    return device


def arange(end, device=None, dtype=None):
    return SimulatedTensor([float(value) for value in range(end)], (end,), _on(device))


def ones(*shape, device=None, dtype=None):
    count = 1
    for size in shape:
        count *= size
    return SimulatedTensor([1.0] * count, shape, _on(device))
