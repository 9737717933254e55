"""What the verification checks (servestack/checks) read of a host, besides the GPUs and the
toolkits (they read those with the GPU and toolkit steps' own facts: NvidiaGpus, CudaToolkits,
ToolkitFingerprint).

- `VerifyHost`: the toolkit's package and real path, the active release, the service's unit,
  process and secrets (files/scripts/verify-host.sh), as a `HostReport`;
- `VerifyPython`, `CudaSample`, `PatchCheck`, `ServiceHttp`: the checks that run something on the
  host: the release's python, the CUDA sample, the patches step's check, the service's HTTP
  answers. What they judge is a program's failure, and pyinfra fails a host whose fact command
  fails: so their command never fails; it frames the program's output (stderr included) and
  exit status as a facts/framing.py section (`reporting`), and the fact's value is that `Section`;
- `VerificationRecord`: the record the deploy's verify step keeps (operations/verify.py).

Nothing here fails for "absent": a host without a GPU, a toolkit or a service answers saying so.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from facts.framing import Section, framed, split
from facts.gpu import SMI_TIMEOUT_S
from facts.patches import remote_command
from facts.service import UNIT_PROPERTIES
from servestack.manifest import PROJECT_ROOT
from servestack.patchsets import PATCH_ROOT
from servestack.paths import PATCH_RECORDS
from servestack.scripts import python_script_command, script_command

# The section the probes print their report in (files/scripts/verify-python.py, verify-http.py, verify-http.sh).
REPORT = "report"
SAMPLE_SOURCE = PROJECT_ROOT / "files" / "verify" / "vector_add.cu"
OUTPUT = "output"   # the section `reporting` frames


def reporting(command: str) -> str:
    """`command` (stdin closed, stderr into stdout) framed as one section (facts/framing.py), whose
    end line carries its exit status: the command of a fact that reports a failure instead of
    failing (framing nests, so a batch of facts carries it)."""
    return framed(OUTPUT, f"{{ {command}\n}} 2>&1")


def reported(lines: list[str]) -> Section:
    """What `reporting` printed, as the command's Section (rc None: the output was cut off)."""
    return split(lines).get(OUTPUT, Section(None, tuple(lines)))


class _Reported(FactBase):
    """A fact whose command is `reporting(...)` and whose value is that command's `Section`."""

    slow = True  # starts python, nvcc or an HTTP request (facts/batch.py)

    @staticmethod
    def default() -> Section:
        return Section(None, ())

    def process(self, output: list[str]) -> Section:
        return reported(output)


class VerifyPython(_Reported):
    """
    The active venv's report (files/scripts/verify-python.py): its packages' versions, torch and
    its GPUs, SGLang's SM120 support; "no python at PYTHON" and exit 127 without an interpreter.

    + python: the venv's interpreter (``/opt/ml-env/bin/python``)
    + packages: the distribution names whose versions to report
    """

    def command(self, python: str, packages: tuple[str, ...]) -> str:
        py = shlex.quote(python)
        probe = python_script_command(python, "verify-python.py", json.dumps(list(packages)))
        return reporting(f"if [ -x {py} ]; then {probe}; else echo 'no python at '{py}; exit 127; fi")


class CudaSample(_Reported):
    """
    The CUDA sample (files/verify/vector_add.cu) built with `nvcc` for the GPUs present and run on
    each (files/scripts/verify-sample.sh: its exit codes).

    + nvcc: the toolkit's nvcc
    + work_parent: where to build it (servestack's state directory; /tmp when not writable)
    """

    def command(self, nvcc: str, work_parent: str) -> str:
        return reporting(script_command("verify-sample.sh", env={
            "NVCC": nvcc, "WORK_PARENT": work_parent, "SMI_TIMEOUT": SMI_TIMEOUT_S}))


class PatchCheck(_Reported):
    """
    The patches step's check of the release's patch set (facts/patches.py), judging the patched
    files themselves: one JSON object in its section `patchlib.RESULT`.

    + python: the release's interpreter
    + record_path: the set's record (None: the check's default beside the venv)
    """

    def command(self, python: str, record_path: str | None) -> str:
        return reporting(remote_command(python, "check", "sglang", record_path, PATCH_ROOT, quick=False))


class ServiceHttp(_Reported):
    """
    The service's answer to GET /health and, with `request`, to a real POST /generate, asked from
    the host itself (files/scripts/verify-http.sh): its report section.

    + python: the venv's interpreter (python3 when it is missing)
    + url: where the service answers (``http://127.0.0.1:30000``)
    + request: the POST /generate request as JSON; empty: /health only
    """

    def command(self, python: str, url: str, request: str = "") -> str:
        return reporting(script_command("verify-http.sh", env={
            "URL": url, "PYTHON": python, "REQUEST": request}))


