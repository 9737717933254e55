"""Benchmark: building the current stack's release from the REAL wheels (issue 33). Run by hand (root,
sandbox tools), not a test:

    .venv/bin/python bench/real_release.py                 # cold build, then 3 warm rounds
    .venv/bin/python bench/real_release.py --repeat 5 --refetch

One lab host on profile glm-5-mtp, every PyPI package served from its real wheel (sandbox/standins/
realwheels.py, Lab.serve_real_wheels), as tests/integration/test_real_release.py builds it:

1. cold: the first deploy builds the release with the host's uv cache empty. Measured: the bytes the
   artifact server sent of the real wheels against the total size of the files the lock names (goal:
   each file once), and the release's build time (release.json `build_seconds`: venv, lock, ordered
   install, checks). With --refetch the sandbox cache's copy of the wheels is dropped first, so the
   download from PyPI is measured too (the index is laid out again from it).
2. warm: `--repeat` rounds, each (a) the same release built again with the host's uv cache warm
   (rollback.py to the adopted env, the release directory removed, deploy.py; its `build_seconds`) and
   (b) with the same uv cache, plain `uv venv` + `uv pip install --require-hashes -r <the release's
   lock.txt>` into a new venv, timed on the host. The ratio of the medians is the goal's (1.2x or less).
   Each build's release check is taken from its record (<release>/check.json: its seconds, and each
   import's), so the ratio is also given without it: what the install alone costs against plain uv.

Writes bench/results/<git short sha>[-dirty]-real-release-<UTC>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import git_sha, utc_stamp, write_result  # noqa: E402
from sandbox.lab import Lab  # noqa: E402
from sandbox.rootfs import cache_dir  # noqa: E402
from sandbox.standins import realwheels  # noqa: E402
from sandbox.standins.pypi import fetch_wheels  # noqa: E402
from servestack.manifest import load_manifest  # noqa: E402

STACK, PROFILE = "sglang-0.5.14", "glm-5-mtp"
RELEASES = load_manifest().venv["releases_dir"]
VENV = load_manifest().venv["path"]
UV, UV_CACHE = "/opt/servestack/uv/bin/uv", "/opt/servestack/uv-cache"   # servestack/paths.py defaults
console = Console()


def pyinfra(lab: Lab, target: str = "deploy.py") -> str:
    """Run `target`. deploy.py fails on this GPU-less host where its verification needs a GPU (real torch
    sees none: tests/integration/test_real_release.py NO_GPU), after it built and activated the release;
    the callers check what is active."""
    argv = lab.controller_argv([str(Path(sys.executable).parent / "pyinfra"), str(lab.inventory_path), target,
                                "-y", "--json"])
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    before_verify = output.split("Starting operation: servestack verify")[0]
    if result.returncode != 0 and (target != "deploy.py" or "] Error:" in before_verify):
        raise RuntimeError(f"{target} failed:\n{output[-4000:]}")
    return output


def build_steps(output: str) -> dict[str, float]:
    """Seconds of each step of the build the host tool reported ("servestack: <step>: done after 3.1 s")."""
    return {step: float(seconds) for step, seconds in re.findall(r"servestack: (.+?): done after ([0-9.]+) s", output)}


def sh(lab: Lab, command: str) -> str:
    return lab.exec(lab.hosts[0], command, check=True).stdout


def active_release(lab: Lab) -> dict:
    return json.loads(sh(lab, f'cat "$(dirname "$(readlink -f {VENV})")/release.json"'))


def locked_files(lab: Lab, release: str, served: dict[str, int]) -> dict[str, int]:
    """{file name: size} of the served real wheels the release's lock names."""
    lock = sh(lab, f"cat {RELEASES}/{release}/lock.txt")
    names = {line.split("==")[0].strip().lower() for line in lock.splitlines() if "==" in line and line[:1] != " "}
    return {name: size for name, size in served.items() if name.split("-", 1)[0].lower().replace("_", "-") in names}


def real_wheel_bytes(lab: Lab, index: Path, files: Iterable[str]) -> int:
    """Bytes the artifact server sent of the real wheels `files` (whole downloads and ranges)."""
    prefix, wanted = lab.artifacts.url(index, ""), set(files)
    return sum(sent for path, sent in lab.artifact_bytes().items()
               if path.startswith(prefix) and path.rsplit("/", 1)[-1] in wanted)


def drop_cached_wheels() -> None:
    """Forget the sandbox cache's real wheels of the stack (and its laid-out index): the next use fetches them."""
    stack = load_manifest().stacks[STACK]
    for wheel in fetch_wheels(realwheels.real_requirements(stack))[:1]:
        shutil.rmtree(wheel.parent)
    for index in (cache_dir() / "real-index").glob(f"{STACK}-*"):
        shutil.rmtree(index)


