"""What the checks read of a host, by group, and `Readings`: what was read, for the judges.

Each group is a list of facts (facts/batch.py `FactRequest`), each fact with its own command and
parser; a group, or several, is read in one remote command:

    gpu      the GPUs and the driver: facts/gpu.py NvidiaGpus, as preflight reads it
    toolkit  the toolkit's tree, the link, toolkits.json: facts/toolkit.py CudaToolkits, with the
             toolkit step's own arguments
    kept     each kept toolkit's fingerprint: facts/toolkit.py ToolkitFingerprint
    host     the toolkit's package and path, the active release, the service: facts/verify.py VerifyHost
    python   the active venv's python: VerifyPython
    patches  the patches step's check of the active release: PatchCheck (needs `host`: its record)
    weights  the unit file and the weights step's record of each pinned model: FileContents, ServiceRecord
    sample   the CUDA sample: CudaSample
    http     /health and /generate: ServiceHttp

The deploy reads them with servestack.reads (operations/verify.py), the testinfra suite with
`read_batch` over testinfra's connection (servestack/verify.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pyinfra.facts.files import FileContents

from facts.batch import FactBatch, FactRequest, batches, section_name
from facts.framing import Section, split
from facts.gpu import GpuReport, NvidiaGpus
from facts.service import ServiceRecord
from facts.toolkit import (
    CudaToolkits,
    Fingerprint,
    LinkChain,
    ToolkitFingerprint,
    ToolkitState,
    Tree,
    toolkit_fact_arguments,
)
from facts.verify import CudaSample, HostReport, PatchCheck, ServiceHttp, VerifyHost, VerifyPython
from servestack.checks.parse import patch_record_for
from servestack.paths import kept_paths, patch_record_path, secrets_path, unit_path
from servestack.serving import GENERATE_REQUEST, check_url
from servestack.settings import PINNED_ENV, Settings
from servestack.weights import pinned_models

GROUPS = ("gpu", "toolkit", "kept", "host", "python", "patches", "weights", "sample", "http")
NEEDS = {"patches": ("host",)}   # groups whose requests depend on what another group read
NOT_READ = Section(None, ())


@dataclass
class Readings:
    """What the checks read of one host, by group (the defaults stand for "not read")."""

    host_name: str
    gpu: GpuReport = field(default_factory=lambda: GpuReport(error="nvidia-smi gave no answer"))
    toolkits: ToolkitState | None = None
    kept: dict[str, Fingerprint] = field(default_factory=dict)
    host: HostReport = field(default_factory=HostReport)
    python: Section = NOT_READ
    patches: Section = NOT_READ
    weights: list = field(default_factory=lambda: [None])   # the unit file's lines, then each pinned model's record
    sample: Section = NOT_READ
    http: Section = NOT_READ
    groups: set[str] = field(default_factory=set)   # the groups read

    @property
    def on(self) -> str:
        """How a message names the host: "on gpu-node-01"."""
        return f"on {self.host_name}"

    def tree(self, settings: Settings) -> Tree:
        return self.toolkits.install if self.toolkits else Tree(settings.cuda_install_path)

    def link(self, settings: Settings) -> LinkChain:
        return self.toolkits.link if self.toolkits else LinkChain(settings.manifest.cuda["link_path"])

    @property
    def toolkits_record(self) -> dict | None:
        """toolkits.json, as the toolkit step wrote it (None: none, or not a JSON object)."""
        return self.toolkits.record if self.toolkits else None

    def store(self, group: str, values: list) -> None:
        """Keep what `requests(..., group, ...)` read, in the order of its requests."""
        if group == "kept":
            self.kept = {fingerprint.path: fingerprint for fingerprint in values if fingerprint is not None}
        elif group == "weights":
            self.weights = values
        else:
            setattr(self, "toolkits" if group == "toolkit" else group, values[0])
        self.groups.add(group)


def venv_python(settings: Settings) -> str:
    return f"{settings.venv_path}/bin/python"


def service_env_names(settings: Settings) -> tuple[str, ...]:
    """The service's variables the checks read from its live environment: those servestack pins
    and service_env, never a secret's."""
    names = (set(PINNED_ENV) | set(settings.service_env)) - set(settings.service_secret_env)
    return tuple(sorted(names))


