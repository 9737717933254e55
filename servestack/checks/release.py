"""The release checks: the pinned stack in the active venv, torch on these GPUs, SGLang's SM120
support and the recorded source patches."""

from __future__ import annotations

from packaging.version import Version

from servestack.checks.outcome import Fail, Skip
from servestack.checks.parse import major_minor, patch_report, report, tail, version_or_none
from servestack.checks.readings import venv_python
from servestack.settings import Settings


def _python_report(settings: Settings, readings) -> dict:
    found = report(readings.python)
    if found is None:
        raise Fail(f"{venv_python(settings)} {readings.on} gave no report (exit {readings.python.rc}): "
                   + tail(readings.python, 10))
    return found


def _torch(settings: Settings, readings) -> dict:
    found = _python_report(settings, readings)
    if "torch" not in found:
        raise Fail(f"torch does not import in {found.get('prefix')} {readings.on}: {found.get('torch_error')}")
    return found["torch"]


def _torch_on_gpus(settings: Settings, readings) -> dict:
    """torch's view of the GPUs. Host data always expects some (gpu_count >= 1): torch seeing none
    fails the check, with the reason torch gave (its "CUDA initialization" warning)."""
    torch = _torch(settings, readings)
    if not torch["available"]:
        reason = torch.get("unavailable_reason") or "torch gave no reason"
        raise Fail(f"torch.cuda.is_available() is False {readings.on}, host data expects gpu_count = "
                   f"{settings.gpu_count}: {reason}")
    return torch


def package_version(settings: Settings, readings, name: str) -> str:
    """The active release holds the manifest's exact version, local label included."""
    found_report = _python_report(settings, readings)
    expected = settings.package(name).version
    found = found_report["packages"].get(name)
    where = found_report.get("prefix") or settings.venv_path
    if found is None:
        raise Fail(f"{name} is not installed in {where} {readings.on}, expected {expected}")
    if version_or_none(found) != Version(expected) or found.partition("+")[2] != expected.partition("+")[2]:
        raise Fail(f"{name} {found} in {where} {readings.on}, expected {expected}")
    return f"{name} {found}"


def torch_cuda_build(settings: Settings, readings) -> str:
    torch = _torch(settings, readings)
    expected = major_minor(settings.cuda_version)
    if torch["cuda"] != expected:
        raise Fail(f"torch {torch['version']} {readings.on} is built for CUDA {torch['cuda']}, expected {expected}")
    return f"torch {torch['version']}, torch.version.cuda == {expected!r}"


def torch_device_capability(settings: Settings, readings) -> str:
    torch = _torch_on_gpus(settings, readings)
    expected = [int(part) for part in settings.gpu_compute_capability.split(".")]
    capabilities = torch["capabilities"]
    wrong = [f"cuda:{i} is {tuple(cap)}" for i, cap in enumerate(capabilities) if cap != expected]
    if wrong or len(capabilities) != settings.gpu_count:
        raise Fail(f"expected {settings.gpu_count} device(s) of capability {tuple(expected)} {readings.on}, "
                   f"torch sees {len(capabilities)}" + (": " + "; ".join(wrong) if wrong else ""))
    return f"{len(capabilities)} device(s), each {tuple(expected)}"


def torch_cuda_op(settings: Settings, readings) -> str:
    torch = _torch_on_gpus(settings, readings)
    expected_sum, expected_matmul = float(2 * sum(range(1024))), float(64 ** 3)
    problems = []
    for op in torch.get("ops", []):
        if "error" in op:
            problems.append(f"cuda:{op['device']}: {op['error']}")
        elif (op["sum"], op["matmul"]) != (expected_sum, expected_matmul):
            problems.append(f"cuda:{op['device']}: sum {op['sum']} (expected {expected_sum}), "
                            f"matmul {op['matmul']} (expected {expected_matmul})")
    if problems or not torch.get("ops"):
        raise Fail(f"torch CUDA operations {readings.on}: " + ("; ".join(problems) or "no device ran"))
    return f"a sum and a matmul on {len(torch['ops'])} device(s) gave the right results"


def sglang_sm120(settings: Settings, readings) -> str:
    if not settings.gpu_compute_capability.startswith("12."):
        raise Skip(f"the expected compute capability {settings.gpu_compute_capability} {readings.on} is not SM120")
    torch = _torch_on_gpus(settings, readings)
    found = _python_report(settings, readings)
    if "sm120" not in found:
        raise Fail(f"SGLang's is_sm120_supported() {readings.on} raised: {found.get('sm120_error')}")
    if not found["sm120"]:
        raise Fail(f"SGLang's is_sm120_supported() is False {readings.on} (torch {torch['version']}, "
                   f"CUDA {torch['cuda']}, capabilities {torch['capabilities']})")
    return "SGLang's is_sm120_supported() is True"


def patches_applied(settings: Settings, readings) -> str:
    """The recorded patch set is applied and every patched file is as the record says: the patches
    step's own check (facts/patches.py) finds each patch applied and its record current."""
    section = readings.patches
    found = patch_report(section)
    if found is None:
        raise Fail(f"the patch check {readings.on} gave no report (exit {section.rc}): " + tail(section, 10))
    if not found.get("installed"):
        what = "no python" if found.get("python_missing") else "sglang is not installed"
        raise Fail(f"{what} at {found.get('python')} {readings.on}")
    if found.get("patch_set") is None:   # nothing was checked: not a pass
        raise Skip(f"sglang {found['version']} {readings.on} has no servestack patch set: nothing to check")
    not_applied = [f"{patch['name']} is {patch['state']}" for patch in found["patches"]
                   if patch["state"] not in ("applied", "upstream")]
    if not_applied:
        raise Fail(f"sglang {found['version']} {readings.on}: " + "; ".join(not_applied))
    if found.get("record") != "current":
        raise Fail(f"the patch record {found.get('record_path')} {readings.on} is {found.get('record')}: "
                   "the patched files are not what the patches step recorded")
    states = ", ".join(f"{patch['name']} {patch['state']}" for patch in found["patches"])
    return f"sglang {found['version']}: {states}; record {found.get('record_path')} current"
