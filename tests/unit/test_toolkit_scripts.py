"""The toolkit step's host-side scripts (files/scripts/cuda-runfile.sh, cuda-toolkit.sh,
upload-staging.sh), rendered by operations/toolkit.py and servestack/download.py and run here with
`sh -c` as pyinfra runs them, against a temporary directory only: a fake runfile stands in for
NVIDIA's installer, curl reads file:// URLs."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from facts.toolkit import LinkChain
from operations import toolkit as toolkit_step
from operations.toolkit import (
    LOG_TAIL_LINES,
    download_command,
    install_command,
    move_aside_command,
    point_link_command,
    reject_command,
    restore_link_command,
    verify_command,
    write_json_command,
)
from sandbox.standins.runfile import build_runfile
from servestack.manifest import DEFAULT_MANIFEST, Runfile
from servestack.paths import RunfileSource
from servestack.scripts import SCRIPTS, script_command
from servestack.settings import settings_from_data
from tests.unit.flock_holder import flock_held

STAMP = r"\d{8}T\d{6}Z"
TOOLKIT_SCRIPTS = ("cuda-runfile.sh", "cuda-toolkit.sh", "upload-staging.sh")


def installer_tmp_log(root: Path) -> Path:
    """Where these tests' installer writes what the real one writes to /tmp/cuda-installer.log."""
    return root / "slash-tmp" / "cuda-installer.log"


@pytest.fixture(autouse=True)
def installer_tmp_log_in_tmp_path(tmp_path, monkeypatch):
    """The install script never touches this machine's /tmp/cuda-installer.log here."""
    monkeypatch.setattr(toolkit_step, "INSTALLER_TMP_LOG", str(installer_tmp_log(tmp_path)))


def sh(command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60, **kwargs)


def runfile_of(data: bytes, url: str = "http://mirror/x.run") -> Runfile:
    return Runfile("x.run", url, len(data), hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("name", TOOLKIT_SCRIPTS)
def test_each_script_is_valid_bash_and_states_its_contract_first(name):
    text = (SCRIPTS / name).read_text()
    assert text.startswith(f"# {name} "), "the first line names the script and its arguments"
    assert subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True).returncode == 0


@pytest.mark.parametrize("name", TOOLKIT_SCRIPTS)
def test_an_unknown_subcommand_is_an_error(name):
    result = sh(script_command(name, "frobnicate", "x", "y"))
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr


# --- cuda-runfile.sh verify / reject ------------------------------------------------------------


def test_verify_accepts_the_right_bytes_and_moves_aside_the_wrong(tmp_path):
    data = b"runfile bytes"
    runfile = runfile_of(data)
    path = tmp_path / "x.run"
    path.write_bytes(data)
    assert sh(verify_command(runfile, str(path), ours=True)).returncode == 0
    assert path.exists()
    path.write_bytes(b"runfile bytez")
    result = sh(verify_command(runfile, str(path), ours=True))
    assert result.returncode == 1 and "md5" in result.stderr and "never used" in result.stderr
    rejected = [p.name for p in tmp_path.iterdir()]
    assert not path.exists() and len(rejected) == 1 and re.fullmatch(rf"x\.run\.rejected-{STAMP}", rejected[0])
    assert f"moved aside to {path}.rejected-" in result.stderr


def test_verify_names_the_first_difference(tmp_path):
    data = b"runfile bytes"
    path = tmp_path / "x.run"
    path.write_bytes(data + b"!")
    result = sh(verify_command(runfile_of(data), str(path), ours=True))
    assert f"(size {len(data) + 1} bytes, expected {len(data)})" in result.stderr
    path.write_bytes(data)
    other_sha = Runfile("x.run", "http://m/x.run", len(data), hashlib.md5(data).hexdigest(), "b" * 64)
    result = sh(verify_command(other_sha, str(path), ours=True))
    assert f"(sha256 {hashlib.sha256(data).hexdigest()}, expected {'b' * 64})" in result.stderr


