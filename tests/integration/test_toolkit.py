"""The toolkit step on sandbox hosts (real SSH, systemd), through the real pyinfra CLI.

Two labs of dressed hosts (stand-in 8x SM120 GPUs, a CUDA 12.8 stand-in, /usr/local/cuda ->
cuda-12.8), one after the other, each host one scenario. TestFreshHostAndFaults:

  h1  fresh host: --dry changes nothing; converge installs 13.0.1; re-run: zero changes, no
      runfile read, a handful of commands (counted and timed)
  h2  corrupted download refused            h6  installer whose nvcc is broken
  h3  download cut midway resumes           h7  driver too old (refused before any change)
  h4  installer failing midway              h8  GPUs of the wrong architecture (refused)
  h5  installer re-pointing /usr/local/cuda h9  not enough disk (refused)
  h10 another run holds the lock (refused), then that run dies: its lock is found stale

TestSourcesAndPolicies:
  h1, h2 air-gapped (cuda_runfile_from = "controller"): one download, one upload
  h3  a package-style toolkit without version.json already at the install path
  h4, h5 logging in as a sudo user (not root): host download, and upload from the controller
  h6  cuda_link_policy = "new": /usr/local/cuda re-pointed at 13.0, reported, once
  h7  a half-installed tree left by a run that died mid-install: moved aside, installed again
  h8  a run that died after the installer re-pointed /usr/local/cuda: the next run restores it

TestRefusedEarlyAndInstallerQuirks (issue 16):
  h1, h2 a pre-staged runfile that is short / corrupt, under -y with deploy.py: refused by
         preflight, nothing on any host changed
  h3  a stale /tmp/cuda-installer.log owned by another user (the installer crashes on it)
  h4  an installer whose compiler check refuses the host's gcc: reported with the key, which passes

Every fault asserts that the 12.8 toolkit, /usr/local/cuda and any cached good runfile survive.
"""

from __future__ import annotations

import hashlib
import io
import queue
import re
import subprocess
import tarfile
import threading
import time

import pytest

from facts.host import take_lock_command
from sandbox.standins.nvidia_smi import Gpu
from sandbox.standins.toolkit import write_toolkit_tree
from toolkit_lab import CACHE, INSTALL, KEPT

pytestmark = pytest.mark.integration

DEPLOY = "tests/integration/deploys/toolkit.py"
FAULT_HOSTS = ["h2", "h3", "h4", "h5", "h6", "h7", "h8", "h9", "h10"]
REFUSED_AT_PREPARE = ["h7", "h8", "h9", "h10"]


@pytest.fixture(scope="module")
def tk(toolkit_lab):
    with toolkit_lab("tk", "toolkit", hosts=10) as lab:
        yield lab


def runfile_name(tk) -> str:
    return tk.runfiles["normal"].name


def survived(tk, name: str, before: dict) -> None:
    """The 12.8 toolkit and /usr/local/cuda are exactly as before."""
    host = tk.host(name)
    assert tk.tree(host) == before[name]["kept"], f"{name}: {KEPT} changed"
    assert tk.link(host) == "cuda-12.8", f"{name}: /usr/local/cuda moved"