def release_check(lab: Lab, release: str) -> dict:
    """The seconds of the release's check, and of each of its imports (its record, check.json)."""
    checked = json.loads(sh(lab, f"cat {RELEASES}/{release}/check.json"))
    return {"check_s": checked["seconds"], "imports_s": checked["found"]["imports"]}


def rebuild_warm(lab: Lab, release: str) -> tuple[float, dict[str, float]]:
    """Build `release` again with the host's uv cache warm: its build_seconds, and its steps' seconds."""
    pyinfra(lab, "rollback.py")
    sh(lab, f"rm -rf {RELEASES}/{release}")
    output = pyinfra(lab)
    record = active_release(lab)
    if record["id"] != release:
        raise RuntimeError(f"the deploy activated {record['id']}, not {release}")
    return float(record["build_seconds"]), build_steps(output)


def plain_install(lab: Lab, release: str, index_url: str) -> float:
    """Seconds of `uv venv` + `uv pip install --require-hashes -r lock.txt` with the release's uv cache."""
    env = f"UV_CACHE_DIR={UV_CACHE} UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1"
    script = (f"rm -rf /var/tmp/plain && start=$(date +%s.%N) && {env} {UV} venv --quiet --python python3 "
              f"/var/tmp/plain && {env} {UV} pip install --quiet --no-config --python /var/tmp/plain/bin/python "
              f"--default-index {index_url} --require-hashes -r {RELEASES}/{release}/lock.txt && "
              "end=$(date +%s.%N) && rm -rf /var/tmp/plain && echo \"$start $end\"")
    start, end = sh(lab, script).split()
    return float(end) - float(start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="warm rounds (default 3)")
    parser.add_argument("--refetch", action="store_true", help="download the wheels from PyPI again first")
    parser.add_argument("--name", default="bench-real", help="the lab's sandbox name")
    options = parser.parse_args()
    out: dict = {"commit": git_sha(), "utc": utc_stamp(),
                 "stack": STACK, "profile": PROFILE}
    if options.refetch:
        drop_cached_wheels()
    started = time.perf_counter()
    index = realwheels.real_index(load_manifest().stacks[STACK])
    out["fetch_and_index_s"] = round(time.perf_counter() - started, 1)
    lab = Lab(options.name)
    try:
        lab.up(1, private_artifacts=True)
        served = lab.serve_real_wheels(STACK)
        lab.sandbox.write_inventory(lambda host: lab.host_data(host, lab.state_dir / "stack.toml", {
            "service_profile": PROFILE, **lab.real_wheels_data(host, served)}))
        started = time.perf_counter()
        output = pyinfra(lab)
        release = active_release(lab)
        files = locked_files(lab, release["id"], realwheels.served_files(index))
        out["cold"] = {"deploy_s": round(time.perf_counter() - started, 1), "build_s": release["build_seconds"],
                       "bytes_sent": real_wheel_bytes(lab, served, files), "lock_bytes": sum(files.values()),
                       "lock_files": len(files), "steps_s": build_steps(output), **release_check(lab, release["id"])}
        out["cold"]["sent_over_lock"] = round(out["cold"]["bytes_sent"] / out["cold"]["lock_bytes"], 4)
        console.print(f"cold: {out['cold']}")
        index_url = lab.real_wheels_data(lab.hosts[0], served)["index_pypi_url"]
        rounds: list[dict] = []
        for number in range(options.repeat):
            before = real_wheel_bytes(lab, served, files)
            build_s, steps = rebuild_warm(lab, release["id"])
            row: dict = {"build_s": build_s, "steps_s": steps, **release_check(lab, release["id"]),
                         "plain_s": round(plain_install(lab, release["id"], index_url), 2)}
            row["bytes_sent"] = real_wheel_bytes(lab, served, files) - before
            console.print(f"warm round {number + 1}: {row}")
            rounds.append(row)
        build, plain = (statistics.median(row[key] for row in rounds) for key in ("build_s", "plain_s"))
        unchecked = statistics.median(row["build_s"] - row["check_s"] for row in rounds)
        out["warm"] = {"rounds": rounds, "build_median_s": build, "plain_median_s": plain,
                       "ratio": round(build / plain, 2), "build_without_check_median_s": round(unchecked, 2),
                       "ratio_without_check": round(unchecked / plain, 2)}
        console.print(f"warm: build {build:.1f} s, plain uv pip install {plain:.1f} s: {build / plain:.2f}x "
                      f"({unchecked / plain:.2f}x without the release check)")
    finally:
        lab.down()
    path = write_result(out, "real-release")
    console.print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
