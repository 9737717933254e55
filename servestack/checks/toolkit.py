"""The toolkit checks: the new toolkit answers with the manifest's version, the kept ones are
untouched, /usr/local/cuda points where policy says, and code it compiles runs on these GPUs."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from facts.toolkit import Fingerprint, LinkChain
from servestack.checks.outcome import Fail
from servestack.checks.parse import nonblank, package_owner, packaged_release, sample_flags, sample_results
from servestack.paths import kept_paths, toolkits_record_path
from servestack.settings import Settings


def _is_date_stamp(version: str) -> bool:
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return len(release) >= 3 and release[2] >= 10000


def version_json_problem(settings: Settings, version_json: dict) -> str | None:
    """Why a version.json is not the manifest's toolkit, or None: the toolkit step's judgement and the check's.

    `cuda_nvcc.version` must be the manifest's nvcc version; `cuda.version` must be the
    manifest's version, except that a date stamp (12.6.20241114, seen in runfile installs) only
    has to share its major.minor.
    """
    cuda = settings.manifest.cuda
    nvcc = (version_json.get("cuda_nvcc") or {}).get("version")
    if nvcc != cuda["nvcc_version"]:
        return f"version.json says cuda_nvcc {nvcc}, expected {cuda['nvcc_version']}"
    sdk = (version_json.get("cuda") or {}).get("version")
    if sdk is None:
        return "version.json has no cuda.version"
    wanted = settings.cuda_version
    if _is_date_stamp(sdk):
        release = Version(wanted).release
        if not sdk.startswith(f"{release[0]}.{release[1]}."):
            return f"version.json says CUDA {sdk}, expected {wanted}"
    elif sdk != wanted:
        return f"version.json says CUDA {sdk}, expected {wanted}"
    return None


def _existing_tree(settings: Settings, readings):
    tree = readings.tree(settings)
    if not tree.exists:
        raise Fail(f"{settings.cuda_install_path} does not exist {readings.on}")
    return tree


def nvcc_version(settings: Settings, readings) -> str:
    nvcc = f"{settings.cuda_install_path}/bin/nvcc"
    expected = settings.manifest.cuda["nvcc_version"]
    tree = _existing_tree(settings, readings)
    if tree.nvcc is None:
        raise Fail(f"{nvcc} {readings.on}: {tree.nvcc_error or 'no version reported'}")
    if tree.nvcc.version != expected:
        raise Fail(f"{nvcc} reports V{tree.nvcc.version}, the manifest pins V{expected} "
                   f"(CUDA {settings.cuda_version})")
    return f"{nvcc} reports release {tree.nvcc.release}, V{tree.nvcc.version}"


def version_json(settings: Settings, readings) -> str:
    """version.json agrees with the manifest (the toolkit step's own judgement). A toolkit from
    distribution packages has none: its nvcc package must agree with the manifest's nvcc version,
    and since that version is shared by toolkit releases (13.0.1, 13.0.2), it passes only where host
    data accepts an existing toolkit (cuda_existing_toolkit = 'accept'), as the toolkit step does."""
    path = f"{settings.cuda_install_path}/version.json"
    expected_nvcc = settings.manifest.cuda["nvcc_version"]
    tree = _existing_tree(settings, readings)
    if tree.version_json_invalid:
        raise Fail(f"{path} {readings.on} is not valid JSON")
    if tree.version_json is not None:
        problem = version_json_problem(settings, tree.version_json)
        if problem:
            raise Fail(f"{path} {readings.on}: {problem}")
        return f"{path}: CUDA {tree.version_json['cuda']['version']}, cuda_nvcc {expected_nvcc}"
    owner = package_owner(readings.host)
    if owner is None:
        raise Fail(f"{path} is missing {readings.on} and no package owns the toolkit's nvcc")
    manager, package, package_version = owner
    release = packaged_release(readings.host)
    found = f"{manager} package {package} {package_version}" + (f", release {release}" if release else "")
    if package_version.split("-")[0] != expected_nvcc:
        raise Fail(f"{path} is missing {readings.on}: a toolkit from {found}; the manifest pins nvcc "
                   f"{expected_nvcc}")
    if settings.cuda_existing_toolkit != "accept":
        raise Fail(f"{path} is missing {readings.on}: a toolkit from {found}, which cannot be confirmed "
                   f"as CUDA {settings.cuda_version} (its nvcc {expected_nvcc} is shared by other "
                   "releases); host data cuda_existing_toolkit = 'accept' accepts it")
    return (f"no version.json: toolkit from {found}; nvcc {expected_nvcc} as pinned, accepted "
            "(cuda_existing_toolkit = 'accept')")


def kept_toolkits(settings: Settings, readings) -> str:
    """Every kept toolkit (manifest cuda.keep) has the fingerprint recorded before the install
    (facts/toolkit.py's fingerprint, the one the toolkit step records)."""
    record = readings.toolkits_record
    record_file = toolkits_record_path(settings.servestack_state_dir)
    if record is None:
        raise Fail(f"no readable {record_file} {readings.on}: the toolkit step records the kept "
                   "toolkits' fingerprints there before installing")
    problems, notes = [], []
    for path in kept_paths(settings):
        recorded = (record.get("toolkits") or {}).get(path)
        if not isinstance(recorded, dict):
            problems.append(f"{record_file} has no fingerprint of {path}")
            continue
        now = readings.kept.get(path, Fingerprint(path, present=False))
        changes = Fingerprint.from_record(path, recorded).differences(now)
        if changes:
            problems.append(f"{path} changed since it was recorded: " + "; ".join(changes))
        else:
            notes.append(f"{path} " + (f"unchanged ({now.files} files, nvcc {now.nvcc_version})" if now.present
                                       else "absent, as recorded"))
    if problems:
        raise Fail(f"{readings.on}: " + "; ".join(problems))
    return "; ".join(notes) or "no toolkit to keep"


def cuda_link(settings: Settings, readings) -> str:
    """/usr/local/cuda resolves where cuda_link_policy says: to the new toolkit ('new') or where it
    resolved before the install ('keep', from toolkits.json). A chain through /etc/alternatives
    counts by where it ends."""
    chain = readings.link(settings)
    if settings.cuda_link_policy == "new":
        target = readings.host.toolkit_path or settings.cuda_install_path
        if chain.resolved != target:
            raise Fail(f"cuda_link_policy 'new': {chain.path} should resolve to {target} {readings.on}, "
                       f"but is {chain.describe()}")
        return f"{chain.describe()} (policy 'new')"
    record = readings.toolkits_record
    if not record or not isinstance(record.get("link"), dict):
        raise Fail(f"cuda_link_policy 'keep': {toolkits_record_path(settings.servestack_state_dir)} "
                   f"{readings.on} has no record of where {chain.path} pointed before the install")
    before = LinkChain.from_record(record["link"])
    if chain.resolved != before.resolved:
        raise Fail(f"cuda_link_policy 'keep': {chain.path} was {before.describe()} before the install, "
                   f"now {chain.describe()} {readings.on}")
    return f"{chain.describe()}, as before the install (policy 'keep')"


def cuda_sample(settings: Settings, readings) -> str:
    section = readings.sample
    if section.rc == 4:   # host data always expects GPUs (gpu_count >= 1)
        raise Fail(f"no /dev/nvidiactl {readings.on}, host data expects gpu_count = {settings.gpu_count}: "
                   "the NVIDIA kernel module made no device node the CUDA runtime could open")
    if section.rc is None:
        raise Fail(f"the CUDA sample did not finish {readings.on}")
    flags = sample_flags(section)
    if section.rc == 7:
        raise Fail(f"{settings.cuda_install_path}/bin/{flags} failed {readings.on}:\n"
                   + "\n".join(nonblank(section)[-15:]))
    results = sample_results(section)
    if section.rc != 0 or not results or not results[-1].endswith("PASS"):
        detail = "\n".join(results or nonblank(section)[-15:])
        raise Fail(f"the CUDA sample built with `{flags}` failed {readings.on} (exit {section.rc}):\n{detail}")
    totals = [line for line in results if line.startswith("devices ")]   # `devices N: PASS`, the sample's last line
    ran_on = int(totals[-1].split()[1].rstrip(":")) if totals else None
    if ran_on != settings.gpu_count:
        raise Fail(f"the CUDA sample ran on {ran_on} device(s) {readings.on}, expected gpu_count = "
                   f"{settings.gpu_count}: " + "; ".join(results))
    return f"built with `{flags}`; " + "; ".join(results)