def test_verify_never_moves_a_prestaged_file(tmp_path):
    runfile = Runfile("x.run", "http://m/x.run", 3, "a" * 32, "b" * 64)
    path = tmp_path / "x.run"
    path.write_bytes(b"abc")
    result = sh(verify_command(runfile, str(path), ours=False))
    assert result.returncode == 1 and "pre-staged runfile" in result.stderr and "not used" in result.stderr
    assert path.exists() and [p.name for p in tmp_path.iterdir()] == ["x.run"]


def test_verify_renames_a_verified_download_to_the_cached_name(tmp_path):
    data = b"runfile bytes"
    part, cached = tmp_path / "x.run.part", tmp_path / "x.run"
    part.write_bytes(data)
    assert sh(verify_command(runfile_of(data), str(part), ours=True, dest=str(cached))).returncode == 0
    assert cached.read_bytes() == data and not part.exists()


def test_verify_of_a_missing_file_fails(tmp_path):
    result = sh(verify_command(runfile_of(b"x"), str(tmp_path / "x.run"), ours=True))
    assert result.returncode == 1 and f"runfile {tmp_path}/x.run is missing" in result.stderr


def test_verify_handles_names_that_md5sum_escapes(tmp_path):
    data = b"runfile bytes"
    path = tmp_path / "back\\slash x.run"
    path.write_bytes(data)
    assert sh(verify_command(runfile_of(data), str(path), ours=True)).returncode == 0


def test_reject_keeps_only_the_newest_rejected_copy(tmp_path):
    path = tmp_path / "x.run"
    (tmp_path / "x.run.rejected-20250101T000000Z").write_text("older")
    path.write_text("bad")
    result = sh(reject_command(str(path), "size 3 bytes, expected 9"))
    assert result.returncode == 0
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and re.fullmatch(rf"x\.run\.rejected-{STAMP}", names[0])
    assert (tmp_path / names[0]).read_text() == "bad"
    assert re.search(rf"servestack: {path} failed verification \(size 3 bytes, expected 9\): moved aside to "
                     rf"{path}\.rejected-{STAMP}, never used", result.stderr)


def test_reject_keeps_one_rejected_copy_of_the_runfile_whatever_its_name(tmp_path):
    cached, part = tmp_path / "x.run", tmp_path / "x.run.part"
    older = [tmp_path / "x.run.rejected-20250101T000000Z", tmp_path / "x.run.part.rejected-20250102T000000Z"]
    for path in older:
        path.write_text("older")
    part.write_text("bad")
    (tmp_path / "x.run.other").write_text("not a rejected copy")
    result = sh(reject_command(str(part), "md5 a, expected b"))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0] == "x.run.other" and re.fullmatch(rf"x\.run\.part\.rejected-{STAMP}", names[1])
    for path in older:
        assert (f"servestack: removed the older rejected copy {path} (only the newest rejected runfile is kept)"
                in result.stderr)
    cached.write_text("bad too")                              # the cached file fails in its turn
    again = sh(verify_command(runfile_of(b"good"), str(cached), ours=True))
    assert again.returncode == 1
    assert f"removed the older rejected copy {tmp_path / names[1]}" in again.stderr
    rejected = [p.name for p in tmp_path.glob("*.rejected-*")]
    assert len(rejected) == 1 and re.fullmatch(rf"x\.run\.rejected-{STAMP}", rejected[0])


# --- cuda-runfile.sh download ---------------------------------------------------------------------

DATA = hashlib.sha256(b"seed").digest() * 4096      # 128 KiB


def served_file(tmp_path: Path) -> Runfile:
    source = tmp_path / "served" / "x.run"
    source.parent.mkdir()
    source.write_bytes(DATA)
    return runfile_of(DATA, f"file://{source}")


def source_in(tmp_path: Path, runfile: Runfile) -> RunfileSource:
    cache = tmp_path / "cache"
    return RunfileSource(runfile, "host", str(cache / "x.run"), str(cache / "x.run.part"))


@pytest.mark.skipif(not shutil.which("curl"), reason="no curl on this machine")
def test_download_fetches_into_the_partial_file_creating_its_directory(tmp_path):
    source = source_in(tmp_path, served_file(tmp_path))
    result = sh(download_command(source))
    assert result.returncode == 0, result.stderr
    assert Path(source.part).read_bytes() == DATA and not Path(source.cached).exists()


