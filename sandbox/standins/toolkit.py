"""Stand-in CUDA toolkit trees, laid out like a runfile install at /usr/local/cuda-X.Y.

`write_toolkit_tree(root, version, nvcc_version)` writes the files the deploy reads or
fingerprints: `bin/nvcc` (a sh script printing the real `nvcc --version` and
`--list-gpu-arch`/`--list-gpu-code` text; it compiles nothing: the program it "builds" SIMULATES
the verify sample on the stand-in GPUs, SIMULATED_SAMPLE), `version.json` in the real
format, `bin/cuda-uninstaller`, headers with the real version macros, and placeholder
libraries under `targets/x86_64-linux` with the real `lib64`/`include` links, so a
"file list + sizes" fingerprint of the tree is meaningful. Nothing in it is NVIDIA's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from packaging.version import Version

from sandbox.standins.stack import OLD_CUDA_VERSION, OLD_NVCC_VERSION

#: `nvcc --version` details of known releases: nvcc version -> (Built on, Build line suffix).
NVCC_BUILDS = {
    "12.8.93": ("Fri_Feb_21_20:23:50_PST_2025", "compiler.35583870_0"),
    "13.0.88": ("Wed_Aug_20_01:58:59_PM_PDT_2025", "compiler.36424714_0"),
}

#: Virtual architectures `nvcc --list-gpu-arch` prints, per toolkit major.minor (13.0: as captured).
GPU_ARCHS = {
    "12.8": (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 120),
    "13.0": (75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121),
}

STANDIN_NOTE = "STAND-IN for NVIDIA's CUDA toolkit (servestack sandbox): no compiler, no GPU code here"

#: Size of the placeholder cuBLASLt library, so the tree (and a runfile carrying it) has some bulk.
FILLER_BYTES = 256 * 1024


def _major_minor(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1]}"


def nvcc_version_text(nvcc_version: str) -> str:
    """The exact text `nvcc --version` prints for `nvcc_version` (e.g. '13.0.88')."""
    major_minor = _major_minor(nvcc_version)
    built_on, build = NVCC_BUILDS.get(nvcc_version, ("Mon_Jan_01_00:00:00_PST_2025", "compiler.00000000_0"))
    year = built_on.rsplit("_", 1)[1]
    return (
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        f"Copyright (c) 2005-{year} NVIDIA Corporation\n"
        f"Built on {built_on}\n"
        f"Cuda compilation tools, release {major_minor}, V{nvcc_version}\n"
        f"Build cuda_{major_minor}.r{major_minor}/{build}\n"
    )


def _nvcc_script(nvcc_version: str) -> str:
    archs = GPU_ARCHS.get(_major_minor(nvcc_version), GPU_ARCHS["13.0"])
    arch_lines = "\n".join(f"compute_{arch}" for arch in archs)
    code_lines = "\n".join(f"sm_{arch}" for arch in archs)
    return f"""#!/bin/sh
# {STANDIN_NOTE}.
# Prints what the real nvcc {nvcc_version} prints for --version, --list-gpu-arch and --list-gpu-code;
# for anything else it writes the -o file as a program SIMULATING the verify sample (no GPU code).
case "$1" in
--version|-V)
    cat <<'EOF'
{nvcc_version_text(nvcc_version)}EOF
    ;;
--list-gpu-arch|-arch-ls)
    cat <<'EOF'
{arch_lines}
EOF
    ;;
--list-gpu-code|-code-ls)
    cat <<'EOF'
{code_lines}
EOF
    ;;
*)
    # "Compiles" SOURCE into OUT: a program that SIMULATES the built sample on the stand-in GPUs.
    out= source= codes=
    while [ $# -gt 0 ]; do
        case "$1" in
        -o) out=$2; shift ;;
        -gencode) codes="$codes ${{2##*code=}}"; shift ;;
        -*) ;;
        *) source=$1 ;;
        esac
        shift
    done
    if [ -z "$source" ]; then
        echo "nvcc fatal   : No input files specified; use option --help for more information" >&2; exit 1
    fi
    [ -r "$source" ] || {{ echo "nvcc fatal   : Could not open input file '$source'" >&2; exit 1; }}
    {{ echo '#!/usr/bin/python3 -IS'; echo "CODES = '$codes'.split()"; cat <<'EOF'
{SIMULATED_SAMPLE}EOF
    }} > "${{out:-a.out}}" && chmod 755 "${{out:-a.out}}"
    ;;
esac
"""


#: The program the stand-in nvcc "builds" from any source (files/verify/vector_add.cu for servestack):
#: what the real sample prints (tests/fixtures/h200-ubuntu2404/verify/sample-*.txt), for the GPUs the
#: stand-in nvidia-smi lists, a device passing when the build has code for its architecture.
SIMULATED_SAMPLE = """# STAND-IN: a CUDA program built by the stand-in nvcc (servestack sandbox). Nothing ran on a GPU:
# it prints what files/verify/vector_add.cu prints, SIMULATED for the stand-in nvidia-smi's GPUs.
import subprocess
import sys

N = 1 << 20
print("[SIMULATED by the stand-in nvcc's program: no GPU code ran]")
try:
    answer = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"],
                            capture_output=True, text=True)
except OSError:
    answer = None
if answer is None or answer.returncode != 0:
    print("devices 0: FAIL cudaGetDeviceCount: no CUDA-capable device is detected")
    sys.exit(2)
