"""The stand-in nvidia-smi starts lean and prints what it printed before it was made lean.

The expected outputs were recorded from the renderer as it was before (json and time imported at
the top, `#!/usr/bin/python3`); test_standins.py compares the stand-in with real nvidia-smi outputs.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from servestack.sandbox.standins.nvidia_smi import Gpu, render_nvidia_smi

NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GPU = Gpu(name=NAME, compute_cap="12.0", count=2, driver_version="580.82.07", cuda_version="13.0")
UUIDS = ("GPU-1b8f7e43-442e-defe-41b5-bc8fa3b59449", "GPU-ed1c9673-2304-5d46-5986-f2b6ed75e499")
BUS_IDS = ("00000000:01:00.0", "00000000:21:00.0")
LIST = [f"GPU {i}: {NAME} (UUID: {UUIDS[i]})\n" for i in (0, 1)]
BAD_OPTION = "ERROR: Option %s is not recognized. Please run 'nvidia-smi -h' for help.\n\n"
BAD_COMBINATION = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")
TIME = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}(?= {7}\n)")

# the real tool ends the time line with 7 spaces
TABLE = "<TIME>" + " " * 7 + """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.82.07              Driver Version: 580.82.07      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA RTX PRO 6000 Blac...    On  |   00000000:01:00.0 Off |                    0 |
| N/A   31C    P8             33W /  600W |       0MiB /  97887MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
|   1  NVIDIA RTX PRO 6000 Blac...    On  |   00000000:21:00.0 Off |                    0 |
| N/A   31C    P8             33W /  600W |       0MiB /  97887MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+

+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
|  No running processes found                                                             |
+-----------------------------------------------------------------------------------------+
"""

INVOCATIONS = [
    ([], TABLE, 0),
    (["-L"], LIST[0] + LIST[1], 0),
    (["--version"], "NVIDIA-SMI version  : 580.82.07\nNVML version        : 580.82\n"
                    "DRIVER version      : 580.82.07\nCUDA Version        : 13.0\n", 0),
    (["-i", "1", "-L"], LIST[1], 0),
    (["--id=0,1", "-L"], LIST[0] + LIST[1], 0),
    (["-i", "2", "-L"], "No devices were found\n", 6),
    (["-i", "x"], "No devices were found\n", 6),
    (["-i"], BAD_OPTION % "-i", 2),
    (["--bogus"], BAD_OPTION % "--bogus", 2),
    (["--format=csv"], BAD_COMBINATION, 2),
    (["--query-gpu=name"], BAD_COMBINATION, 2),
    (["--query-gpu=name", "--format=json"], BAD_COMBINATION, 2),
    (["--query-gpu=name,bogus.field", "--format=csv"], 'Field "bogus.field" is not a valid field to query.\n\n', 2),
    (["--query-gpu=index,name,compute_cap,driver_version,memory.total,memory.used,memory.free,count",
      "--format=csv"],
     "index, name, compute_cap, driver_version, memory.total [MiB], memory.used [MiB], memory.free [MiB], count\n"
     f"0, {NAME}, 12.0, 580.82.07, 97887 MiB, 0 MiB, 97887 MiB, 2\n"
     f"1, {NAME}, 12.0, 580.82.07, 97887 MiB, 0 MiB, 97887 MiB, 2\n", 0),
    (["--query-gpu=uuid,gpu_uuid,pci.bus_id,gpu_bus_id,gpu_name", "--format=csv,noheader"],
     f"{UUIDS[0]}, {UUIDS[0]}, {BUS_IDS[0]}, {BUS_IDS[0]}, {NAME}\n"
     f"{UUIDS[1]}, {UUIDS[1]}, {BUS_IDS[1]}, {BUS_IDS[1]}, {NAME}\n", 0),
    (["-i", "1", "--query-gpu=index,memory.total", "--format=csv,nounits"], "index, memory.total [MiB]\n1, 97887\n", 0),
    (["--query-gpu=index,memory.free", "--format=csv,noheader,nounits"], "0, 97887\n1, 97887\n", 0),
]

WITHOUT_DRIVER = [
    (["--query-gpu=name", "--format=csv"], NO_DRIVER, 9),
    (["-L"], NO_DRIVER, 9),
    (["--version"], NO_DRIVER, 9),
    (["--bogus"], BAD_OPTION % "--bogus", 2),  # options are read before the driver is asked
]


def installed(tmp_path: Path, gpu: Gpu) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(render_nvidia_smi(gpu))
    script.chmod(0o755)
    return script


def run(script: Path, args: list[str]) -> tuple[str, str, int]:
    result = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60)
    return TIME.sub("<TIME>", result.stdout), result.stderr, result.returncode


@pytest.mark.parametrize("args, stdout, status", INVOCATIONS, ids=[" ".join(i[0]) or "table" for i in INVOCATIONS])
def test_prints_what_it_printed_before(tmp_path, args, stdout, status):
    assert run(installed(tmp_path, GPU), args) == (stdout, "", status)


@pytest.mark.parametrize("args, stdout, status", WITHOUT_DRIVER, ids=[" ".join(i[0]) for i in WITHOUT_DRIVER])
def test_without_driver_prints_what_it_printed_before(tmp_path, args, stdout, status):
    gpu = Gpu(name=NAME, compute_cap="12.0", count=2, driver_version="580.82.07", cuda_version="13.0",
              driver_loaded=False)
    assert run(installed(tmp_path, gpu), args) == (stdout, "", status)


def test_the_shebang_is_one_interpreter_argument_python_accepts(tmp_path):
    shebang = render_nvidia_smi(GPU).splitlines()[0]
    assert shebang == "#!/usr/bin/python3 -IS"  # the kernel passes "-I -S" as one argument: python refuses it
    assert run(installed(tmp_path, GPU), ["-L"])[2] == 0


def imported_modules(argv: list[str]) -> set[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--query-gpu=index,name,compute_cap,uuid", "--format=csv,noheader"], ["-L"],
                                  ["--version"], ["--bogus"], []])
def test_imports_nothing_the_interpreter_did_not_import_already(tmp_path, args):
    script = installed(tmp_path, GPU)
    interpreter = shlex.split(script.read_text().splitlines()[0][2:])  # as the kernel runs it
    startup = imported_modules(interpreter + ["-X", "importtime", "-c", "pass"])
    imported = imported_modules(interpreter + ["-X", "importtime", str(script), *args])
    assert imported - startup <= ({"time"} if not args else set())