class TestSourcesAndPolicies:
    """Runs before the fault lab is up (the class's lab is gone by then): at most 10 hosts at a time."""

    @pytest.fixture(scope="class")
    @classmethod
    def tk(cls, toolkit_lab):
        with toolkit_lab("tk", "sources", hosts=8) as lab:
            yield lab

    # --- h1, h2: air-gapped ----------------------------------------------------------------------

    def test_controller_downloads_once_and_uploads_only_where_missing(self, tk, tmp_path):
        h1, h2 = tk.host("h1"), tk.host("h2")
        for host in (h1, h2):
            tk.scenario(host, "airgap", cuda_runfile_from="controller")
        name = runfile_name(tk)
        seeded = tk.runfiles["normal"].read_bytes()
        subprocess.run(tk.lab.sandbox.ssh_argv(h2, f"mkdir -p {CACHE} && cat > {CACHE}/{name}"), input=seeded,
                       check=True, capture_output=True)
        inode = tk.sh(h2, f"stat -c %i:%Y {CACHE}/{name}")
        env = {"SERVESTACK_CACHE_DIR": str(tmp_path / "controller-cache")}
        run = tk.pyinfra(DEPLOY, limit=["h1", "h2"], env=env)
        assert run.returncode == 0, run.output[-6000:]
        gets = [r for r in tk.requests("airgap") if r["method"] == "GET"]
        assert len(gets) == 1                                              # one download, by the controller
        assert (tmp_path / "controller-cache" / name).read_bytes() == seeded
        assert tk.sh(h2, f"stat -c %i:%Y {CACHE}/{name}") == inode       # h2 kept its copy: no upload
        assert tk.sh(h1, f"ls {CACHE}").split() == [name]
        for host in (h1, h2):
            assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
        again = tk.pyinfra(DEPLOY, limit=["h1", "h2"], env=env)
        assert again.results["totals"]["success"] == 0
        assert len([r for r in tk.requests("airgap") if r["method"] == "GET"]) == 1

    # --- h3: a toolkit servestack cannot vouch for --------------------------------------------------

    def test_unconfirmable_toolkit_is_refused_then_accepted_on_request(self, tk, tmp_path):
        host = tk.host("h3")
        tree = write_toolkit_tree(tmp_path / "cuda-13.0", "13.0.2", "13.0.88")
        (tree / "version.json").unlink()                   # like NVIDIA's Ubuntu packages
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(tree, arcname="usr/local/cuda-13.0")
        subprocess.run(tk.lab.sandbox.ssh_argv(host, "tar -x -C /"), input=archive.getvalue(), check=True,
                       capture_output=True)
        before = tk.tree(host, INSTALL)
        tk.scenario(host, "package")
        refused = tk.pyinfra(DEPLOY, limit=["h3"])
        assert refused.returncode == 1
        assert ("[h3] refused: /usr/local/cuda-13.0 holds a toolkit whose nvcc reports V13.0.88 but with no "
                "version.json") in refused.output
        tk.scenario(host, "package", cuda_existing_toolkit="accept")
        accepted = tk.pyinfra(DEPLOY, limit=["h3"])
        assert accepted.returncode == 0, accepted.output[-4000:]
        again = tk.pyinfra(DEPLOY, limit=["h3"])
        assert again.results["totals"]["success"] == 0
        assert tk.tree(host, INSTALL) == before
        assert not [r for r in tk.requests("package") if r["method"] == "GET"]

    # --- h4, h5: a sudo user instead of root -----------------------------------------------------

    def test_sudo_user_converges_with_host_download_and_controller_upload(self, tk, tmp_path):
        sudo = {"ssh_user": "ubuntu", "_sudo": True}
        tk.scenario(tk.host("h4"), "sudo-host", **sudo)
        tk.scenario(tk.host("h5"), "sudo-controller", cuda_runfile_from="controller", **sudo)
        env = {"SERVESTACK_CACHE_DIR": str(tmp_path / "controller-cache")}
        run = tk.pyinfra(DEPLOY, limit=["h4", "h5"], env=env)
        assert run.returncode == 0, run.output[-6000:]
        for name in ("h4", "h5"):
            host = tk.host(name)
            assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
            assert tk.sh(host, f"stat -c %U {CACHE}/{runfile_name(tk)}").strip() == "root"
            assert tk.sh(host, f"ls -A {CACHE}").split() == [runfile_name(tk)]       # no staging dir left
            assert tk.link(host) == "cuda-12.8"
        again = tk.pyinfra(DEPLOY, limit=["h4", "h5"], env=env)
        assert again.results["totals"]["success"] == 0

    # --- h6: /usr/local/cuda -> 13.0 on request -----------------------------------------------------

    def test_link_policy_new_points_the_link_at_the_new_toolkit(self, tk):
        host = tk.host("h6")
        tk.scenario(host, "link-new", cuda_link_policy="new")
        dry = tk.pyinfra(DEPLOY, limit=["h6"], dry=True)
        assert (f"/usr/local/cuda -> {INSTALL} (was /usr/local/cuda -> cuda-12.8): an explicit change, "
                "cuda_link_policy = 'new'") in dry.output
        run = tk.pyinfra(DEPLOY, limit=["h6"])
        assert run.returncode == 0, run.output[-4000:]
        assert tk.link(host) == INSTALL
        assert tk.exists(host, KEPT)
        again = tk.pyinfra(DEPLOY, limit=["h6"])
        assert again.results["totals"]["success"] == 0


    # --- h7, h8: a run that died mid-install -------------------------------------------------------

    def test_half_installed_tree_of_a_dead_run_is_moved_aside(self, tk, tmp_path):
        host = tk.host("h7")
        tk.scenario(host, "interrupted")
        tk.sh(host, f"mkdir -p {INSTALL}/targets /var/lib/servestack && echo partial > {INSTALL}/targets/x && "
                    f"echo '{{\"path\": \"{INSTALL}\", \"run_id\": \"dead-run\"}}' "
                    "> /var/lib/servestack/toolkit-install.json")
        run = tk.pyinfra(DEPLOY, limit=["h7"])
        assert run.returncode == 0, run.output[-4000:]
        assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
        assert tk.sh(host, f"cat {INSTALL}.failed-*/targets/x").strip() == "partial"
        assert not tk.exists(host, "/var/lib/servestack/toolkit-install.json")

    def test_unfinished_checks_of_a_dead_run_are_finished(self, tk):
        host = tk.host("h8")
        tk.scenario(host, "unfinished")
        assert tk.pyinfra(DEPLOY, limit=["h8"]).returncode == 0
        # As if the installer had re-pointed the link and the control machine died before the checks:
        tk.sh(host, f"ln -sfn {INSTALL} /usr/local/cuda && echo '{{\"path\": \"{INSTALL}\", "
                    "\"run_id\": \"dead-run\"}' > /var/lib/servestack/toolkit-install.json")
        dry = tk.pyinfra(DEPLOY, limit=["h8"], dry=True)
        assert "finish the interrupted install's checks" in dry.output
        run = tk.pyinfra(DEPLOY, limit=["h8"])
        assert run.returncode == 0, run.output[-4000:]
        assert "restored /usr/local/cuda -> cuda-12.8" in run.output
        assert tk.link(host) == "cuda-12.8"
        assert not tk.exists(host, "/var/lib/servestack/toolkit-install.json")
        assert tk.pyinfra(DEPLOY, limit=["h8"]).results["totals"]["success"] == 0

