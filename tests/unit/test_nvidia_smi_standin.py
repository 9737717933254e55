"""The stand-in nvidia-smi prints what the real one prints, and starts lean.

Every expected output here is a real one, never the renderer's own:
- tests/fixtures/h200-ubuntu2404: a real H200 host's summary table, `-L` and `--query-gpu` (with and
  without header). The stand-in is configured from that host's `nvidia-smi -q`, taken the same second as the
  table: name, driver, CUDA version, bus id, UUID, memory, persistence, performance state, temperature,
  power, fan, ECC, MIG. So each field of the table and of the queries is checked against -q's value.
- tests/fixtures/h200-device: every invocation the stand-in implements, its refusals included, run on two
  real H200 machines with a 580.159.04 driver (its README), the stand-in configured from their `-q`.
- ../shared/fixtures/rtx-pro-6000-aws-g7e: the target GPU. No capture of our own exists (no RTX PRO 6000 was
  lent); a published table and query of an RTX PRO 6000 Blackwell Server Edition on a 570 driver (its
  README names the public repository and commit) are compared with the stand-in's defaults (Gpu()): its
  name, memory, power cap and GPU rows. Copied from a public repository, it is kept in the workplace's
  shared folder, not in this repository: where that folder is absent, those two tests skip saying so.
- without a driver: the message nvidia-smi prints in public reports (e.g. GoogleCloudPlatform/
  compute-gpu-installation#18) and exit 9, "NVIDIA driver is not loaded" (nvidia-smi(1), RETURN VALUE).

`-q` itself is not implemented by the stand-in (nothing runs it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from sandbox.standins.nvidia_smi import Gpu, render_nvidia_smi

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOST = FIXTURES / "h200-ubuntu2404"
DEVICE = FIXTURES / "h200-device"
RTX = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "rtx-pro-6000-aws-g7e"


def rtx_capture(name: str) -> str:
    if not RTX.is_dir():
        pytest.skip(f"the published RTX PRO 6000 outputs are not at {RTX} (the workplace's shared folder)")
    return (RTX / name).read_text()
TIME = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}$", re.M)   # the real line ends in 7 spaces
# The readings that change from one call to the next: temperature, performance state, power draw.
READINGS = re.compile(r"^(\| +\S+) +\d+C +P\d+ +\d+W /", re.M)
H200_COMPUTE_CAPABILITY = "9.0"   # Hopper: NVIDIA's CUDA GPUs table (the -q output has no such field)
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")


# -- reading the real outputs ----------------------------------------------------------------------

def q_fields(text: str) -> dict[str, str]:
    """`nvidia-smi -q` of one GPU as {'FB Memory Usage/Total': '143771 MiB', ...}; 'GPU': its bus id."""
    fields, path = {}, []
    for line in text.splitlines():
        if not line.strip() or line.startswith("="):
            continue
        depth = (len(line) - len(line.lstrip())) // 4
        key, separator, value = line.strip().partition(" : ")
        if separator:
            fields["/".join(path[1:depth] + [key.strip()])] = value.strip()
        else:
            path = path[:depth] + [key]   # path[0]: the GPU's own heading, "GPU <bus id>"
            if depth == 0:
                fields["GPU"] = key.removeprefix("GPU ")
    return fields


def mib(value: str) -> int:
    number, unit = value.split()
    assert unit == "MiB", value
    return int(number)


def whole_watts(value: str) -> int:
    """The table shows a power reading cut to whole watts (126.19 W and 126.50 W -> 126W in the H200's)."""
    number, unit = value.split()
    assert unit == "W", value
    return int(float(number))


def volatile_uncorrected(fields: dict[str, str]) -> str:
    """The table's "Volatile Uncorr. ECC": the volatile uncorrectable error counts of -q, summed."""
    assert fields["ECC Mode/Current"] == "Enabled"
    return str(sum(int(value) for key, value in fields.items()
                   if key.startswith("ECC Errors/Volatile/") and "Uncorrectable" in key))


def gpu_from_q(text: str) -> Gpu:
    """The stand-in configured as the one GPU a real `nvidia-smi -q` describes."""
    f = q_fields(text)
    # What the stand-in cannot be told otherwise: it always prints these.
    assert (f["Display Active"], f["Compute Mode"], f["Attached GPUs"]) == ("Disabled", "Default", "1")
    return Gpu(name=f["Product Name"], compute_cap=H200_COMPUTE_CAPABILITY, count=1,
               driver_version=f["Driver Version"], cuda_version=f["CUDA Version"],
               memory_mib=mib(f["FB Memory Usage/Total"]), memory_free_mib=mib(f["FB Memory Usage/Free"]),
               power_cap_w=whole_watts(f["GPU Power Readings/Current Power Limit"]),
               power_draw_w=whole_watts(f["GPU Power Readings/Average Power Draw"]),
               temperature_c=int(f["Temperature/GPU Current Temp"].removesuffix(" C")),
               perf_state=f["Performance State"], fan=f["Fan Speed"],
               persistence={"Enabled": "On", "Disabled": "Off"}[f["Persistence Mode"]],
               ecc=volatile_uncorrected(f), mig=f["MIG Mode/Current"],
               bus_ids=(f["PCI/Bus Id"],), uuids=(f["GPU UUID"],))


def host_capture(name: str) -> tuple[list[str], str, int]:
    """(arguments, output, exit status) of a file of tests/fixtures/h200-ubuntu2404."""
    command, _, rest = (HOST / name).read_text().partition("\n")
    output, status = re.fullmatch(r"(.*\n)\[exit (\d+)\]\n*", rest, re.S).groups()
    return shlex.split(command.removeprefix("$ "))[1:], output, int(status)


def device_calls(run: int) -> list[dict]:
    return [json.loads(line) for line in (DEVICE / f"invocations-{run}.jsonl").read_text().splitlines()]


def device_call(run: int, *args: str) -> dict:
    (call,) = [call for call in device_calls(run) if call["argv"][1:] == list(args)]
    return call


def device_gpu(run: int) -> Gpu:
    """Machine 1 from its -q; machine 2 as machine 1 but for its UUID (which its calls name), once its
    `-q -d MEMORY` shows the same driver, bus id and memory."""
    first = gpu_from_q(device_call(1, "-q")["stdout"])
    if run == 1:
        return first
    memory = q_fields(device_call(2, "-i", "0", "-q", "-d", "MEMORY")["stdout"])
    assert (memory["Driver Version"], memory["GPU"], mib(memory["FB Memory Usage/Total"]),
            mib(memory["FB Memory Usage/Free"])) == (first.driver_version, first.bus_ids[0], first.memory_mib,
                                                     first.memory_free_mib)
    (uuid,) = {arg for call in device_calls(2) for arg in call["argv"] if arg.startswith("GPU-")}
    return dataclasses.replace(first, uuids=(uuid,))


# -- running the stand-in --------------------------------------------------------------------------

def installed(tmp_path: Path, gpu: Gpu) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(render_nvidia_smi(gpu))
    script.chmod(0o755)
    return script


def run(script: Path, args: list[str]) -> tuple[str, str, int]:
    result = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60)
    return result.stdout, result.stderr, result.returncode


