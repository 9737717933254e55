"""@NOTE@.

What it says is true of the build it stands for: `__version__` and `torch.version.cuda` (torch/version.py, with
the local label real torch reports even where the wheel's version has none: PyPI's 2.11.0 says 2.11.0+cu130), and
`torch.backends.cudnn.version()`, which (as real torch loads the cuDNN of the nvidia-cudnn wheel
installed beside it) is the version of the installed nvidia-cudnn-cu13/-cu12 distribution. Its GPUs
are SIMULATED: those the sandbox's stand-in nvidia-smi lists, or none, with real torch's no-driver
error (torch/_standin_gpus.py). Other names are placeholders (torch/_standin.py).
"""

import builtins
import importlib.metadata
import sys

from torch import _standin, _standin_gpus, version

__version__ = version.__version__


class dtype:
    def __init__(self, name, bits, floating):
        self.name, self.itemsize, self.is_floating_point = name, max(bits // 8, 1), floating

    def __repr__(self):
        return "torch." + self.name


for _name, _bits in dict(float16=16, half=16, bfloat16=16, float32=32, float=32, float64=64, double=64,
                         float8_e4m3fn=8, float8_e4m3fnuz=8, float8_e5m2=8, float8_e5m2fnuz=8,
                         float8_e8m0fnu=8, float4_e2m1fn_x2=8, int8=8, uint8=8, int16=16, int32=32,
                         int64=64, long=64, int=32, bool=8, uint16=16, uint32=32, uint64=64,
                         complex64=64).items():
    globals()[_name] = dtype(_name, _bits, _name.startswith(("float", "bfloat", "half", "double")))


class finfo:
    _MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0,
            "float16": 65504.0, "bfloat16": 3.3895e38, "float32": 3.4028e38}

    def __init__(self, of=None):
        self.max = self._MAX.get(getattr(of, "name", "float32"), 3.4e38)
        self.min, self.eps, self.tiny, self.bits = -self.max, 1e-6, 1e-38, getattr(of, "itemsize", 4) * 8


class iinfo:
    def __init__(self, of=None):
        self.bits = getattr(of, "itemsize", 4) * 8
        self.max, self.min = 2 ** (self.bits - 1) - 1, -(2 ** (self.bits - 1))


class device:
    def __init__(self, type="cpu", index=None):
        if isinstance(type, str) and ":" in type:
            type, index = type.split(":")
            index = builtins.int(index)
        self.type, self.index = type, index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Size(tuple):
    pass


Tensor = _standin.placeholder("torch.Tensor")


cuda = _standin.PlaceholderModule("torch.cuda")
cuda.__path__ = []
sys.modules["torch.cuda"] = cuda
cuda.is_initialized = lambda: bool(_standin_gpus.gpus())
for _name in ("is_available", "device_count", "get_device_capability", "get_device_name", "get_device_properties",
              "mem_get_info", "current_device", "set_device", "synchronize"):
    setattr(cuda, _name, getattr(_standin_gpus, _name))
arange, ones = _standin_gpus.arange, _standin_gpus.ones


def _cudnn_version():
    """The installed nvidia-cudnn wheel's version as real torch reports a cuDNN 9 (9.16.0 -> 91600)."""
    for distribution in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            major, minor, patch = (builtins.int(part) for part in
                                   importlib.metadata.version(distribution).split(".")[:3])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
        return major * 10000 + minor * 100 + patch
    return None


backends = _standin.PlaceholderModule("torch.backends")
backends.__path__ = []
sys.modules["torch.backends"] = backends
backends.cudnn = _standin.PlaceholderModule("torch.backends.cudnn")
sys.modules["torch.backends.cudnn"] = backends.cudnn
backends.cudnn.version = _cudnn_version
backends.cudnn.is_available = lambda: _cudnn_version() is not None
backends.cudnn.enabled = True


def compile(function=None, *args, **kwargs):
    return (lambda f: f) if function is None else function


_standin.install(__name__)
