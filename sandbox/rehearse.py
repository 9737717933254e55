"""`./servestack.sh rehearse`: the real deploy.py against sandbox hosts, the way a user runs it on a fleet.

1. boot sandbox GPU-host stand-ins (systemd, SSH, a stand-in GPU, CUDA 12.8 and a hand-made ml-env),
   each given one of the manifest's service profiles in turn (by default one host per profile)
2. `pyinfra --dry --diff`: and prove the hosts did not change (a fingerprint before and after)
3. apply, 4. apply again: the second run must change nothing
5. the verification suite against the converged hosts, and each host's server started with its profile

It ends with one machine-readable line: `rehearse: OK hosts=N first_run_changes=N ...`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from servestack.manifest import PROJECT_ROOT, load_manifest
from servestack.settings import settings_from_data
from servestack.weights import served_path

console = Console(stderr=True)

STAND_IN_NOTICE = ("Stand-ins: the GPUs (nvidia-smi), the CUDA runfile and the CUDA wheels on these hosts are "
                   "small stand-ins; systemd, SSH, uv, the SGLang sources and the deploy are real.")


#: The verification checks whose answer comes from a stand-in on sandbox hosts, and which one: their
#: pass shows the deploy and the check agree with the stand-in, not that a GPU works.
STAND_IN_CHECKS = {
    "driver_version": "the stand-in nvidia-smi",
    "gpu_capability": "the stand-in nvidia-smi",
    "gpu_count": "the stand-in nvidia-smi",
    "nvcc_version": "the stand-in runfile's nvcc",
    "version_json": "the stand-in runfile's version.json",
    "cuda_sample": "the stand-in nvcc's simulated sample",
    "torch_cuda_build": "the stand-in torch wheel",
    "torch_device_capability": "the stand-in torch's simulated GPUs",
    "torch_cuda_op": "the stand-in torch's simulated GPUs",
    "sglang_sm120": "the real sglang on the stand-in torch's simulated GPUs",
    "service_health": "the stand-in SGLang server",
    "service_generate": "the stand-in SGLang server",
}


class RehearsalFailed(Exception):
    """A rehearsal step failed; the message says which and why."""


@dataclass
class Outcome:
    hosts: int = 0
    profiles: dict = field(default_factory=dict)   # host name -> service profile
    first_run_changes: int | None = None
    second_run_changes: int | None = None
    verify: dict = field(default_factory=lambda: {"passed": 0, "passed_on_standins": 0, "failed": 0, "skipped": 0})
    timings: dict = field(default_factory=dict)

    def line(self, status: str, reason: str = "") -> str:
        fields = (f"hosts={self.hosts} first_run_changes={_n(self.first_run_changes)} "
                  f"second_run_changes={_n(self.second_run_changes)} verify_passed={self.verify['passed']} "
                  f"verify_passed_on_standins={self.verify['passed_on_standins']} "
                  f"verify_failed={self.verify['failed']} verify_skipped={self.verify['skipped']}")
        if self.profiles:
            fields += " profiles=" + ",".join(sorted(set(self.profiles.values())))
        return f"rehearse: {status} {fields}" + (f" reason={reason!r}" if reason else "")


def _n(value) -> str:
    return "-" if value is None else str(value)


def pyinfra_argv(inventory: Path, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "pyinfra"), str(inventory), "deploy.py", *args]


def _run(lab, argv: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(lab.controller_argv(argv), cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def profile_names() -> list[str]:
    """The manifest's service profiles, the default one first."""
    service = load_manifest().service
    return sorted(service["profiles"], key=lambda name: (name != service["profile"], name))


def assign_profiles(lab, profiles: list[str]) -> dict[str, str]:
    """Give the lab's hosts the service profiles in turn (host data `service_profile`), rewriting its
    inventory; {host name: profile}."""
    from sandbox.lab import sandbox_manifest

    chosen = {host.name: profiles[index % len(profiles)] for index, host in enumerate(lab.hosts)}
    manifest = sandbox_manifest(lab.state_dir / "stack.toml", lab.artifacts)
    lab.sandbox.write_inventory(lambda host: lab.host_data(host, manifest, {"service_profile": chosen[host.name]}))
    return chosen