class TestRefusedEarlyAndInstallerQuirks:
    """Issue 16: what preflight refuses before any change, and the real installer's quirks."""

    @pytest.fixture(scope="class")
    @classmethod
    def tk(cls, toolkit_lab):
        with toolkit_lab("tkq", "quirks", hosts=4) as lab:
            yield lab

    # --- h1, h2: a bad pre-staged runfile --------------------------------------------------------

    def test_a_bad_prestaged_runfile_is_refused_with_nothing_changed(self, tk):
        good = tk.runfiles["normal"].read_bytes()
        short = good[: len(good) // 2]
        corrupt = good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:]
        path = f"/srv/cuda/{runfile_name(tk)}"
        for name, data in (("h1", short), ("h2", corrupt)):
            tk.put_file(tk.host(name), path, data)
            tk.scenario(tk.host(name), f"prestaged-{name}", cuda_runfile_path=path)
        before = tk.lab.fingerprints()
        run = tk.pyinfra("deploy.py", limit=["h1", "h2"])
        assert run.returncode == 1, run.output[-6000:]
        assert tk.lab.fingerprints() == before, tk.lab.changes(before, tk.lab.snapshots())
        assert re.search(rf"\[h1\]\s+refused: cuda_runfile_path {re.escape(path)} fails verification \(size "
                         rf"{len(short)} bytes, expected {len(good)}\): not used", run.output), run.output[-6000:]
        assert re.search(rf"\[h2\]\s+refused: cuda_runfile_path {re.escape(path)} fails verification \(md5 "
                         rf"{hashlib.md5(corrupt).hexdigest()}, expected {hashlib.md5(good).hexdigest()}\): not used",
                         run.output), run.output[-6000:]
        for name in ("h1", "h2"):
            refusals = [line for line in run.host_lines(name) if "refused:" in line]
            assert len(refusals) == 1
            print(f"\n{refusals[0]}")

    # --- h3: a stale installer log of another user --------------------------------------------------

    def test_a_stale_installer_log_of_another_user_does_not_break_the_install(self, tk):
        host = tk.host("h3")
        tk.scenario(host, "stale-log")
        tk.server_call("add_fault", "/stale-log/*", "slow", after=25_000)   # a slow mirror: progress lines
        tk.sh(host, "echo '[INFO]: an earlier install, by another user' > /tmp/cuda-installer.log && "
                    "chown nobody /tmp/cuda-installer.log && chmod 600 /tmp/cuda-installer.log")
        tk.put_file(host, "/root/standin.run", tk.runfiles["normal"].read_bytes())   # as the real one: it crashes
        crashed = tk.lab.exec(host, "sh /root/standin.run --silent --toolkit --installpath=/opt/crashed")
        assert crashed.returncode == 139 and not tk.exists(host, "/opt/crashed"), crashed.stdout + crashed.stderr
        tk.sh(host, "rm /root/standin.run")
        run = tk.pyinfra(DEPLOY, limit=["h3"])
        assert run.returncode == 0, run.output[-6000:]
        assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
        progress = [line for line in run.host_lines("h3") if "servestack: downloaded" in line]
        assert progress and all(re.search(r"downloaded \S+ of \S+ \(\d+%\), \S+/s, ETA", line) for line in progress)
        print("", *progress, sep="\n")
        owner, stale = tk.sh(host, "stat -c '%U %n' /tmp/cuda-installer.log.stale-*").split()
        assert owner == "nobody" and "an earlier install" in tk.sh(host, f"cat {stale}")
        assert "STAND-IN CUDA 13.0.1 installer" in tk.sh(host, "cat /tmp/cuda-installer.log")
        assert tk.link(host) == "cuda-12.8"

    # --- h4: the installer's compiler check ----------------------------------------------------------

    def test_a_gcc_refusal_names_the_key_and_the_key_makes_it_pass(self, tk):
        host = tk.host("h4")
        kept = tk.tree(host)
        tk.set_gcc(host, "16.1.0")
        tk.scenario(host, "gcc")
        refused = tk.pyinfra(DEPLOY, limit=["h4"])
        assert refused.returncode == 1
        assert re.search(r"\[h4\]\s+servestack: CUDA 13\.0\.1 install refused by the installer's compiler check: "
                         r"\[ERROR\]: unsupported compiler version: 16\.1\.0\. Use --override to override this "
                         r"check\.", refused.output), refused.output[-6000:]
        assert re.search(r"\[h4\]\s+servestack: set cuda_installer_override = True in this host's data to pass "
                         r"--override", refused.output)
        assert not tk.exists(host, INSTALL)
        print("", *[line for line in refused.host_lines("h4") if "compiler check" in line or "override" in line],
              sep="\n")
        tk.scenario(host, "gcc", cuda_installer_override=True)
        passed = tk.pyinfra(DEPLOY, limit=["h4"])
        assert passed.returncode == 0, passed.output[-6000:]
        assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
        assert tk.tree(host) == kept and tk.link(host) == "cuda-12.8"
        assert tk.pyinfra(DEPLOY, limit=["h4"]).results["totals"]["success"] == 0