@pytest.mark.skipif(not shutil.which("curl"), reason="no curl on this machine")
def test_download_resumes_what_is_there(tmp_path):
    source = source_in(tmp_path, served_file(tmp_path))
    Path(source.part).parent.mkdir()
    Path(source.part).write_bytes(DATA[:50_000])
    assert sh(download_command(source)).returncode == 0
    assert Path(source.part).read_bytes() == DATA


@pytest.mark.skipif(not shutil.which("curl"), reason="no curl on this machine")
def test_download_that_cannot_be_had_says_so_and_keeps_the_partial_file(tmp_path):
    runfile = runfile_of(DATA, f"file://{tmp_path}/nowhere/x.run")
    source = source_in(tmp_path, runfile)
    Path(source.part).parent.mkdir()
    Path(source.part).write_bytes(DATA[:1000])
    result = sh(download_command(source, attempts=1))
    assert result.returncode == 1
    assert re.search(r"download of file://\S+ failed \(curl exit \d+\) after 1 attempts; 1000 bytes kept in "
                     r"\S+x\.run\.part, resumed by the next run", result.stderr)
    assert Path(source.part).stat().st_size == 1000


@pytest.mark.skipif(not shutil.which("flock"), reason="no flock on this machine")
def test_download_waits_for_nobody_while_another_holds_the_busy_lock(tmp_path):
    source = source_in(tmp_path, served_file(tmp_path))
    busy = tmp_path / "lock.busy"
    with flock_held(busy):
        result = sh(download_command(source, busy=str(busy)))
    assert result.returncode == 1
    assert "another download or install is still running on this host" in result.stderr
    assert not Path(source.part).exists()


# --- cuda-toolkit.sh restore-link / point-link / move-aside ------------------------------------------


def test_restore_link_puts_back_only_changed_hops(tmp_path):
    link, alt = tmp_path / "cuda", tmp_path / "alternatives-cuda"
    (tmp_path / "cuda-12.8").mkdir()
    (tmp_path / "cuda-13.0").mkdir()
    alt.symlink_to(tmp_path / "cuda-12.8")
    link.symlink_to(alt)
    chain = LinkChain(str(link), ((str(link), str(alt)), (str(alt), str(tmp_path / "cuda-12.8"))), None, "link")
    assert sh(restore_link_command(chain)).stderr == ""
    link.unlink()
    link.symlink_to(tmp_path / "cuda-13.0")           # what a re-pointing installer does
    result = sh(restore_link_command(chain))
    assert result.returncode == 0
    assert result.stderr == (f"servestack: {link} was re-pointed to '{tmp_path}/cuda-13.0' (by the installer?): "
                             f"restored -> {alt}\n")
    assert Path.readlink(link) == alt and Path.readlink(alt) == tmp_path / "cuda-12.8"
    assert not (tmp_path / "cuda.servestack-new").exists()


def test_restore_link_removes_a_link_that_did_not_exist(tmp_path):
    link = tmp_path / "cuda"
    link.symlink_to("cuda-13.0")
    result = sh(restore_link_command(LinkChain(str(link))))
    assert not link.is_symlink()
    assert "the installer created" in result.stderr and "removed (it did not exist before)" in result.stderr


def test_restore_link_leaves_a_directory_where_a_link_was(tmp_path):
    link = tmp_path / "cuda"
    link.mkdir()
    result = sh(restore_link_command(LinkChain(str(link), ((str(link), "cuda-12.8"),), None, "link")))
    assert result.returncode == 1 and "is no longer a symlink: cannot restore -> cuda-12.8" in result.stderr
    assert link.is_dir() and not link.is_symlink()


def test_point_link_replaces_the_link(tmp_path):
    link = tmp_path / "cuda"
    link.symlink_to("cuda-12.8")
    assert sh(point_link_command(str(link), "/usr/local/cuda-13.0")).returncode == 0
    assert os.readlink(link) == "/usr/local/cuda-13.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda"]


