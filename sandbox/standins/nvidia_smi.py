"""Stand-in for NVIDIA's `nvidia-smi`, installed at /usr/bin/nvidia-smi on sandbox hosts.

Sandbox hosts have no GPU and no driver. `render_nvidia_smi(gpu)` returns an executable python3
script that prints, with fixed values, what the real tool of a 580 driver prints (real outputs in
tests/fixtures/h200-ubuntu2404/ and tests/fixtures/h200-device/, compared in
tests/unit/test_nvidia_smi_standin.py) for the options the deploy and its tests use:

- `nvidia-smi [-i/--id=IDS]` (the summary table, one block per GPU),
- `nvidia-smi -L` / `--list-gpus`, `nvidia-smi --version` (each alone, as the real tool demands),
- `nvidia-smi --query-gpu=FIELDS [--format=csv[,noheader][,nounits]] [-i/--id=IDS]`,
- IDS: indexes, UUIDs or PCI bus ids, comma separated;
- the real tool's refusals, word for word, with its exit status: an unknown option, an option another
  command does not take, a missing value, an unknown field or format modifier, no GPU selected;
- with `Gpu(driver_loaded=False)`: the "couldn't communicate with the NVIDIA driver" error, exit 9.

`-q` is not implemented: a 580 driver's summary table (`+---` rules) is printed whatever the driver
version (a 570 driver's differs in two lines: tests/fixtures/rtx-pro-6000-aws-g7e/).
"""

from __future__ import annotations

import hashlib
import pprint
import uuid
from dataclasses import asdict, dataclass, field

from sandbox.standins.stack import manifest

RTX_PRO_6000 = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def _cuda_major_minor() -> str:
    major, minor = manifest().cuda["version"].split(".")[:2]
    return f"{major}.{minor}"


@dataclass(frozen=True)
class Gpu:
    """What the stand-in reports: `count` identical GPUs behind one driver.

    Defaults describe the target fleet: 8x RTX PRO 6000 Blackwell (SM120, 97887 MiB) on the
    manifest's minimum driver, which reports the manifest's CUDA major.minor.
    """

    name: str = RTX_PRO_6000
    compute_cap: str = field(default_factory=lambda: manifest().gpu["compute_capability"])
    count: int = field(default_factory=lambda: manifest().gpu["count"])
    driver_version: str = field(default_factory=lambda: manifest().cuda["min_driver"])
    cuda_version: str = field(default_factory=_cuda_major_minor)
    memory_mib: int = 97887
    memory_free_mib: int | None = None   # None: all of it (the driver's reserved share is not modelled)
    power_cap_w: int = 600
    power_draw_w: int = 33
    temperature_c: int = 31
    perf_state: str = "P8"
    fan: str = "N/A"
    persistence: str = "On"
    ecc: str = "0"
    mig: str = "Disabled"
    bus_ids: tuple[str, ...] = ()
    uuids: tuple[str, ...] = ()
    driver_loaded: bool = True

    def bus_id(self, index: int) -> str:
        """PCI bus id of GPU `index`: given, or a deterministic one per index."""
        if index < len(self.bus_ids):
            return self.bus_ids[index]
        return f"00000000:{(0x01 + 0x20 * index) % 0x100:02X}:{index // 8:02X}.0"

    def uuid(self, index: int) -> str:
        """UUID of GPU `index`: given, or derived from the name and index (stable across renders)."""
        if index < len(self.uuids):
            return self.uuids[index]
        digest = hashlib.md5(f"{self.name}/{index}".encode()).digest()
        return f"GPU-{uuid.UUID(bytes=digest)}"


def render_nvidia_smi(gpu: Gpu | None = None) -> str:
    """Return the text of the stand-in script (install it mode 0755 at /usr/bin/nvidia-smi)."""
    gpu = gpu or Gpu()
    config = asdict(gpu)
    config["memory_free_mib"] = gpu.memory_mib if gpu.memory_free_mib is None else gpu.memory_free_mib
    config["gpus"] = [{"bus_id": gpu.bus_id(i), "uuid": gpu.uuid(i)} for i in range(gpu.count)]
    # A Python literal, not JSON: the script then needs no json import (it runs on every fact call).
    return _SCRIPT.replace("@CONFIG@", pprint.pformat(config, width=100, sort_dicts=True))