# --- h1: a fresh host --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fresh(tk):
    host = tk.host("h1")
    kept = tk.tree(host)
    before = tk.lab.fingerprint(host)
    dry = tk.pyinfra(DEPLOY, limit=["h1"], dry=True)
    after_dry = tk.lab.fingerprint(host)
    first = tk.pyinfra(DEPLOY, limit=["h1"])
    second = tk.pyinfra(DEPLOY, limit=["h1"], debug=True)
    third = tk.pyinfra(DEPLOY, limit=["h1"])
    dry_converged = tk.pyinfra(DEPLOY, limit=["h1"], dry=True)
    return {"host": host, "kept": kept, "before": before, "after_dry": after_dry, "dry": dry, "first": first,
            "second": second, "third": third, "dry_converged": dry_converged}


def test_dry_run_says_what_would_happen_and_changes_nothing(fresh):
    dry = fresh["dry"]
    assert dry.returncode == 0, dry.output[-4000:]
    lines = "\n".join(fresh["dry"].host_lines("h1"))
    assert re.search(r"download \d+\.\d kB from http://\S+/cuda_13\.0\.1_580\.82\.07_linux\.run", lines)
    assert "install 13.0.1 into /usr/local/cuda-13.0" in lines
    assert "/usr/local/cuda stays -> cuda-12.8" in lines
    assert "record fingerprints of /usr/local/cuda-12.8" in lines
    assert fresh["after_dry"] == fresh["before"]