def server_info(lab, host) -> dict:
    """GET /server_info of a host's server, asked from the controller namespace."""
    url = f"http://{host.address}:{load_manifest().service['port']}/server_info"
    fetch = ("import sys, urllib.request; "
             "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())")
    result = subprocess.run(lab.controller_argv([sys.executable, "-c", fetch, url]), capture_output=True,
                            text=True, timeout=60)
    try:
        if result.returncode == 0:
            return json.loads(result.stdout)
    except ValueError:
        pass
    raise RehearsalFailed(f"{host.name}: GET {url} failed: {_tail(result.stderr or result.stdout, 3)}")


def _algorithm(name: str | None) -> str | None:
    return "EAGLE" if name == "NEXTN" else name  # sglang reads NEXTN as EAGLE


def check_profiles(lab, outcome: Outcome) -> None:
    """Each host's server was started with its profile's model and speculative algorithm."""
    profiles = load_manifest().service["profiles"]
    console.rule("service profiles")
    for host in lab.hosts:
        profile = profiles[outcome.profiles[host.name]]
        args = server_info(lab, host).get("server_args", {})
        served = (args.get("model_path"), _algorithm(args.get("speculative_algorithm")))
        staged = served_path(settings_from_data(host.name, {"servestack_manifest": str(lab.state_dir / "stack.toml"),
                                                            "service_profile": outcome.profiles[host.name]}), "model")
        wanted = (staged, _algorithm(profile["speculative_algorithm"]))   # the weights step's copy of its model
        if served != wanted:
            raise RehearsalFailed(f"{host.name} serves model {served[0]!r} with speculative algorithm {served[1]!r}; "
                                  f"its profile {outcome.profiles[host.name]!r} says {wanted[0]!r}, {wanted[1]!r}")
        console.print(f"{host.name}: profile {outcome.profiles[host.name]}: serves {profile['model_path']} "
                      f"(speculative algorithm {args.get('speculative_algorithm')}) from {served[0]}",
                      markup=False, highlight=False, soft_wrap=True)


def dry_run(lab, inventory: Path, outcome: Outcome) -> None:
    before = lab.snapshots()
    result = _timed(outcome, "dry run", lambda: _run(lab, pyinfra_argv(inventory, "--dry", "--diff")))
    console.print(result.stderr + result.stdout, markup=False, highlight=False)
    if result.returncode != 0:
        raise RehearsalFailed(f"dry run failed (exit {result.returncode})")
    changes = lab.changes(before, lab.snapshots())
    if changes:
        console.print("the dry run changed:\n" + "\n".join(changes), markup=False, highlight=False)
        raise RehearsalFailed("the dry run changed a host")
    console.print("[green]dry run: no host changed (fingerprints identical)[/]")


def apply(lab, inventory: Path, outcome: Outcome, label: str) -> int:
    result = _timed(outcome, label, lambda: _run(lab, pyinfra_argv(inventory, "-y", "--json")))
    try:
        totals = json.loads(result.stdout)["results"]["totals"]
    except (ValueError, KeyError):
        raise RehearsalFailed(f"{label}: pyinfra failed (exit {result.returncode}):\n"
                              f"{_tail(result.stdout + result.stderr)}") from None
    if result.returncode != 0 or totals.get("error"):
        raise RehearsalFailed(f"{label}: {totals.get('error', '?')} operation(s) failed:\n"
                              f"{_tail(result.stderr)}")
    console.print(f"{label}: {totals.get('success', 0)} changed, {totals.get('no_change', 0)} unchanged")
    return int(totals.get("success", 0))


def verify(lab, inventory: Path, outcome: Outcome) -> None:
    junit = lab.state_dir / "verify-junit.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "tests/verify", "--inventory", str(inventory),
            f"--junitxml={junit}", "-p", "no:cacheprovider", "-q", "-rs"]
    result = _timed(outcome, "verify", lambda: _run(lab, argv))
    console.print(_tail(result.stdout, 60), markup=False, highlight=False)
    if result.returncode not in (0, 1, 5):
        raise RehearsalFailed(f"the verification suite could not run (exit {result.returncode}):\n"
                              f"{_tail(result.stdout + result.stderr)}")
    outcome.verify = junit_counts(junit) if junit.exists() else outcome.verify
    if outcome.verify["failed"]:
        raise RehearsalFailed(f"{outcome.verify['failed']} verification check(s) failed")


