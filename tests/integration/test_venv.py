"""The ML environment on sandbox hosts: adopt a hand-made +cu128 env, end +cu130, idempotent, dry, safe.

Each host starts like the reference fleet: a hand-made uv venv at /opt/ml-env with torch,
torchvision and torchaudio `+cu128` stand-ins. Hosts reach only the sandbox's artifact server.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from venv_lab import RELEASES, ROLLBACK, STACK, UPGRADE, VENV, start_lab

pytestmark = pytest.mark.integration
STATE = "/var/lib/servestack"
TIMINGS = {}


@pytest.fixture(scope="module")
def lab(sandbox):
    with start_lab(sandbox) as lab:
        yield lab


REPORT = ("import importlib.metadata as m, json, sys, torch\n"
          "def version(name):\n"
          "    try: return m.version(name)\n"
          "    except m.PackageNotFoundError: return None\n"
          "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
          "                  'flashinfer': version('flashinfer-python'), 'prefix': sys.prefix}))\n")


def python_report(lab, host, python=f"{VENV}/bin/python"):
    return json.loads(lab.sh(host, f"{python} - <<'EOF'\n{REPORT}EOF"))


def test_dry_run_changes_nothing_and_shows_the_package_diff(lab):
    host = lab.sandbox.hosts[0]
    before = lab.sh(host, f"ls -la {VENV}/ /opt; ls -R /var/lib/servestack 2>/dev/null; true")
    result = lab.dry(UPGRADE, "--diff")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    torch = STACK.package("torch").version
    assert f"~ torch 2.9.1+cu128 -> {torch}" in output, output[-3000:]
    assert f"+ sglang=={STACK.package('sglang').version}" in output
    assert lab.sh(host, f"ls -la {VENV}/ /opt; ls -R /var/lib/servestack 2>/dev/null; true") == before


def test_adopting_a_cu128_env_ends_cu130(lab):
    host = lab.sandbox.hosts[0]
    assert python_report(lab, host)["torch"].endswith("+cu128")
    started = time.monotonic()
    result, report = lab.pyinfra(UPGRADE)
    TIMINGS["cold"] = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    after = python_report(lab, host)
    assert after == {"torch": STACK.package("torch").version, "cuda": "13.0",
                     "flashinfer": STACK.package("flashinfer-python").version, "prefix": VENV}
    link = lab.sh(host, f"readlink {VENV}").strip()
    assert link.startswith(f"{RELEASES}/r-") and link.endswith("/venv")
    adopted = lab.sh(host, f"ls -d {RELEASES}/adopted-*").split()
    assert len(adopted) == 1
    record = json.loads(lab.sh(host, f"cat {adopted[0]}/release.json"))
    assert record["adopted"] is True and record["packages"]["torch"].endswith("+cu128")
    TIMINGS["cold_build"] = json.loads(lab.sh(host, f"cat {link.rsplit('/', 1)[0]}/release.json"))["build_seconds"]
    backups = lab.sh(host, f"ls {STATE}/backups").split()
    assert len(backups) == 1
    snapshot = json.loads(lab.sh(host, f"cat {STATE}/backups/{backups[0]}"))
    assert snapshot["packages"]["torch"].endswith("+cu128") and snapshot["venv_path"] == VENV


def test_second_run_changes_nothing(lab):
    result, report = lab.pyinfra(UPGRADE)
    assert result.returncode == 0, result.stderr[-3000:]
    totals = report["results"]["totals"] if "results" in report else report
    assert totals["success"] == 0 and totals["error"] == 0, totals


def test_backups_are_listed(lab):
    inventory = lab.write_inventory()
    result = lab.run_controller([sys.executable, "-c", "import sys; from servestack.backups import backups_main; "
                                 f"sys.exit(backups_main({str(inventory)!r}))"])
    assert result.returncode == 0, result.stderr[-2000:]
    host = lab.sandbox.hosts[0]
    assert f"{host.name}: 1 backup(s)" in result.stdout
    assert "torch 2.9.1+cu128" in result.stdout and f"{VENV} -> " in result.stdout


def test_a_broken_wheel_leaves_the_old_release_active(lab):
    host = lab.sandbox.hosts[0]
    active = lab.sh(host, f"readlink {VENV}").strip()
    broken = lab.artifacts.url(lab.artifacts.broken_indexes["corrupt_zip"], lab.base_url(host))
    result, _ = lab.pyinfra(UPGRADE, extra_data={"index_torch_url": broken})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "servestack: release r-" in output and "was not built and is not active" in output, output[-3000:]
    assert lab.sh(host, f"readlink {VENV}").strip() == active
    failed = [json.loads(lab.sh(host, f"cat {path}")) for path in
              lab.sh(host, f"grep -l '\"failed\"' {RELEASES}/*/release.json").split()]
    assert len(failed) == 1 and failed[0]["status"] == "failed" and "torch-" in failed[0]["error"]
    assert python_report(lab, host)["cuda"] == "13.0"
    result, report = lab.pyinfra(UPGRADE)  # back on the good inputs: nothing to do
    assert result.returncode == 0 and report["results"]["totals"]["success"] == 0, result.stderr[-2000:]


def test_warm_rebuild_reuses_the_uv_cache(lab):
    host = lab.sandbox.hosts[0]
    release = lab.sh(host, f"readlink {VENV}").strip().rsplit("/", 1)[0]
    result, _ = lab.pyinfra(ROLLBACK)
    assert result.returncode == 0, result.stderr[-2000:]
    lab.sh(host, f"rm -rf {release}")
    lab.reset()
    started = time.monotonic()
    result, _ = lab.pyinfra(UPGRADE)
    TIMINGS["warm"] = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels = [path for path in lab.counts() if path.endswith(".whl")]
    assert wheels == [], f"re-downloaded on a warm rebuild: {wheels}"
    torch_init = lab.sh(host, f"ls {release}/venv/lib/python3*/site-packages/torch/__init__.py").strip()
    assert int(lab.sh(host, f"stat -c %h {torch_init}")) > 1  # a hard link into uv's cache
    warm_build = json.loads(lab.sh(host, f"cat {release}/release.json"))["build_seconds"]
    print(f"\nrebuild times, 1 sandbox host: pyinfra run cold {TIMINGS.get('cold', 0):.1f} s "
          f"(build {TIMINGS.get('cold_build', 0):.1f} s, incl. installing uv), warm {TIMINGS['warm']:.1f} s "
          f"(build {warm_build:.1f} s)")


def test_old_releases_and_backups_are_pruned(lab):
    host = lab.sandbox.hosts[0]
    for number in range(3):  # three more releases: inputs differ by a (mirror) URL of the same files
        wheel = lab.host_data(host)["wheel_url_sgl_kernel"] + f"?copy={number}"
        result, _ = lab.pyinfra(UPGRADE, extra_data={"wheel_url_sgl_kernel": wheel, "venv_keep_releases": 2,
                                                     "venv_keep_backups": 2})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    releases = lab.sh(host, f"ls {RELEASES}").split()
    built = [name for name in releases if name.startswith("r-")]
    assert len(built) == 2, releases  # the active one and the one before it
    assert len([name for name in releases if name.startswith("adopted-")]) == 1  # never deleted
    assert len(lab.sh(host, f"ls {STATE}/backups").split()) == 2