def test_move_aside_moves_the_tree_and_forgets_its_marker(tmp_path):
    tree, state = tmp_path / "cuda-13.0", tmp_path / "state"
    (tree / "targets").mkdir(parents=True)
    (tree / "targets" / "x").write_text("partial")
    state.mkdir()
    (state / "toolkit-install.json").write_text("{}")
    result = sh(move_aside_command(str(tree), str(state)))
    assert result.returncode == 0, result.stderr
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("cuda-13.0.failed-")]
    assert len(moved) == 1 and (moved[0] / "targets" / "x").read_text() == "partial"
    assert not tree.exists() and not (state / "toolkit-install.json").exists()
    assert f"moved the interrupted install aside to {moved[0]}" in result.stderr


# --- cuda-toolkit.sh install ---------------------------------------------------------------------

NVCC_13 = "Cuda compilation tools, release 13.0, V13.0.88"


GCC_REFUSAL = "[ERROR]: unsupported compiler version: 16.1.0. Use --override to override this check."


def fake_runfile(lab: Path, mode: str) -> bytes:
    """A runfile standing in for NVIDIA's (run as `sh FILE FLAGS...`): records how it was run (its
    arguments, TMPDIR, DISPLAY, LANG and LC_ALL), crashes on any earlier
    /tmp/cuda-installer.log (here installer_tmp_log(lab); the real one: on one it cannot replace), then
    installs (normal), fails midway re-pointing the link (fail), leaves an nvcc that cannot run (broken)
    or one of another version (other), writes its log to the tmp log and installs (tmplog), or fails the
    real installer's compiler check there, with its wording, unless given --override (gcc)."""
    nvcc = {"broken": "exit 126", "other": "echo 'Cuda compilation tools, release 12.8, V12.8.93'"}.get(
        mode, f"echo '{NVCC_13}'")
    failing = (f"ln -sfn \"$p\" {lab}/cuda; echo '[ERROR]: Install of CUDA Toolkit 13.0 failed, quitting' >> "
               f"{lab}/installer.log; echo 'extraction failed' >&2; exit 1")
    tmplog = installer_tmp_log(lab)
    compiler_check = (f"""case " $* " in *" --override "*) ;; *)
    printf '%s\\n' '[INFO]: Checking compiler version...' '[INFO]: gcc location: /usr/bin/gcc' '' \\
        '[INFO]: gcc version: gcc version 16.1.0 (GCC) ' '' '{GCC_REFUSAL}' >> {tmplog}
    echo ' Failed to verify gcc version. See log at /var/log/cuda-installer.log for details.'; exit 1 ;;
esac
""" if mode == "gcc" else "")
    own_log = f"echo '[INFO]: the log of this run' >> {tmplog}\n" if mode in ("gcc", "tmplog") else ""
    return f"""printf '%s\\n' "$@" > {lab}/args
printf '%s\\n' "$TMPDIR" > {lab}/tmpdir
printf '%s\\n' "${{DISPLAY-unset}}" "${{LANG-unset}}" "${{LC_ALL-unset}}" > {lab}/locale
cat {lab}/state/toolkit-install.json > {lab}/marker-while-running
if flock -n {lab}/state/lock.busy true; then echo free; else echo held; fi > {lab}/busy-while-running
if [ -e {tmplog} ]; then echo 'Segmentation fault (core dumped)' >&2; exit 139; fi
mkdir -p {tmplog.parent}
{own_log}{compiler_check}for a in "$@"; do case $a in --installpath=*) p=${{a#--installpath=}} ;; esac; done
mkdir -p "$p/bin"
cat > "$p/bin/nvcc" <<'NVCC'
#!/bin/sh
{nvcc}
NVCC
chmod 755 "$p/bin/nvcc"
echo '{{"cuda": {{"version": "13.0.1"}}, "cuda_nvcc": {{"version": "13.0.88"}}}}' > "$p/version.json"
for i in $(seq 1 30); do echo "[INFO]: log line $i" >> {lab}/installer.log; done
echo "installer says hello"
{failing if mode == "fail" else "exit 0"}
""".encode()