def timeless(text: str) -> str:
    return TIME.sub("<TIME>", text)


def without_readings(text: str) -> str:
    return READINGS.sub(r"\1 <readings> /", text)


# -- a real H200 host ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["nvidia-smi.txt", "nvidia-smi-L.txt", "nvidia-smi-query.txt",
                                  "nvidia-smi-query-noheader.txt"])
def test_prints_what_a_real_h200_printed_configured_from_its_q(tmp_path, name):
    args, output, status = host_capture(name)
    stdout, stderr, code = run(installed(tmp_path, gpu_from_q(host_capture("nvidia-smi-q.txt")[1])), args)
    assert (timeless(stdout), stderr, code) == (timeless(output), "", status)


# -- every invocation, on real H200 machines -------------------------------------------------------

DEVICE_CALLS = [(run_number, call) for run_number in (1, 2) for call in device_calls(run_number)
                if "-q" not in call["argv"]]


@pytest.mark.parametrize("machine, call", DEVICE_CALLS,
                         ids=[f"{n}: {shlex.join(call['argv'][1:]) or 'table'}" for n, call in DEVICE_CALLS])
def test_answers_each_invocation_as_a_real_h200_did(tmp_path, machine, call):
    stdout, stderr, code = run(installed(tmp_path, device_gpu(machine)), call["argv"][1:])
    expected = call["stdout"]
    if machine == 2:   # its tables: no -q was taken beside them to read their readings from
        stdout, expected = without_readings(stdout), without_readings(expected)
    assert (timeless(stdout), stderr, code) == (timeless(expected), call["stderr"], call["exit"])


