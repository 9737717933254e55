"""Stand-ins for what sandbox hosts cannot have: a GPU and its driver, NVIDIA's CUDA runfile and
toolkit, and multi-GB CUDA wheels. Every file they produce says in its own text that it is a
stand-in. They are used only by the sandbox, never by the deploy.

- nvidia_smi: `Gpu`, `render_nvidia_smi(gpu)` -> script text for /usr/bin/nvidia-smi
- toolkit: `write_toolkit_tree(root, version, nvcc_version)` -> a /usr/local/cuda-X.Y tree
- runfile: `build_runfile(dest_dir, mode)` -> the makeself installer; `runfile_info`, `write_md5sum`
- wheels: stand-in wheel builders, `build_wheel`, `broken_wheel`
- sglang: what SGLang imports before GPU work (served as real wheels beside the real sglang)
- closure: each stack resolved as a real host resolves it, and the real metadata of its packages
- realwheels: a stack's real PyPI wheels as an index (`real_index`; tests/integration/test_real_release.py)
- index: `write_simple_index(root, wheels)` -> a PEP 503 index
- build: `build_artifacts(dest, runfile_mode=...)` -> `ArtifactSet` (everything the server serves)
- host: `dress_gpu_host(root, gpu=..., with_cuda_128=..., with_ml_env=...)`
"""

from sandbox.standins.build import ArtifactSet, build_artifacts
from sandbox.standins.host import dress_gpu_host
from sandbox.standins.nvidia_smi import Gpu, render_nvidia_smi
from sandbox.standins.runfile import MODES as RUNFILE_MODES
from sandbox.standins.runfile import RunfileInfo, build_runfile, runfile_info, write_md5sum
from sandbox.standins.toolkit import write_toolkit_tree

__all__ = [
    "ArtifactSet", "Gpu", "RUNFILE_MODES", "RunfileInfo", "build_artifacts", "build_runfile",
    "dress_gpu_host", "render_nvidia_smi", "runfile_info", "write_md5sum", "write_toolkit_tree",
]