def requests(settings: Settings, group: str, readings: Readings | None = None, *,
             generate: bool = True, release=None) -> list[FactRequest]:
    """The facts of `group`, with the arguments the checks read them with.

    `generate`: the http group asks a real POST /generate too (the suite; the deploy asks /health
    only, its service step's gate has just made one). `release` (the deploy's): the patch check
    judges that release, with the record the patches step wrote; else the active venv's, with
    the record found beside it (`readings.host`, read first: NEEDS)."""
    if group == "gpu":
        return [FactRequest.of(NvidiaGpus)]
    if group == "toolkit":
        return [FactRequest.of(CudaToolkits, **toolkit_fact_arguments(settings))]
    if group == "kept":
        return [FactRequest.of(ToolkitFingerprint, path=path) for path in kept_paths(settings)]
    if group == "host":
        return [FactRequest.of(VerifyHost, install_path=settings.cuda_install_path, venv_path=settings.venv_path,
                               unit=settings.service_name, env_names=service_env_names(settings),
                               secret_names=tuple(settings.service_secret_env), secrets_file=secrets_path(settings))]
    if group == "python":
        return [FactRequest.of(VerifyPython, python=venv_python(settings),
                               packages=tuple(package.name for package in settings.packages))]
    if group == "patches":
        if release is not None:
            return [FactRequest.of(PatchCheck, python=release.python, record_path=patch_record_path(release))]
        host = readings.host if readings else HostReport()
        return [FactRequest.of(PatchCheck, python=venv_python(settings), record_path=patch_record_for(host))]
    if group == "weights":
        return [FactRequest.of(FileContents, path=unit_path(settings)),
                *(FactRequest.of(ServiceRecord, path=model.record(settings)) for model in pinned_models(settings))]
    if group == "sample":
        return [FactRequest.of(CudaSample, nvcc=f"{settings.cuda_install_path}/bin/nvcc",
                               work_parent=settings.servestack_state_dir)]
    if group == "http":
        return [FactRequest.of(ServiceHttp, python=venv_python(settings), url=check_url(settings),
                               request=json.dumps(GENERATE_REQUEST) if generate else "")]
    raise ValueError(f"no such group of reads: {group}")


# servestack/verify.py `Target.run_command` runs `sh -c CMD` through testinfra, whose SSH backend quotes it for
# `sudo /bin/sh -c` and again for its local `ssh HOST CMD` (testinfra/backend/base.py get_sudo_command, run_local)
TESTINFRA_QUOTES = 3


def read_groups(readings: Readings, settings: Settings, groups, read: Callable[[list[FactRequest]], list],
                also: Sequence[FactRequest] = (), **options) -> list:
    """Read `groups` (their `requests(..., **options)`) and `also` with `read(requests) -> values`,
    in one go; keep the groups' values in `readings` and return those of `also`."""
    wanted = {group: requests(settings, group, readings, **options) for group in groups}
    values = read([request for group in groups for request in wanted[group]] + list(also))
    for group in groups:
        readings.store(group, values[:len(wanted[group])])
        values = values[len(wanted[group]):]
    return values


def in_order(groups) -> tuple[str, ...]:
    wanted = set(groups)
    return tuple(group for group in GROUPS if group in wanted)


def read_batch(run: Callable[[str], str], wanted: list[FactRequest], quotes: int = TESTINFRA_QUOTES) -> list:
    """The values of `wanted`, read with `run(command) -> its stdout` (one command per batch that
    fits as it arrives after `quotes` shell quotings, facts/batch.py). Raises RuntimeError naming a fact
    whose command failed."""
    values = []
    for group in batches(wanted, quotes):
        sections = split(run(FactBatch().command(group)).splitlines())
        for index, request in enumerate(group):
            section = sections.get(section_name(index), NOT_READ)
            if not section.ok:
                raise RuntimeError(f"reading {request.name} failed (exit {section.rc}): "
                                   + "\n".join(section.lines[-5:]))
            values.append(request.value(section))
    return values