# -- the target GPU, as published -------------------------------------------------------------------

RTX_HOST = dict(count=1, driver_version="570.172.08", cuda_version="12.8", bus_ids=("00000000:30:00.0",),
                temperature_c=27, power_draw_w=28, perf_state="P8")   # that host's, read off its table


def test_defaults_print_the_gpu_rows_of_a_real_rtx_pro_6000_server_edition(tmp_path):
    """All but the host's own readings (RTX_HOST) are the stand-in's defaults. A 570 driver's table
    differs from a 580's in two lines (the H200 tables above are 580's): those two are checked as such."""
    real = rtx_capture("nvidia-smi.txt").splitlines()
    ours = run(installed(tmp_path, Gpu(**RTX_HOST)), [])[0].splitlines()
    rule, blank = 3, 12
    assert (ours[rule], real[rule]) == ("+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+",
                                        "|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+")
    assert (ours[blank], real[blank]) == ("", " " * 89)
    different = {0, rule, blank}
    assert [line for i, line in enumerate(ours) if i not in different] == \
        [line for i, line in enumerate(real) if i not in different]


def test_defaults_name_and_power_cap_are_a_real_rtx_pro_6000_server_editions(tmp_path):
    header, *rows = rtx_capture("nvidia-smi-query.txt").splitlines()
    assert header.split(", ")[:2] == ["index", "name"] and header.split(", ")[4] == "power.limit [W]"
    ours = run(installed(tmp_path, Gpu(count=len(rows))), ["--query-gpu=index,name", "--format=csv,noheader"])
    assert ours[0].splitlines() == [", ".join(row.split(", ")[:2]) for row in rows]
    assert {row.split(", ")[4] for row in rows} == {f"{Gpu().power_cap_w}.00 W"}


# -- without a driver, and how it starts -------------------------------------------------------------

@pytest.mark.parametrize("args", [[], ["--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]])
def test_without_a_driver_says_it_cannot_reach_it(tmp_path, args):
    gpu = dataclasses.replace(gpu_from_q(host_capture("nvidia-smi-q.txt")[1]), driver_loaded=False)
    assert run(installed(tmp_path, gpu), args) == (NO_DRIVER, "", 9)


def test_the_shebang_is_one_interpreter_argument_python_accepts(tmp_path):
    shebang = render_nvidia_smi(Gpu()).splitlines()[0]
    assert shebang == "#!/usr/bin/python3 -IS"  # the kernel passes "-I -S" as one argument: python refuses it
    assert run(installed(tmp_path, Gpu()), ["-L"])[2] == 0


def imported_modules(argv: list[str]) -> set[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--query-gpu=index,name,compute_cap,uuid", "--format=csv,noheader"], ["-L"],
                                  ["--version"], ["--bogus"], []])
def test_imports_nothing_the_interpreter_did_not_import_already(tmp_path, args):
    script = installed(tmp_path, Gpu())
    interpreter = shlex.split(script.read_text().splitlines()[0][2:])  # as the kernel runs it
    startup = imported_modules(interpreter + ["-X", "importtime", "-c", "pass"])
    imported = imported_modules(interpreter + ["-X", "importtime", str(script), *args])
    assert imported - startup <= ({"time"} if not args else set())