def test_converge_installs_beside_the_kept_toolkit(tk, fresh):
    first, host = fresh["first"], fresh["host"]
    assert first.returncode == 0, first.output[-6000:]
    assert "CUDA toolkit | CUDA 13.0.1 at /usr/local/cuda-13.0" in first.changed("h1")
    assert "release 13.0, V13.0.88" in tk.sh(host, f"{INSTALL}/bin/nvcc --version")
    assert '"13.0.1"' in tk.sh(host, f"cat {INSTALL}/version.json")
    assert tk.tree(host) == fresh["kept"]
    assert tk.link(host) == "cuda-12.8"
    assert tk.exists(host, f"{CACHE}/{runfile_name(tk)}")
    assert not tk.exists(host, "/var/lib/servestack/lock")
    record = tk.sh(host, "cat /var/lib/servestack/toolkits.json")
    assert '"installed"' in record and '"/usr/local/cuda-12.8"' in record


def test_second_converge_changes_nothing_and_reads_no_runfile(tk, fresh):
    for run in (fresh["second"], fresh["third"]):
        assert run.returncode == 0, run.output[-4000:]
        assert run.results["totals"]["success"] == 0, run.results
    commands = fresh["second"].commands("h1")
    assert not [c for c in commands if "md5sum" in c or "sha256sum" in c or "curl " in c]
    assert len(commands) <= 8, commands
    print(f"\nconverged host h1: {len(commands)} remote commands, {fresh['third'].seconds:.2f} s wall "
          f"(pyinfra -y --json, one host, including start-up)")


def test_dry_run_of_a_converged_host(fresh):
    lines = "\n".join(fresh["dry_converged"].host_lines("h1"))
    assert "CUDA 13.0.1 is installed at /usr/local/cuda-13.0" in lines
    assert "the runfile is not needed" in lines
    assert "/usr/local/cuda stays -> cuda-12.8" in lines


def test_a_hand_removed_link_is_put_back_as_recorded(tk, fresh):
    """Issue 32 §5: with cuda_link_policy = "keep", a /usr/local/cuda removed by hand after the install
    was reported as "stays absent" while verify failed against toolkits.json's record, on every run.
    The dry run names the repair, the converge makes it, and the next converge changes nothing."""
    host = fresh["host"]
    tk.sh(host, "rm /usr/local/cuda")
    dry = tk.pyinfra(DEPLOY, limit=["h1"], dry=True)
    assert dry.returncode == 0, dry.output[-4000:]
    assert ("restore /usr/local/cuda -> cuda-12.8 as toolkits.json recorded it before the install (now "
            "/usr/local/cuda (absent); cuda_link_policy = 'keep')") in "\n".join(dry.host_lines("h1"))
    assert not tk.exists(host, "/usr/local/cuda")
    repair, again = tk.pyinfra(DEPLOY, limit=["h1"]), tk.pyinfra(DEPLOY, limit=["h1"])
    assert repair.returncode == 0, repair.output[-4000:]
    assert tk.link(host) == "cuda-12.8"
    assert again.returncode == 0 and again.results["totals"]["success"] == 0, again.results