@dataclass(frozen=True)
class HostReport:
    """What files/scripts/verify-host.sh found (its header says what each is)."""

    devices: tuple[str, ...] = ()
    toolkit_package: tuple[str, ...] = ()     # `dpkg NAME VERSION`, `dpkg-release ...`, `rpm ...`, `wheel ...`
    toolkit_path: str | None = None
    venv: str | None = None                   # the active venv, resolved
    venv_link: str | None = None              # the stable venv path's link, as written
    records: tuple[str, ...] = ()             # patch records beside it
    release_state: tuple[str, ...] = ()
    systemd: bool = False
    unit: dict = field(default_factory=dict)  # systemctl show's properties ({} when it failed)
    unit_exit: int | None = None
    process_user: str | None = None           # None: the unit has no main process
    process_env: dict = field(default_factory=dict)
    unit_readable: bool = False
    unit_secret_names: int = 0
    unit_secret_values: int = 0
    secrets_file: str | None = None           # `MODE OWNER GROUP`, None when absent

    @property
    def has_process(self) -> bool:
        return self.process_user is not None


def parse_host_report(lines: list[str]) -> HostReport:
    """verify-host.sh's `KEY<TAB>VALUE` lines as a HostReport."""
    found: dict[str, list[str]] = {}
    for line in lines:
        key, tab, value = line.partition("\t")
        if tab:
            found.setdefault(key, []).append(value)

    def first(key: str, default=None):
        return found[key][0] if key in found else default

    def number(key: str) -> int:
        text = first(key, "0").strip()
        return int(text) if text.isdigit() else 0

    unit_exit = first("unit_exit")
    secrets = first("secrets_file")
    return HostReport(
        devices=tuple(found.get("device", ())),
        toolkit_package=tuple(found.get("package", ())),
        toolkit_path=first("toolkit_path"),
        venv=first("venv"),
        venv_link=first("venv_link"),
        records=tuple(found.get("record", ())),
        release_state=tuple(found.get("release_state", ())),
        systemd=first("systemd") == "running",
        unit=dict(line.partition("=")[::2] for line in found.get("unit", ()) if "=" in line),
        unit_exit=int(unit_exit) if unit_exit and unit_exit.isdigit() else None,
        process_user=first("user") if "pid" in found else None,
        process_env=dict(item.partition("=")[::2] for item in found.get("env", ()) if "=" in item),
        unit_readable="unit_files" not in found and "unit_secret_names" in found,
        unit_secret_names=number("unit_secret_names"),
        unit_secret_values=number("unit_secret_values"),
        secrets_file=None if secrets in (None, "absent") else secrets,
    )


class VerifyHost(FactBase):
    """
    What the checks read of the host besides GPUs and toolkits (files/scripts/verify-host.sh), as a
    ``HostReport``. Secrets never leave the host: only counts are printed, and only the service's
    variables in ``env_names``.

    + install_path: the toolkit's install path
    + venv_path: the stable venv path
    + unit: the service's unit
    + env_names: the variables of the service's live environment to read
    + secret_names: the variables of the secrets file (never read from the environment)
    + secrets_file: the service's secrets file
    """

    def command(self, install_path: str, venv_path: str, unit: str, env_names: tuple[str, ...],
                secret_names: tuple[str, ...], secrets_file: str) -> str:
        return script_command("verify-host.sh", env={
            "CUDA": install_path, "VENV": venv_path, "RECORDS": " ".join(PATCH_RECORDS), "UNIT": unit,
            "PROPERTIES": ",".join(UNIT_PROPERTIES), "ENV_NAMES": " ".join(env_names),
            "SECRET_NAMES": " ".join(secret_names), "SECRETS_FILE": secrets_file})

    @staticmethod
    def default() -> HostReport:
        return HostReport()

    def process(self, output: list[str]) -> HostReport:
        return parse_host_report(output)


class VerificationRecord(FactBase):
    """
    The record the deploy's verify step left on the host (``operations/verify.py``), or None when
    there is none or it is not a JSON object.

    + path: the record file (``<servestack_state_dir>/verified.json``)
    """

    def command(self, path: str) -> str:
        return f"cat {shlex.quote(path)} 2>/dev/null; true"

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> dict | None:
        try:
            record = json.loads("\n".join(output))
        except ValueError:
            return None
        return record if isinstance(record, dict) else None