# -IS (one word: the kernel passes everything after the interpreter as one argument): no site,
# no PYTHON* variables; with imports only where used, a call costs about what the real tool does.
_SCRIPT = r'''#!/usr/bin/python3 -IS
# STAND-IN for NVIDIA's nvidia-smi (servestack sandbox): no GPU here.
# Written by sandbox.standins.nvidia_smi. It talks to no driver: it prints the real
# output formats with the fixed values below, for: (no options), -L, --version, -i/--id=,
# --query-gpu=... --format=csv[,noheader][,nounits].
import sys

CONFIG = @CONFIG@

# query field (and its aliases) -> (header unit, value of GPU i)
FIELDS = {
    "index": ("", lambda i: str(i)),
    "count": ("", lambda i: str(len(CONFIG["gpus"]))),
    "name": ("", lambda i: CONFIG["name"]),
    "gpu_name": ("", lambda i: CONFIG["name"]),
    "compute_cap": ("", lambda i: CONFIG["compute_cap"]),
    "driver_version": ("", lambda i: CONFIG["driver_version"]),
    "memory.total": ("MiB", lambda i: str(CONFIG["memory_mib"])),
    "memory.used": ("MiB", lambda i: "0"),
    "memory.free": ("MiB", lambda i: str(CONFIG["memory_free_mib"])),
    "uuid": ("", lambda i: CONFIG["gpus"][i]["uuid"]),
    "gpu_uuid": ("", lambda i: CONFIG["gpus"][i]["uuid"]),
    "pci.bus_id": ("", lambda i: CONFIG["gpus"][i]["bus_id"]),
    "gpu_bus_id": ("", lambda i: CONFIG["gpus"][i]["bus_id"]),
}
VALUED = {"-i": "ids", "--id": "ids", "--query-gpu": "query", "--format": "format"}
COMMANDS = {"-L": "list", "--list-gpus": "list", "--version": "version"}
FORMAT_MODIFIERS = ("csv", "noheader", "nounits", "")
HELP = " Please run 'nvidia-smi -h' for help.\n"
RULE = "+-----------------------------------------+------------------------+----------------------+"


def fail(message, code):
    print(message)
    sys.exit(code)


def options(argv):
    """[(as written, kind, value)]: kind is ids, query, format, list, version or unknown."""
    found, args = [], list(argv)
    while args:
        arg = args.pop(0)
        name, equals, value = arg.partition("=")
        if arg in COMMANDS:
            found.append((arg, COMMANDS[arg], None))
        elif equals and name in ("--id", "--query-gpu", "--format"):
            found.append((arg, VALUED[name], value))
        elif arg in VALUED:
            if not args:
                fail("ERROR: Option %s is missing its value." % arg + HELP, 255)
            found.append((arg, VALUED[arg], args.pop(0)))
        else:
            found.append((arg, "unknown", None))
    return found


def check_command(found, command):
    """-L and --version take no other option (--version outranks -L)."""
    if [kind for _, kind, _ in found].count(command) > 1:
        fail("ERROR: Only one command can be run at a time." + HELP, 2)
    for text, kind, _ in found:
        if kind != command:
            fail("ERROR: Option %s is not valid for this command." % text + HELP, 2)


def parse(argv):
    found = options(argv)
    kinds = [kind for _, kind, _ in found]
    command = "version" if "version" in kinds else "list" if "list" in kinds else None
    if command:
        check_command(found, command)
    unknown = [text for text, kind, _ in found if kind == "unknown"
               or (kind == "format" and "query" not in kinds)]
    if unknown and "query" in kinds:
        fail("ERROR: Option %s is not recognized." % unknown[0] + HELP, 2)
    if unknown:
        fail("ERROR: Option %s is not recognized. Please run 'nvidia-smi -h'.\n" % unknown[0], 255)
    values = {kind: value for _, kind, value in found}
    return command or ("query" if "query" in kinds else "table"), values


def selected(ids):
    every = range(len(CONFIG["gpus"]))
    if ids is None:
        return list(every)
    if ids == "":
        sys.stdout.write("Failed to parse device string on command line")
        sys.exit(255)
    wanted = ids.split(",")
    chosen = [i for i in every if any(is_gpu(i, token) for token in wanted)]
    if not chosen:
        fail("No devices were found", 6)
    return chosen


def is_gpu(i, token):
    gpu = CONFIG["gpus"][i]
    return (token.isdigit() and int(token) == i) or token in (gpu["uuid"], gpu["bus_id"])


def query(fields_text, format_text, ids):
    fields = [name for name in fields_text.split(",") if name]
    for name in fields:
        if name not in FIELDS:
            fail('Field "%s" is not a valid field to query.\n' % name, 2)
    flags = set((format_text or "csv").split(","))
    if not flags <= set(FORMAT_MODIFIERS):
        fail("Format modifier is not recognized.", 2)
    gpus = selected(ids)
    if "noheader" not in flags:
        headers = []
        for name in fields:
            unit = FIELDS[name][0]
            headers.append("%s [%s]" % (name, unit) if unit else name)
        print(", ".join(headers))
    for i in gpus:
        values = []
        for name in fields:
            unit, value = FIELDS[name]
            values.append(value(i) if not unit or "nounits" in flags else "%s %s" % (value(i), unit))
        print(", ".join(values))


def short_name(name):
    return name if len(name) <= 27 else name[:24] + "..."


def table(gpus):
    import time
    c = CONFIG
    print(time.asctime() + "       ")
    print("+" + "-" * 89 + "+")
    print("| NVIDIA-SMI %-23sDriver Version: %-15sCUDA Version: %-9s|"
          % (c["driver_version"], c["driver_version"], c["cuda_version"]))
    print(RULE)
    print("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |")
    print("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |")
    print("|                                         |                        |               MIG M. |")
    print("|=========================================+========================+======================|")
    for i in gpus:
        print("|%4d  %-30s%3s  |%19s %3s |%21s |"
              % (i, short_name(c["name"]), c["persistence"], c["gpus"][i]["bus_id"], "Off", c["ecc"]))
        print("| %3s%5dC%6s%15dW / %4dW |%8dMiB / %6dMiB |%7d%%%13s |"
              % (c["fan"], c["temperature_c"], c["perf_state"], c["power_draw_w"], c["power_cap_w"],
                 0, c["memory_mib"], 0, "Default"))
        print("|                                         |                        |%21s |" % c["mig"])
        print(RULE)
    print("")
    print("+" + "-" * 89 + "+")
    print("| Processes:                                                                              |")
    print("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |")
    print("|        ID   ID                                                               Usage      |")
    print("|" + "=" * 89 + "|")
    print("|  No running processes found                                                             |")
    print("+" + "-" * 89 + "+")


def version():
    print("NVIDIA-SMI version  : %s" % CONFIG["driver_version"])
    print("NVML version        : %s" % CONFIG["driver_version"].rsplit(".", 1)[0])
    print("DRIVER version      : %s" % CONFIG["driver_version"])
    print("CUDA Version        : %s" % CONFIG["cuda_version"])


def main(argv):
    command, values = parse(argv)
    if not CONFIG["driver_loaded"]:
        fail("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.", 9)
    if command == "version":
        version()
    elif command == "list":
        for i in selected(None):
            print("GPU %d: %s (UUID: %s)" % (i, CONFIG["name"], CONFIG["gpus"][i]["uuid"]))
    elif command == "query":
        query(values["query"], values.get("format"), values.get("ids"))
    else:
        table(selected(values.get("ids")))


if __name__ == "__main__":
    main(sys.argv[1:])
'''