def lab_manifest(root: Path, runfile: bytes | None = None) -> Path:
    """The project's manifest with /usr/local/cuda and the installer log in `root` (and, given a
    runfile, that runfile's size and checksums for this machine's architecture)."""
    text = DEFAULT_MANIFEST.read_text()
    text = text.replace('log_path = "/var/log/cuda-installer.log"', f'log_path = "{root}/installer.log"')
    text = text.replace('link_path = "/usr/local/cuda"', f'link_path = "{root}/cuda"')
    if runfile is not None:
        start = text.index(f"[cuda.runfile.{os.uname().machine}]")
        end = text.index("\n[", start + 1)
        info = runfile_of(runfile)
        body = re.sub(r"size = \d+", f"size = {info.size}", text[start:end])
        body = re.sub(r'md5 = "[0-9a-f]+"', f'md5 = "{info.md5}"', body)
        body = re.sub(r'sha256 = "[0-9a-f]+"', f'sha256 = "{info.sha256}"', body)
        text = text[:start] + body + text[end:]
    path = root / "stack.toml"
    path.write_text(text)
    return path


def lab_data(root: Path, manifest: Path) -> dict:
    """Host data placing every toolkit path of the step in `root`."""
    return {"servestack_manifest": str(manifest), "cuda_install_path": str(root / "cuda-13.0"),
            "cuda_tmpdir": str(root / "tmp"), "cuda_cache_dir": str(root / "cache"),
            "servestack_state_dir": str(root / "state")}


@pytest.fixture
def lab(tmp_path):
    """Settings whose every toolkit path is in tmp_path, with its cuda -> cuda-12.8."""
    settings = settings_from_data("h1", lab_data(tmp_path, lab_manifest(tmp_path)))
    (tmp_path / "cuda-12.8").mkdir()
    (tmp_path / "cuda").symlink_to("cuda-12.8")
    chain = LinkChain(str(tmp_path / "cuda"), ((str(tmp_path / "cuda"), "cuda-12.8"),), None, "link")
    return tmp_path, settings, chain


def staged(lab, mode: str, prestaged: bool = False) -> RunfileSource:
    """The fake runfile downloaded completely into <cache>/x.run.part (or pre-staged at /srv/x.run)."""
    root, _, _ = lab
    data = fake_runfile(root, mode)
    if prestaged:
        path = root / "srv" / "x.run"
        source = RunfileSource(runfile_of(data), "prestaged", str(path), None)
    else:
        path = root / "cache" / "x.run.part"
        source = RunfileSource(runfile_of(data), "host", str(root / "cache" / "x.run"), str(path))
    path.parent.mkdir()
    path.write_bytes(data)
    return source