# --- h2..h10: faults, in one run -------------------------------------------------------------

def wait_for_line(process: subprocess.Popen, wanted: str, timeout: float = 120) -> None:
    """Until `process` prints the line `wanted` (`timeout`: a safety net); what it printed if it never does."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)   # the end of its output

    threading.Thread(target=read, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.strip() == wanted:
            return
    raise AssertionError(f"no line {wanted!r} from {process.args[-1][:80]!r}; it printed {seen!r}")


@pytest.fixture(scope="module")
def faults(tk):
    h = tk.host
    tk.scenario(h("h2"), "corrupt")
    tk.server_call("add_fault", "/corrupt/*", "corrupt", length=64)
    tk.scenario(h("h3"), "cut")
    tk.server_call("add_fault", "/cut/*", "cut", after=100_000, times=1)
    tk.scenario(h("h4"), "fail", "fail_midway")
    tk.scenario(h("h5"), "repoint", "repoint")
    tk.scenario(h("h6"), "broken", "broken_nvcc")
    tk.scenario(h("h7"), "oldriver")
    tk.set_gpu(h("h7"), Gpu(driver_version="570.124.06"))
    tk.scenario(h("h8"), "wrongarch")
    tk.set_gpu(h("h8"), Gpu(name="NVIDIA H200", compute_cap="9.0"))
    tk.scenario(h("h9"), "nodisk", manifest="no_disk")
    tk.scenario(h("h10"), "locked")
    holder = subprocess.Popen(tk.direct_ssh_argv(h("h10"), "(" + take_lock_command(
        "/var/lib/servestack", "other-run", "laptop:4242", "20261130T000000Z") + ")\nsleep 600"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(holder, "taken")   # lock.sh take's last line: the other run holds h10's lock
    before = {name: {"kept": tk.tree(h(name)), "fingerprint": tk.lab.fingerprint(h(name))} for name in FAULT_HOSTS}
    run = tk.pyinfra(DEPLOY, limit=FAULT_HOSTS)
    yield {"run": run, "before": before, "holder": holder}
    if holder.poll() is None:
        holder.kill()


def test_each_host_stands_alone(faults):
    run = faults["run"]
    assert run.returncode == 1                       # some hosts failed ...
    assert set(run.results["failed_hosts"]) == {"h2", "h4", "h6", *REFUSED_AT_PREPARE}
    for name in ("h3", "h5"):                        # ... the others converged
        assert "CUDA toolkit | CUDA 13.0.1 at /usr/local/cuda-13.0" in run.changed(name), run.output[-6000:]


@pytest.mark.parametrize("name", FAULT_HOSTS)
def test_kept_toolkit_and_link_survive(tk, faults, name):
    survived(tk, name, faults["before"])


@pytest.mark.parametrize("name", FAULT_HOSTS)
def test_no_lock_left_behind_by_this_run(tk, faults, name):
    lock = tk.sh(tk.host(name), "cat /var/lib/servestack/lock 2>/dev/null || true")
    assert lock == "" or '"other-run"' in lock


@pytest.mark.parametrize("name", REFUSED_AT_PREPARE)
def test_refused_hosts_are_untouched(tk, faults, name):
    assert tk.lab.fingerprint(tk.host(name)) == faults["before"][name]["fingerprint"]


def test_corrupted_download_is_refused(tk, faults):
    host, run = tk.host("h2"), faults["run"]
    assert any("fails verification (md5" in line and "never used" in line for line in run.output.splitlines())
    assert not tk.exists(host, INSTALL)
    listing = tk.sh(host, f"ls {CACHE}").split()
    assert listing == [f"{runfile_name(tk)}.part.rejected-{listing[0].rsplit('-', 1)[1]}"]


def test_cut_download_resumes(tk, faults):
    assert re.search(r"\[h3\]\s+servestack: resuming the download at \S+ of \S+", faults["run"].output)
    requests = [r for r in tk.requests("cut") if r["method"] == "GET"]
    assert [r["range"] for r in requests] == [None, "bytes=100000-"]
    assert sum(r["bytes_sent"] for r in requests) == tk.runfiles["normal"].stat().st_size
    assert "release 13.0, V13.0.88" in tk.sh(tk.host("h3"), f"{INSTALL}/bin/nvcc --version")


def test_failing_installer_leaves_nothing_half_installed(tk, faults):
    host, output = tk.host("h4"), faults["run"].output
    assert "[ERROR]: Install of CUDA Toolkit 13.0 failed, quitting" in output      # the log's tail
    assert re.search(r"the partial tree was moved aside to /usr/local/cuda-13\.0\.failed-\d{8}T\d{6}Z", output)
    assert not tk.exists(host, INSTALL)
    assert tk.sh(host, "ls -d /usr/local/cuda-13.0.failed-*").strip()
    assert tk.exists(host, f"{CACHE}/{runfile_name(tk)}")                          # the good file survives
    assert not tk.exists(host, "/var/lib/servestack/toolkit-install.json")


def test_repointing_installer_is_undone(tk, faults):
    output = faults["run"].output
    assert re.search(r"\[h5\]\s+the installer changed the link to /usr/local/cuda -> /usr/local/cuda-13\.0: "
                     r"restored /usr/local/cuda -> cuda-12\.8", output)
    assert tk.link(tk.host("h5")) == "cuda-12.8"


def test_broken_nvcc_counts_as_a_failed_install(tk, faults):
    host, output = tk.host("h6"), faults["run"].output
    assert "installer exit 0, but /usr/local/cuda-13.0/bin/nvcc does not run" in output
    assert not tk.exists(host, INSTALL)
    assert tk.exists(host, f"{CACHE}/{runfile_name(tk)}")


def test_refusals_name_the_host_and_the_problem(faults):
    output = faults["run"].output
    assert re.search(r"\[h7\]\s+refused: NVIDIA driver 570\.124\.06 is older than 580\.82\.07", output)
    assert re.search(r"\[h8\]\s+refused: 8 of 8 GPUs are not compute capability 12\.0 \(gpu_compute_capability\): "
                     r"GPU 0 \(NVIDIA H200, [0-9A-F:.]+\) is 9\.0", output)
    assert re.search(r"\[h9\]\s+refused: not enough disk on \S+: [\d.]+ GB free, .* needed \(.*extraction", output)
    assert re.search(r"\[h10\]\s+refused: another servestack run holds /var/lib/servestack/lock: run other-run "
                     r"from laptop:4242", output)


def test_the_next_run_converges_after_failures(tk, faults):
    faults["holder"].kill()                                                         # the other run dies
    faults["holder"].wait()
    tk.scenario(tk.host("h4"), "fail-fixed")                                        # a good runfile now
    tk.scenario(tk.host("h6"), "broken-fixed")
    tk.server_call("reset")
    run = tk.pyinfra(DEPLOY, limit=["h2", "h4", "h6", "h10"])
    assert run.returncode == 0, run.output[-6000:]
    for name in ("h2", "h4", "h6", "h10"):
        assert "release 13.0, V13.0.88" in tk.sh(tk.host(name), f"{INSTALL}/bin/nvcc --version")
        survived(tk, name, faults["before"])
    assert re.search(r"\[h10\]\s+lock /var/lib/servestack/lock held by run \S+ \(replaced a stale lock: run other-run "
                     r"from laptop:4242, started 20261130T000000Z\)", run.output), run.output[-6000:]
    # h4's cached runfile was the failing build: it no longer verifies, so it was moved aside, never used.
    assert tk.sh(tk.host("h4"), f"ls {CACHE} | grep -c rejected").strip() == "1"