failed = 0
gpus = [line.split(",", 1) for line in answer.stdout.splitlines() if line.strip()]
for device, (capability, name) in enumerate(gpus):
    sm = "sm_" + capability.strip().replace(".", "")
    ok = sm in CODES
    launch = "no error" if ok else "no kernel image is available for execution on the device"
    print(f'device {device} {sm} "{name.strip()}": {"PASS" if ok else "FAIL"} bad={0 if ok else N}/{N} '
          f"launch={launch} sync=no error")
    failed += not ok
print(f"devices {len(gpus)}: {'FAIL' if failed else 'PASS'}")
sys.exit(1 if failed else 0)
"""


def _uninstaller_script() -> str:
    return f"""#!/bin/sh
# {STANDIN_NOTE}.
# Like the real cuda-uninstaller run non-interactively: removes the toolkit this file belongs to.
here=$(cd "$(dirname "$0")/.." && pwd)
case "$1" in
--silent) rm -rf "$here"; echo "Successfully uninstalled" ;;
*) echo "cuda-uninstaller stand-in: interactive mode is not supported, pass --silent" >&2; exit 1 ;;
esac
"""


def version_json(version: str, nvcc_version: str, cudart_version: str) -> dict:
    """The toolkit's version.json content (the real format: one entry per component)."""
    return {
        "cuda": {"name": "CUDA SDK", "version": version},
        "cuda_cccl": {"name": "CUDA C++ Core Compute Libraries", "version": cudart_version},
        "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": cudart_version},
        "cuda_nvcc": {"name": "CUDA NVCC", "version": nvcc_version},
        "cuda_nvrtc": {"name": "CUDA NVRTC", "version": nvcc_version},
    }


def _filler(seed: str, size: int) -> bytes:
    """Deterministic incompressible bytes (a sha256 chain), so archives keep their size."""
    blocks: list[bytes] = []
    block = hashlib.sha256(seed.encode()).digest()
    while len(blocks) * len(block) < size:
        block = hashlib.sha256(block).digest()
        blocks.append(block)
    return b"".join(blocks)[:size]


def _write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    path.chmod(mode)


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _write_libraries(root: Path, major: int, cudart_version: str, nvcc_version: str) -> None:
    lib = root / "targets" / "x86_64-linux" / "lib"
    for name, full in (("libcudart", cudart_version), ("libnvrtc", nvcc_version), ("libcublasLt", cudart_version)):
        real = f"{name}.so.{full}"
        body = _filler(real, FILLER_BYTES) if name == "libcublasLt" else f"{STANDIN_NOTE}: {real}\n".encode()
        _write(lib / real, body, 0o755)
        _link(lib / f"{name}.so.{major}", real)
        _link(lib / f"{name}.so", f"{name}.so.{major}")
    _write(lib / "libcudart_static.a", f"!<arch>\n{STANDIN_NOTE}\n")
    _write(lib / "stubs" / "libcuda.so", f"{STANDIN_NOTE}: driver API stub\n", 0o755)


def _write_headers(root: Path, version: str) -> None:
    release = Version(version).release
    number = release[0] * 1000 + release[1] * 10
    include = root / "targets" / "x86_64-linux" / "include"
    _write(include / "cuda.h", f"/* {STANDIN_NOTE} */\n#define CUDA_VERSION {number}\n")
    _write(include / "cuda_runtime_api.h", f"/* {STANDIN_NOTE} */\n#define CUDART_VERSION {number}\n")
    _write(include / "cuda_runtime.h", f'/* {STANDIN_NOTE} */\n#include "cuda_runtime_api.h"\n')


def write_toolkit_tree(root: Path, version: str = OLD_CUDA_VERSION, nvcc_version: str = OLD_NVCC_VERSION,
                       cudart_version: str | None = None) -> Path:
    """Write a stand-in toolkit of CUDA `version` at `root` (e.g. ROOT/usr/local/cuda-12.8); return it.

    `nvcc_version` is what `bin/nvcc --version` and version.json's cuda_nvcc report;
    `cudart_version` (default: `nvcc_version`) names the runtime libraries.
    """
    root = Path(root)
    cudart_version = cudart_version or nvcc_version
    major = Version(version).release[0]
    _write(root / "bin" / "nvcc", _nvcc_script(nvcc_version), 0o755)
    _write(root / "bin" / "nvcc.profile", "TOP = $(_HERE_)/..\nPATH += $(TOP)/bin:\n")
    _write(root / "bin" / "cuda-uninstaller", _uninstaller_script(), 0o755)
    _write(root / "version.json", json.dumps(version_json(version, nvcc_version, cudart_version), indent=3) + "\n")
    _write(root / "EULA.txt", f"{STANDIN_NOTE}.\nNVIDIA's license text is not reproduced here.\n")
    _write(root / "README", f"{STANDIN_NOTE}.\nCUDA {version}\n")
    _write(root / "nvvm" / "bin" / "cicc", f"#!/bin/sh\necho '{STANDIN_NOTE}' >&2\nexit 1\n", 0o755)
    _write_libraries(root, major, cudart_version, nvcc_version)
    _write_headers(root, version)
    _link(root / "lib64", "targets/x86_64-linux/lib")
    _link(root / "include", "targets/x86_64-linux/include")
    for directory in [root, *(path for path in root.rglob("*") if path.is_dir() and not path.is_symlink())]:
        directory.chmod(0o755)
    return root