def junit_counts(path: Path) -> dict:
    """passed/failed/skipped totals of a pytest JUnit XML report, and how many of the passes were of
    STAND_IN_CHECKS (`passed_on_standins`, part of `passed`)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(suite.get("tests", 0)) for suite in suites)
    failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
    skipped = sum(int(suite.get("skipped", 0)) for suite in suites)
    on_standins = sum(1 for case in root.iter("testcase")
                      if _check_of(case.get("name", "")) in STAND_IN_CHECKS
                      and not any(child.tag in ("failure", "error", "skipped") for child in case))
    return {"passed": total - failed - skipped, "passed_on_standins": on_standins, "failed": failed,
            "skipped": skipped}


def _check_of(test_name: str) -> str:
    """test_cuda_sample[ssh://h1] -> cuda_sample."""
    return test_name.split("[", 1)[0].removeprefix("test_")


def _timed(outcome: Outcome, label: str, step):
    console.rule(label)
    started = time.monotonic()
    result = step()
    outcome.timings[label] = time.monotonic() - started
    return result


def summary(outcome: Outcome) -> Table:
    table = Table(title="servestack rehearsal")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for label, seconds in outcome.timings.items():
        table.add_row(label, f"{seconds:.1f}")
    return table


def rehearse(hosts: int | None = None, keep: bool = False) -> int:
    """Run the rehearsal; print the summary and the final line; 0 only when everything held.
    `hosts`: how many sandbox hosts (default: one per service profile), given the profiles in turn."""
    from sandbox.lab import Lab, gpu_spec

    profiles = profile_names()
    hosts = hosts or len(profiles)
    outcome, status, reason = Outcome(hosts=hosts), "OK", ""
    console.print(f"[bold]{STAND_IN_NOTICE}[/]")
    if hosts < len(profiles):
        console.print(f"[yellow]{hosts} host(s) for {len(profiles)} service profiles: not rehearsed: "
                      f"{', '.join(profiles[hosts:])}[/]")
    lab = Lab("rehearse")
    try:
        inventory = _timed(outcome, "sandbox up", lambda: lab.up(hosts, gpu=gpu_spec()))
        outcome.profiles = assign_profiles(lab, profiles)
        given = ", ".join(f"{name} {profile}" for name, profile in outcome.profiles.items())
        console.print(f"service profiles: {given}", markup=False, highlight=False, soft_wrap=True)
        dry_run(lab, inventory, outcome)
        outcome.first_run_changes = apply(lab, inventory, outcome, "first apply")
        outcome.second_run_changes = apply(lab, inventory, outcome, "second apply")
        if outcome.second_run_changes:
            raise RehearsalFailed(f"the second apply changed {outcome.second_run_changes} operation(s)")
        verify(lab, inventory, outcome)
        check_profiles(lab, outcome)
    except (RehearsalFailed, subprocess.TimeoutExpired) as error:
        status, reason = "FAILED", str(error).splitlines()[0]
        console.print(f"[red]{error}[/]", markup=True, highlight=False)
    finally:
        if keep:
            console.print(f"sandbox kept: {lab.state_dir} "
                          "(./servestack.sh sandbox down, with SERVESTACK_SANDBOX=rehearse)")
        else:
            lab.down()
    console.print(summary(outcome))
    console.print(STAND_IN_NOTICE)
    console.print(f"verify_passed_on_standins={outcome.verify['passed_on_standins']}: passes of checks answered by "
                  "stand-ins: " + "; ".join(f"{check} ({what})" for check, what in STAND_IN_CHECKS.items()),
                  markup=False, highlight=False, soft_wrap=True)
    print(outcome.line(status, reason))
    return 0 if status == "OK" else 1
