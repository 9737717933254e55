"""Every verification check: its name (tests/verify has a test of that name), the groups of reads
it judges (readings.py), whether it needs servestack's own deploy (records, release, service),
and its judge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from servestack.checks import gpus, release, service, toolkit, weights
from servestack.checks.outcome import FAILED, PASSED, SKIPPED, Fail, Outcome, Skip
from servestack.checks.readings import Readings, in_order
from servestack.settings import Settings


@dataclass(frozen=True)
class Check:
    """A named check: the groups it reads, its judge, whether it needs servestack's deploy."""

    name: str
    groups: tuple[str, ...]
    judge: Callable[..., str]
    deployed: bool = False

    def outcome(self, settings: Settings, readings: Readings, *args) -> Outcome:
        """The judge's verdict; `args`: package_version's package, named in the check's name."""
        name = f"{self.name}[{args[0]}]" if args else self.name
        try:
            return Outcome(name, PASSED, self.judge(settings, readings, *args))
        except Fail as failure:
            return Outcome(name, FAILED, str(failure))
        except Skip as skip:
            return Outcome(name, SKIPPED, str(skip))


CHECKS = (
    Check("driver_version", ("gpu",), gpus.driver_version),
    Check("gpu_capability", ("gpu",), gpus.gpu_capability),
    Check("gpu_count", ("gpu",), gpus.gpu_count),
    Check("nvcc_version", ("toolkit",), toolkit.nvcc_version),
    Check("version_json", ("toolkit", "host"), toolkit.version_json),
    Check("cuda_link", ("toolkit", "host"), toolkit.cuda_link),
    Check("kept_toolkits", ("toolkit", "kept"), toolkit.kept_toolkits, deployed=True),
    Check("cuda_sample", ("sample",), toolkit.cuda_sample),
    Check("package_version", ("python",), release.package_version, deployed=True),
    Check("torch_cuda_build", ("python",), release.torch_cuda_build),
    Check("torch_device_capability", ("python",), release.torch_device_capability),
    Check("torch_cuda_op", ("python",), release.torch_cuda_op),
    Check("sglang_sm120", ("python",), release.sglang_sm120, deployed=True),
    Check("patches_applied", ("host", "patches"), release.patches_applied, deployed=True),
    Check("served_weights", ("weights",), weights.served_weights, deployed=True),
    Check("service_active", ("host",), service.service_active, deployed=True),
    Check("service_user", ("host",), service.service_user, deployed=True),
    Check("service_environment", ("host",), service.service_environment, deployed=True),
    Check("service_secrets", ("host",), service.service_secrets, deployed=True),
    Check("service_health", ("host", "http"), service.service_health, deployed=True),
    Check("service_generate", ("host", "http"), service.service_generate, deployed=True),
)
CHECKS_BY_NAME = {check.name: check for check in CHECKS}


def judge_all(settings: Settings, readings: Readings, checks=CHECKS) -> list[Outcome]:
    """Every check's outcome; package_version once per manifest package."""
    outcomes = []
    for check in checks:
        if check.name == "package_version":
            outcomes += [check.outcome(settings, readings, package.name) for package in settings.packages]
        else:
            outcomes.append(check.outcome(settings, readings))
    return outcomes


def groups_for(checks) -> tuple[str, ...]:
    """The groups of reads the checks judge, in reading order."""
    return in_order(group for check in checks for group in check.groups)


def in_catalogue_order(outcomes: list[Outcome]) -> list[Outcome]:
    order = {check.name: index for index, check in enumerate(CHECKS)}
    return sorted(outcomes, key=lambda outcome: order.get(base_name(outcome.check), len(order)))


def base_name(check: str) -> str:
    """package_version[torch] -> package_version."""
    return check.split("[", 1)[0]