def install(lab, source: RunfileSource, use: str | None = None, keep: bool = True, settings=None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """The install as the deploy runs it: under busy.sh (hostrun.while_busy), which holds lock.busy."""
    root, lab_settings, chain = lab
    settings = settings or lab_settings
    command = install_command(settings, source, use or source.part or source.cached, chain if keep else None, "run-1")
    return sh(script_command("busy.sh", settings.servestack_state_dir, "run-1", "cuda 13.0.1 install",
                             "bash", "-c", command), **({"env": {**os.environ, **env}} if env else {}))


@pytest.mark.skipif(not shutil.which("flock"), reason="no flock on this machine")
def test_install_runs_the_verified_runfile_toolkit_only_under_the_busy_lock(lab):
    root, settings, _ = lab
    source = staged(lab, "normal")
    result = install(lab, source)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"installed CUDA 13.0.1 into {root}/cuda-13.0\n"
    assert (root / "args").read_text().split() == [*settings.manifest.cuda["installer_flags"],
                                                   f"--installpath={root}/cuda-13.0", f"--tmpdir={root}/tmp"]
    assert (root / "tmpdir").read_text().strip() == f"{root}/tmp"
    assert (root / "busy-while-running").read_text().strip() == "held"
    marker = json.loads((root / "marker-while-running").read_text())
    assert marker["path"] == f"{root}/cuda-13.0" and marker["run_id"] == "run-1" and marker["version"] == "13.0.1"
    # the marker stays until the step's checks pass (operations/toolkit.py removes it)
    assert (root / "state" / "toolkit-install.json").exists()
    assert Path(source.cached).exists() and not Path(source.part).exists()
    assert not (root / "tmp" / "servestack-cuda-installer.out").exists()
    assert os.readlink(root / "cuda") == "cuda-12.8"


def test_a_prestaged_runfile_is_run_where_it_is(lab):
    root, _, _ = lab
    source = staged(lab, "normal", prestaged=True)
    assert install(lab, source).returncode == 0
    assert (root / "srv" / "x.run").exists() and not (root / "cache").exists()


def test_failed_install_moves_the_tree_aside_shows_the_log_tail_and_restores_the_link(lab):
    root, _, _ = lab
    result = install(lab, staged(lab, "fail"))
    assert result.returncode == 1
    err = result.stderr
    assert re.search(rf"servestack: CUDA 13\.0\.1 install failed \(installer exit 1\); the partial tree was moved "
                     rf"aside to {root}/cuda-13\.0\.failed-{STAMP}", err)
    assert (f"servestack: {root}/cuda was re-pointed to '{root}/cuda-13.0' (by the installer?): "
            "restored -> cuda-12.8") in err
    assert "servestack: installer output (last lines):\ninstaller says hello\nextraction failed\n" in err
    assert f"servestack: last lines of {root}/installer.log:" in err
    assert "[ERROR]: Install of CUDA Toolkit 13.0 failed, quitting" in err
    tail = err[err.index("last lines of"):].splitlines()[1:]
    assert len(tail) == LOG_TAIL_LINES and "[INFO]: log line 7" in tail[0]
    assert os.readlink(root / "cuda") == "cuda-12.8"
    assert not (root / "cuda-13.0").exists() and len(list(root.glob("cuda-13.0.failed-*"))) == 1
    assert not (root / "state" / "toolkit-install.json").exists()
    assert (root / "cache" / "x.run").exists()                       # the verified runfile stays
    assert not (root / "tmp" / "servestack-cuda-installer.out").exists()


def test_failed_install_without_a_kept_link_leaves_the_link_alone(lab):
    root, _, _ = lab
    result = install(lab, staged(lab, "fail"), keep=False)
    assert result.returncode == 1 and "restored" not in result.stderr
    assert os.readlink(root / "cuda") == f"{root}/cuda-13.0"


@pytest.mark.parametrize("mode, why", [
    ("broken", "installer exit 0, but {root}/cuda-13.0/bin/nvcc does not run"),
    ("other", "installer exit 0, but {root}/cuda-13.0/bin/nvcc reports: Cuda compilation tools, release 12.8, "
              "V12.8.93"),
])
def test_an_installer_exit_0_is_not_enough(lab, mode, why):
    root, _, _ = lab
    result = install(lab, staged(lab, mode))
    assert result.returncode == 1
    assert why.format(root=root) in result.stderr
    assert "the partial tree was moved aside" in result.stderr and not (root / "cuda-13.0").exists()
    assert f"no {root}/installer.log" not in result.stderr


def test_a_runfile_that_fails_verification_is_never_run(lab):
    root, _, _ = lab
    source = staged(lab, "normal")
    Path(source.part).write_bytes(Path(source.part).read_bytes().replace(b"hello", b"HELLO"))
    result = install(lab, source)
    assert result.returncode == 1 and "fails verification (md5" in result.stderr
    assert not (root / "args").exists() and not (root / "state" / "toolkit-install.json").exists()
    assert len(list((root / "cache").glob("x.run.part.rejected-*"))) == 1


@pytest.mark.skipif(not shutil.which("flock"), reason="no flock on this machine")
def test_install_waits_for_nobody_while_another_holds_the_busy_lock(lab):
    root, _, _ = lab
    (root / "state").mkdir()
    with flock_held(root / "state" / "lock.busy"):
        result = install(lab, staged(lab, "normal"))
    assert result.returncode == 75 and result.stderr.startswith("busy "), result.stderr
    assert not (root / "args").exists() and not (root / "state" / "toolkit-install.json").exists()


def test_install_runs_the_installer_with_lang_c_and_without_display(lab):
    root, _, _ = lab
    result = install(lab, staged(lab, "normal"), env={"DISPLAY": ":0", "LANG": "de_DE.UTF-8",
                                                      "LC_ALL": "de_DE.UTF-8"})
    assert result.returncode == 0, result.stderr
    assert (root / "locale").read_text().split() == ["unset", "C", "C"]


def stale_installer_log(root: Path, text: str) -> Path:
    """An earlier /tmp/cuda-installer.log, owned by another user where this test may chown."""
    log = installer_tmp_log(root)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(text)
    log.chmod(0o600)
    if os.getuid() == 0:
        os.chown(log, pwd.getpwnam("nobody").pw_uid, -1)
    return log


def test_an_earlier_installer_log_is_moved_aside_before_the_install(lab):
    root, _, _ = lab
    log = stale_installer_log(root, "[INFO]: another user's install\n")
    (log.parent / "cuda-installer.log.stale-20250101T000000Z").write_text("an older one")
    result = install(lab, staged(lab, "tmplog"))
    assert result.returncode == 0, result.stderr
    stale = list(log.parent.glob("cuda-installer.log.stale-*"))
    assert len(stale) == 1 and re.fullmatch(rf"cuda-installer\.log\.stale-{STAMP}", stale[0].name)
    assert stale[0].read_text() == "[INFO]: another user's install\n"
    owner = "nobody" if os.getuid() == 0 else pwd.getpwuid(os.getuid()).pw_name
    assert stale[0].owner() == owner
    assert log.read_text() == "[INFO]: the log of this run\n"
    assert (f"servestack: moved the earlier {log} (owner {owner}) aside to {stale[0]}: the installer writes that "
            "file and crashes on one it cannot replace") in result.stderr


def test_a_failed_install_shows_this_runs_log_not_an_earlier_one(lab):
    root, _, _ = lab
    stale_installer_log(root, GCC_REFUSAL.replace("16.1.0", "9.9.9") + "\n")
    (root / "installer.log").write_text(GCC_REFUSAL.replace("16.1.0", "8.8.8") + "\n")   # an earlier run's
    result = install(lab, staged(lab, "fail"))
    assert result.returncode == 1
    assert "compiler check" not in result.stderr and "unsupported compiler" not in result.stderr
    tail = result.stderr[result.stderr.index(f"last lines of {root}/installer.log:"):].splitlines()[1:]
    assert tail[0] == "[INFO]: log line 7" and tail[-1] == "[ERROR]: Install of CUDA Toolkit 13.0 failed, quitting"


def test_a_compiler_check_refusal_names_the_key_that_passes_override(lab):
    root, settings, _ = lab
    result = install(lab, staged(lab, "gcc"))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == ("servestack: CUDA 13.0.1 install refused by the installer's compiler check: "
                        f"{GCC_REFUSAL}")
    assert lines[1] == ("servestack: set cuda_installer_override = True in this host's data to pass --override "
                        "(it skips that check), or install a gcc that CUDA 13.0.1 supports")
    assert "Failed to verify gcc version." in result.stderr                           # the installer's output
    assert f"last lines of {installer_tmp_log(root)}:" in result.stderr
    assert "--override" not in (root / "args").read_text().split()
    assert not (root / "cuda-13.0").exists()
    override = settings_from_data("h1", {**lab_data(root, lab_manifest(root)), "cuda_installer_override": True})
    installer_tmp_log(root).unlink()                          # (moved aside by the script, as any earlier one)
    again = install(lab, staged_again(lab, "gcc"), settings=override)
    assert again.returncode == 0, again.stderr
    assert (root / "args").read_text().split()[-3:] == ["--override", f"--installpath={root}/cuda-13.0",
                                                         f"--tmpdir={root}/tmp"]


def staged_again(lab, mode: str) -> RunfileSource:
    """`staged` once more: the cached copy of the first install's download is in the way."""
    root, _, _ = lab
    shutil.rmtree(root / "cache")
    return staged(lab, mode)


def test_the_stand_in_runfile_crashes_on_another_users_installer_log_as_the_real_one(tmp_path):
    runfile = build_runfile(tmp_path / "build")
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    env = {"PATH": os.environ["PATH"], "SERVESTACK_STANDIN_ROOT": str(root)}
    flags = ["--silent", "--toolkit", "--installpath=/usr/local/cuda-13.0", f"--tmpdir={tmp_path}"]
    log = root / "tmp" / "cuda-installer.log"
    log.write_text("[INFO]: another user's install\n")
    if os.getuid() == 0:
        os.chown(log, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        log.chmod(0o400)
    crashed = subprocess.run(["sh", runfile, *flags], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert crashed.returncode == 139 and not (root / "usr/local/cuda-13.0").exists()
    log.unlink()
    done = subprocess.run(["sh", runfile, *flags], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[INFO]: Installed: CUDA Toolkit 13.0 in /usr/local/cuda-13.0" in log.read_text()


def test_the_stand_in_runfile_fails_its_compiler_check_with_the_real_wording_unless_overridden(tmp_path):
    runfile = build_runfile(tmp_path / "build")
    root = tmp_path / "root"
    knob = root / "etc" / "servestack-sandbox" / "gcc-version"
    knob.parent.mkdir(parents=True)
    knob.write_text("16.1.0\n")
    env = {"PATH": os.environ["PATH"], "SERVESTACK_STANDIN_ROOT": str(root)}
    flags = ["--silent", "--toolkit", "--installpath=/usr/local/cuda-13.0", f"--tmpdir={tmp_path}"]
    refused = subprocess.run(["sh", runfile, *flags], capture_output=True, text=True, env=env, cwd=tmp_path)
    shown = "/var/log/cuda-installer.log" if os.getuid() == 0 else "/tmp/cuda-installer.log"
    assert refused.returncode == 1
    assert refused.stdout == f" Failed to verify gcc version. See log at {shown} for details.\n"
    log = (root / "tmp" / "cuda-installer.log").read_text().splitlines()
    assert log[-4:] == ["[INFO]: Checking compiler version...", "[INFO]: gcc location: /usr/bin/gcc",
                        "[INFO]: gcc version: gcc version 16.1.0 (servestack sandbox stand-in)", GCC_REFUSAL]
    assert not (root / "usr/local/cuda-13.0").exists()
    passed = subprocess.run(["sh", runfile, *flags, "--override"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert (root / "usr/local/cuda-13.0/bin/nvcc").is_file()


# --- records --------------------------------------------------------------------------------------


def test_json_records_are_written_whole(tmp_path):
    path = tmp_path / "state" / "toolkits.json"
    record = {"schema": 1, "toolkits": {"/usr/local/cuda-12.8": {"nvcc": "line one\nline 'two'"}}}
    assert sh(write_json_command(str(path), record)).returncode == 0
    assert json.loads(path.read_text()) == record
    assert path.read_text() == json.dumps(record, indent=1, sort_keys=True) + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["toolkits.json"]


# --- upload-staging.sh ----------------------------------------------------------------------------


def test_upload_staging_resumes_a_partial_file_and_places_the_upload(tmp_path):
    user = pwd.getpwuid(os.getuid()).pw_name
    owner = f"{user}:{grp.getgrgid(os.getgid()).gr_name}"
    remote = tmp_path / "cache" / "x.run.part"
    remote.parent.mkdir()
    remote.write_bytes(b"first half")
    prepared = sh(script_command("upload-staging.sh", "prepare", str(remote), user))
    assert prepared.returncode == 0, prepared.stderr
    staged_path = Path(prepared.stdout.strip())
    assert staged_path == tmp_path / "cache" / f".incoming-{user}" / "x.run.part"
    assert staged_path.read_bytes() == b"first half" and not remote.exists()
    assert oct(staged_path.parent.stat().st_mode & 0o777) == "0o700"
    # prepared again (a retry): what is staged stays staged
    assert sh(script_command("upload-staging.sh", "prepare", str(remote), user)).stdout.strip() == str(staged_path)
    staged_path.write_bytes(b"first half, second half")
    placed = sh(script_command("upload-staging.sh", "place", str(remote), user, owner))
    assert placed.returncode == 0, placed.stderr
    assert remote.read_bytes() == b"first half, second half"
    assert sorted(p.name for p in remote.parent.iterdir()) == ["x.run.part"]
