"""The core's host-side scripts (files/scripts: helpers.sh, atomic-write.sh, disk-free.sh, lock.sh),
run with `bash` on this machine against temporary directories, and the Python that renders their
inputs (servestack/scripts.py, facts/host.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from facts.framing import Section, split
from facts.host import (
    HostLock,
    LockState,
    disk_command,
    found_lock,
    lock_read_command,
    parse_disks,
    parse_lock,
    release_lock_command,
    take_lock_command,
)
from servestack.scripts import (
    HELPERS,
    HELPERS_LINE,
    SCRIPTS,
    atomic_copy_command,
    atomic_write_command,
    script,
    script_command,
    script_text,
)
from tests.unit.flock_holder import flock_held

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
BASH = shutil.which("bash")


def bash(name: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run files/scripts/<name> with bash, as a host would."""
    return subprocess.run([BASH, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          env=env if env is not None else dict(os.environ), **kwargs)


def sh(command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a rendered command as pyinfra sends it (`sh -c`)."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- servestack/scripts.py -------------------------------------------------------------------------


def test_a_script_command_carries_the_script_its_arguments_and_environment(tmp_path):
    target = str(tmp_path / "it's here")
    command = script_command("atomic-write.sh", target, "600", env={"CONTENT": "a b"})
    assert shlex.split(command) == ["CONTENT=a b", "bash", "-c", script_text("atomic-write.sh"),
                                    "atomic-write.sh", target, "600"]
    assert sh(command).returncode == 0
    assert (tmp_path / "it's here").read_text() == "a b\n"
    assert script("atomic-write.sh", "/x", "644").get_raw_value() == script_command("atomic-write.sh", "/x", "644")


@pytest.mark.parametrize("name", ["atomic-write.sh", "disk-free.sh", "lock.sh", "helpers.sh"])
def test_each_script_states_its_contract_at_the_top(name):
    assert (SCRIPTS / name).read_text().startswith(f"# {name} ")


# --- helpers.sh: the shell functions the scripts share ---------------------------------------------

SHELL_SCRIPTS = sorted(path.name for path in SCRIPTS.glob("*.sh") if path.name != HELPERS)
USING_HELPERS = [name for name in SHELL_SCRIPTS if HELPERS_LINE in (SCRIPTS / name).read_text().splitlines()]


def functions_defined(text: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\(\) *\{", text, flags=re.MULTILINE))


def helper(tmp_path, call: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`call` in a bash that sourced helpers.sh, in tmp_path."""
    return subprocess.run([BASH, "-c", f'source "$1"; {call}', "helper", str(SCRIPTS / HELPERS)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_the_helpers_travel_in_place_of_the_line_that_sources_them():
    assert set(USING_HELPERS) == {path.name for path in SCRIPTS.glob("*.sh")} - {HELPERS}   # every script: `usage`
    helpers = (SCRIPTS / HELPERS).read_text()
    code = [line for line in helpers.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "<<" not in helpers and len("\n".join(code)) < len(helpers) / 2   # no heredoc a comment line could be in
    for name in USING_HELPERS:
        before, after = (SCRIPTS / name).read_text().split(HELPERS_LINE + "\n")
        assert script_text(name) == before + "\n".join(code) + "\n" + with_files_read(after), name


FILE_READ = re.compile(r'^(\w+)=\$\(<"\$\{BASH_SOURCE\[0\]%/\*\}/([^"]+)"\)$', flags=re.MULTILINE)


def with_files_read(text: str) -> str:
    """`text` as it is sent: each line `NAME=$(<"${BASH_SOURCE[0]%/*}/PATH")` is NAME set to PATH's text as
    PATH itself is sent (the gate's copy of the venv tool carries the release check the tool carries)."""
    return FILE_READ.sub(lambda read: f"{read[1]}={shlex.quote(script_text(read[2]).rstrip(chr(10)))}", text)


def read_as_shell_does(path: Path) -> str:
    """`$(<PATH)`: the file's text without its final line breaks."""
    return path.read_text().rstrip("\n")


def test_a_file_a_script_reads_travels_in_the_command_in_place_of_the_read(tmp_path):
    """The gate runs the venv step's tool, patch-check.sh the patch engine, verify-http.sh its probe:
    each reads the file beside it where it lies, and carries its text when sent."""
    reads = {name: FILE_READ.findall((SCRIPTS / name).read_text()) for name in
             ("sglang-health-gate.sh", "patch-check.sh", "verify-http.sh")}
    assert reads == {"sglang-health-gate.sh": [("ml_env_tool", "ml_env.py")],
                     "patch-check.sh": [("engine", "../../servestack/patchlib.py")],
                     "verify-http.sh": [("probe", "verify-http.py")]}
    for name in reads:
        assert not FILE_READ.search(script_text(name)), name
    # a tool that includes no shared code (check_release.py) reads the same where it lies and sent
    text = "x=1\n" + 'tool=$(<"${BASH_SOURCE[0]%/*}/check_release.py")\n' + 'printf %s "$tool"\n'
    (tmp_path / "reads.sh").write_text(text)
    (tmp_path / "check_release.py").write_text((SCRIPTS / "check_release.py").read_text())  # beside it, as here
    script_text.cache_clear()
    try:
        sent = script_text(str(tmp_path / "reads.sh"))
        here = subprocess.run([BASH, str(tmp_path / "reads.sh")], capture_output=True, text=True)
    finally:
        script_text.cache_clear()
    probe = read_as_shell_does(SCRIPTS / "check_release.py")
    assert sent == f"x=1\ntool={shlex.quote(probe)}\n" + 'printf %s "$tool"\n'
    assert subprocess.run([BASH, "-c", sent], capture_output=True, text=True).stdout == here.stdout == probe


def test_no_script_defines_again_what_the_helpers_define():
    shared = functions_defined((SCRIPTS / HELPERS).read_text())
    assert {"progress", "message", "require", "hold_busy_file", "utc_stamp", "first_line", "join_lines", "resolve",
            "dpkg_owner", "move_into_place", "write_atomically", "copy_atomically", "point_link"} <= shared
    for name in SHELL_SCRIPTS:
        assert not functions_defined((SCRIPTS / name).read_text()) & shared, name


def test_a_script_runs_the_same_from_files_scripts_and_as_sent(tmp_path):
    cuda = tmp_path / "cuda-13.0"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "version.json").write_text('{\n  "cuda": {"version": "13.0.1"}\n}\n')
    (tmp_path / "cuda").symlink_to(cuda)
    args = ["state", str(cuda), str(tmp_path / "cuda"), str(tmp_path), "--"]
    by_path = subprocess.run([BASH, str(SCRIPTS / "cuda-toolkits.sh"), *args], capture_output=True, text=True)
    sent = sh(script_command("cuda-toolkits.sh", *args))
    assert by_path.returncode == sent.returncode == 0
    assert by_path.stdout == sent.stdout
    assert 'tree_version_json {  "cuda": {"version": "13.0.1"}}' in sent.stdout.splitlines()
    assert f"link_resolved {cuda}" in sent.stdout.splitlines()


def test_progress_and_message_speak_for_servestack_on_stdout_and_stderr(tmp_path):
    said = helper(tmp_path, 'progress "3 of 8 done"; message "the disk is full"')
    assert (said.stdout, said.stderr) == ("servestack: 3 of 8 done\n", "servestack: the disk is full\n")


def test_require_exits_naming_the_missing_program_and_its_package(tmp_path):
    said = helper(tmp_path, "require no-such-program-here some-package; echo after")
    assert said.returncode == 1 and said.stdout == ""
    assert said.stderr == "servestack: 'no-such-program-here' (some-package) is needed on the host\n"
    assert helper(tmp_path, "require bash bash; echo present").stdout == "present\n"


def test_hold_busy_file_refuses_while_another_process_holds_it(tmp_path):
    busy = tmp_path / "lock.busy"
    assert helper(tmp_path, f'hold_busy_file {busy} "busy"; echo held').stdout == "held\n"
    with flock_held(busy):
        said = helper(tmp_path, f'hold_busy_file {busy} "another install is running"; echo held')
    assert (said.returncode, said.stdout, said.stderr) == (1, "", "servestack: another install is running\n")


def test_utc_stamp_is_the_time_now_in_utc(tmp_path):
    before = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stamp = helper(tmp_path, 'utc_stamp; printf "%s" "$stamp"', env={"TZ": "EST5"}).stdout
    after = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    assert before <= stamp <= after


def test_first_line_reads_a_files_first_line_or_nothing(tmp_path):
    (tmp_path / "f").write_text("one two\nthree\n")
    assert helper(tmp_path, 'first_line f; printf "[%s]" "$line"').stdout == "[one two]"
    assert helper(tmp_path, 'line=old; first_line missing; printf "[%s]" "$line"').stdout == "[]"


@pytest.mark.parametrize("text", ['{"a": 1,\n "b": [2, 3]}\n', '{"a": 1,\n "b": [2, 3]}', "", "\n\n"])
def test_join_lines_drops_the_line_breaks_as_tr_does(tmp_path, text):
    (tmp_path / "f").write_text(text)
    assert helper(tmp_path, 'join_lines f; printf "%s" "$joined"').stdout == text.replace("\n", "")


def test_resolve_is_readlink_f_and_leaves_the_directory_as_it_was(tmp_path):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "hop").symlink_to(tmp_path / "real")
    (tmp_path / "link").symlink_to("hop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for path in ("link", "link/sub", "link/file", "dangling", "hop/missing"):
        expected = subprocess.run(["readlink", "-f", "--", path], cwd=tmp_path, capture_output=True, text=True).stdout
        done = helper(tmp_path, f'resolve {path}; printf "%s\\n%s\\n" "$resolved" "$PWD"')
        assert done.stdout == expected + f"{tmp_path}\n", path


def test_dpkg_owner_asks_dpkg_only_for_a_path_in_its_lists(tmp_path):
    admin, bin_dir = tmp_path / "dpkg", tmp_path / "bin"
    (admin / "info").mkdir(parents=True)
    bin_dir.mkdir()
    (admin / "info" / "cuda-nvcc-13-0.list").write_text("/usr/local/cuda-13.0/bin\n/usr/local/cuda-13.0/bin/nvcc\n")
    (admin / "diversions").write_text("/usr/bin/diverted\n")
    (bin_dir / "grep").symlink_to(shutil.which("grep"))
    (bin_dir / "dpkg").write_text('#!/bin/sh\necho "asked $*" >> "$LOG"\n'
                                  'printf "cuda-nvcc-13-0: %s\\nsecond line\\n" "$2"\n')
    (bin_dir / "dpkg").chmod(0o755)
    log = tmp_path / "asked"
    env = {"DPKG_ADMINDIR": str(admin), "PATH": f"{bin_dir}:/bin:/usr/bin", "LOG": str(log)}

    def owner(path):
        return helper(tmp_path, f'owner=old; dpkg_owner {path}; printf "[%s]" "$owner"', env).stdout
    assert owner("/usr/local/cuda-13.0/bin/nvcc") == "[cuda-nvcc-13-0: /usr/local/cuda-13.0/bin/nvcc]"
    assert owner("/usr/bin/diverted") == "[cuda-nvcc-13-0: /usr/bin/diverted]"
    assert owner("/usr/local/cuda-13.0/bin/nvc") == owner("/usr/local/cuda-12.8/bin/nvcc") == "[]"
    assert log.read_text().splitlines() == ["asked -S /usr/local/cuda-13.0/bin/nvcc", "asked -S /usr/bin/diverted"]
    (bin_dir / "dpkg").unlink()
    env["PATH"] = str(bin_dir)
    assert owner("/usr/local/cuda-13.0/bin/nvcc") == "[]"   # no dpkg: nothing is dpkg's


@pytest.mark.parametrize("text, written", [("a b", "a b\n"), ("a\nb\n", "a\nb\n"), ("", "\n")])
def test_write_atomically_replaces_the_file_by_rename(tmp_path, text, written):
    target = tmp_path / "record.json"
    target.write_text("old\n")
    inode = target.stat().st_ino
    done = helper(tmp_path, f'write_atomically {target} "$TEXT" 600 && echo ok', env={"TEXT": text})
    assert done.stdout == "ok\n" and target.read_text() == written and mode_of(target) == 0o600
    assert target.stat().st_ino != inode and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_failed_atomic_write_or_copy_leaves_the_target_and_nothing_else(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "source").write_text("unit\n")
    done = helper(tmp_path, "write_atomically dir text || echo failed; copy_atomically source dir 644 || echo failed; "
                            "write_atomically missing/file text || echo failed")
    assert done.stdout == "failed\nfailed\nfailed\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "source"] and not any((tmp_path / "dir").iterdir())


def test_copy_atomically_copies_even_where_a_script_has_a_function_named_install(tmp_path):
    (tmp_path / "good").write_text("unit v1\n")
    done = helper(tmp_path, "install() { echo shadowed; return 1; }; copy_atomically good unit 644 && echo ok")
    assert done.stdout == "ok\n" and (tmp_path / "unit").read_text() == "unit v1\n"


def test_copy_atomically_and_point_link_replace_by_rename(tmp_path):
    (tmp_path / "good").write_text("unit v1\n")
    (tmp_path / "unit").write_text("unit v2\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "venv").symlink_to(tmp_path / "a")
    done = helper(tmp_path, f"copy_atomically good unit 640 && point_link venv {tmp_path / 'b'} && echo ok")
    assert done.stdout == "ok\n"
    assert (tmp_path / "unit").read_text() == "unit v1\n" and mode_of(tmp_path / "unit") == 0o640
    assert os.readlink(tmp_path / "venv") == str(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "good", "unit", "venv"]


# --- atomic-write.sh --------------------------------------------------------------------------------


def write(path: Path, mode: str, content: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CONTENT", None)
    if content is not None:
        env["CONTENT"] = content
    return bash("atomic-write.sh", str(path), mode, env=env)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp.*"))


@pytest.mark.parametrize(("content", "written"), [
    ("one line", "one line\n"),
    ("ends with a newline\n", "ends with a newline\n"),
    ("keeps\nblank lines\n\n", "keeps\nblank lines\n\n"),
    ("", "\n"),
])
def test_atomic_write_adds_a_final_newline_only_when_missing(tmp_path, content, written):
    target = tmp_path / "file"
    assert write(target, "644", content).returncode == 0
    assert target.read_text() == written
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", ["600", "640", "755"])
def test_atomic_write_sets_the_mode(tmp_path, mode):
    target = tmp_path / "file"
    target.write_text("old\n")
    target.chmod(0o666)
    assert write(target, mode, "x").returncode == 0
    assert mode_of(target) == int(mode, 8)


def test_atomic_write_creates_the_directory(tmp_path):
    target = tmp_path / "a" / "b" / "file.json"
    assert write(target, "644", "{}").returncode == 0
    assert target.read_text() == "{}\n" and mode_of(target.parent) == 0o755


def test_atomic_write_replaces_the_file_by_rename(tmp_path):
    """A reader holding the old file (here a hard link to it) keeps reading it whole."""
    target, reader = tmp_path / "file", tmp_path / "reader"
    target.write_text("old\n")
    os.link(target, reader)
    assert write(target, "644", "new").returncode == 0
    assert target.read_text() == "new\n" and reader.read_text() == "old\n"
    assert target.stat().st_ino != reader.stat().st_ino


@pytest.mark.parametrize(("content", "mode", "why"), [
    ("x", "999", "invalid mode"),
    (None, "644", "CONTENT"),            # no content given: nothing is written
])
def test_a_failed_atomic_write_leaves_the_file_and_no_temporary_file(tmp_path, content, mode, why):
    target = tmp_path / "file"
    target.write_text("old\n")
    target.chmod(0o600)
    done = write(target, mode, content)
    assert done.returncode != 0 and why in done.stderr
    assert target.read_text() == "old\n" and mode_of(target) == 0o600
    assert leftovers(tmp_path) == []


def test_atomic_write_refuses_a_directory_in_the_way(tmp_path):
    (tmp_path / "in-the-way").mkdir()
    done = write(tmp_path / "in-the-way", "644", "x")
    assert done.returncode != 0 and done.stderr
    assert leftovers(tmp_path) == [] and list((tmp_path / "in-the-way").iterdir()) == []
    (tmp_path / "a-file").write_text("")
    done = write(tmp_path / "a-file" / "below", "644", "x")
    assert done.returncode != 0 and done.stderr and leftovers(tmp_path) == []


def test_atomic_write_command_writes_any_text_exactly(tmp_path):
    text = "quotes ' \" `backticks` $HOME ${x} \\ back\\slash\n-n -e %s %d\n\ttab \u00e9\u4e2d"
    target = tmp_path / "odd name's dir" / "file"
    done = sh(atomic_write_command(str(target), text, "600"))
    assert done.returncode == 0, done.stderr
    assert target.read_text() == text + "\n" and mode_of(target) == 0o600
    assert sh(atomic_write_command(str(tmp_path / "default"), "x")).returncode == 0
    assert mode_of(tmp_path / "default") == 0o644


# --- disk-free.sh ----------------------------------------------------------------------------------


def df_wrapper(tmp_path: Path, body: str = "") -> dict:
    """PATH with a `df` that logs each call (and runs `body` first, which may exit)."""
    real_df = shutil.which("df")
    wrapper = tmp_path / "bin" / "df"
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(f"#!/bin/sh\necho called >> {tmp_path}/df.log\n{body}\nexec {real_df} \"$@\"\n")
    wrapper.chmod(0o755)
    return {**os.environ, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}


def df_calls(tmp_path: Path) -> int:
    log = tmp_path / "df.log"
    return log.read_text().count("called") if log.exists() else 0


def test_disk_free_of_every_path_in_one_df_call(tmp_path):
    (tmp_path / "with space").mkdir()
    paths = [str(tmp_path / "missing" / "deeper"), str(tmp_path / "with space"), "/"]
    done = bash("disk-free.sh", *paths, env=df_wrapper(tmp_path))
    assert done.returncode == 0 and df_calls(tmp_path) == 1
    lines = done.stdout.splitlines()
    assert lines[:4] == [f"diskpath {path}" for path in paths] + ["dfall"]
    disks = parse_disks(lines)
    assert set(disks) == set(paths) and all(disk is not None and disk.size > 0 for disk in disks.values())
    assert disks[paths[0]].mount == disks[paths[1]].mount   # a missing path counts as its nearest parent


def test_disk_free_falls_back_to_one_df_per_path(tmp_path):
    paths = [str(tmp_path / "missing"), "/", str(tmp_path)]
    # df fails for more than one path, and for "/" alone
    env = df_wrapper(tmp_path, '[ "$#" -gt 3 ] && exit 1\nfor a; do [ "$a" = / ] && exit 1; done')
    done = bash("disk-free.sh", *paths, env=env)
    assert done.returncode == 0 and df_calls(tmp_path) == 4
    assert "diskerr /" in done.stdout.splitlines()
    disks = parse_disks(done.stdout.splitlines())
    assert disks["/"] is None and disks[paths[0]] is not None and disks[paths[0]].mount == disks[paths[2]].mount


def test_disk_free_without_df_says_so_path_by_path(tmp_path):
    done = bash("disk-free.sh", str(tmp_path), env=df_wrapper(tmp_path, "exit 127"))
    assert done.returncode == 0 and parse_disks(done.stdout.splitlines()) == {str(tmp_path): None}


def test_disk_free_of_no_paths_is_a_wrong_call():
    done = bash("disk-free.sh")
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "usage: disk-free.sh PATH... (missing arguments)\n")


def test_the_disk_command_is_the_script(tmp_path):
    """The same lines but for the free bytes, which other processes change between the two calls."""
    paths = (str(tmp_path / "missing"), "/")

    def shape(text: str) -> list:
        return [line.split()[:-2] if line.startswith("/") else line for line in text.splitlines()]

    assert shape(sh(disk_command(paths)).stdout) == shape(bash("disk-free.sh", *paths).stdout)


# --- lock.sh ---------------------------------------------------------------------------------------


def lock(action: str, state_dir: Path | str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return bash("lock.sh", action, str(state_dir), *args, env=env)


def read_lock(state_dir: Path | str) -> LockState:
    done = lock("read", state_dir)
    assert done.returncode == 0, done.stderr
    return parse_lock(done.stdout.splitlines())


def set_field(path: Path, key: str, value) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data) + "\n")


def test_take_creates_the_state_directory_and_writes_the_lock(tmp_path):
    state_dir = tmp_path / "var" / "lib" / "servestack"
    done = lock("take", state_dir, "run-A", "laptop:42", "20260101T000000Z")
    assert (done.returncode, done.stdout) == (0, "taken\n"), done.stderr
    assert mode_of(state_dir) == 0o755
    data = json.loads((state_dir / "lock").read_text())
    assert {key: data[key] for key in ("run_id", "controller", "started", "boot_id")} == {
        "run_id": "run-A", "controller": "laptop:42", "started": "20260101T000000Z", "boot_id": BOOT_ID}
    assert data["pid"] is None or isinstance(data["pid"], int)   # the sshd above this shell, if any
    assert sorted(p.name for p in state_dir.iterdir()) == ["lock", "lock.guard"]


def test_read_without_a_lock_or_a_state_directory_prints_nothing(tmp_path):
    assert lock("read", tmp_path / "missing").stdout == ""
    assert read_lock(tmp_path / "missing") == LockState()
    tmp_path.joinpath("empty").mkdir()
    assert read_lock(tmp_path / "empty") == LockState()


def test_take_is_ours_then_held_for_another_run(tmp_path):
    state_dir = tmp_path / "state"
    lock("take", state_dir, "run-A", "ctl:1", "T")
    assert (lock("take", state_dir, "run-A", "ctl:1", "T").stdout) == "ours\n"
    before = (state_dir / "lock").read_text()
    held = lock("take", state_dir, "run-B", "ctl:2", "T")
    assert held.returncode == 3 and split(held.stdout.splitlines()) == {"held": Section(0, (before.rstrip("\n"),))}
    assert (state_dir / "lock").read_text() == before
    found = read_lock(state_dir)
    assert found.present and found.alive and found.run_id == "run-A"
    assert found.why in ("no-owner", "connection")
    assert found.describe() == "run run-A from ctl:1, started T"


def test_the_lock_names_its_ssh_session_and_is_stale_once_that_is_gone(tmp_path):
    """The owner is the nearest ancestor named sshd (here a copy of bash named so): alive while it
    runs, stale once it exits."""
    state_dir, go = tmp_path / "state", tmp_path / "go"
    fake_sshd = tmp_path / "sshd"
    shutil.copy(os.path.realpath(shutil.which("bash")), fake_sshd)
    session = subprocess.Popen(
        [str(fake_sshd), "-c", 'bash "$1" take "$2" run-A ctl:1 T; while [ ! -e "$3" ]; do sleep 0.05; done',
         "sshd", str(SCRIPTS / "lock.sh"), str(state_dir), str(go)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if (state_dir / "lock").exists():
                break
            time.sleep(0.05)
        data = json.loads((state_dir / "lock").read_text())
        assert data["pid"] == session.pid and data["owner_start"].isdigit()
        found = read_lock(state_dir)
        assert found.alive and found.why == "connection"
        assert "connection is still open" in found.why_alive()
        assert lock("take", state_dir, "run-B", "ctl:2", "T").returncode == 3
    finally:
        go.touch()
        assert session.wait(10) == 0
    assert session.stdout.read() == "taken\n"
    assert not read_lock(state_dir).alive
    before = (state_dir / "lock").read_text()
    taken = lock("take", state_dir, "run-B", "ctl:2", "T")
    assert taken.returncode == 0 and taken.stdout.endswith("\ntaken\n")
    assert split(taken.stdout.splitlines()) == {"stale": Section(0, (before.rstrip("\n"),))}
    assert json.loads((state_dir / "lock").read_text())["run_id"] == "run-B"
    kept = [p for p in state_dir.iterdir() if p.name.startswith("lock.stale-")]
    assert len(kept) == 1 and kept[0].read_text() == before
    assert len(kept[0].name) == len("lock.stale-20260101T000000Z")


def test_a_lock_whose_owner_process_is_gone_or_another_is_stale(tmp_path):
    state_dir = tmp_path / "state"
    lock("take", state_dir, "run-A", "ctl:1", "T")
    path = state_dir / "lock"
    set_field(path, "pid", 4194304)                  # no such process
    assert not read_lock(state_dir).alive
    set_field(path, "pid", os.getpid())              # a live process, but not the one that started then
    set_field(path, "owner_start", "1")
    found = read_lock(state_dir)
    assert not found.alive and not found.rebooted   # the same boot: its connection is gone
    assert lock("take", state_dir, "run-B", "ctl:2", "T").stdout.endswith("taken\n")


def test_a_stale_lock_is_replaced_saying_what_its_run_was_doing(tmp_path):
    """lock.sh frames the lock it replaces and its activity as sections; preflight reads them with
    facts/framing.py `split` (operations/preflight.py `_take_lock`)."""
    state_dir = tmp_path / "state"
    lock("take", state_dir, "run-A", "ctl:1", "T")
    set_field(state_dir / "lock", "pid", 4194304)
    activity = {"step": "venv build r-0123456789ab", "since": "T1", "pid": 77, "run_id": "run-A"}
    (state_dir / "lock.activity").write_text(json.dumps(activity) + "\n")
    assert read_lock(state_dir).activity == activity
    taken = lock("take", state_dir, "run-B", "ctl:2", "T")
    found = split(taken.stdout.splitlines())
    assert taken.returncode == 0 and sorted(found) == ["activity", "stale"]
    stale = found_lock(found["stale"], found["activity"])
    assert stale.describe() == "run run-A from ctl:1, started T"
    assert stale.doing() == "'venv build r-0123456789ab' (since T1, pid 77)"


def test_the_lock_of_a_rebooted_host_is_stale(tmp_path):
    state_dir = tmp_path / "state"
    lock("take", state_dir, "run-A", "ctl:1", "T")
    set_field(state_dir / "lock", "boot_id", "before-reboot")
    found = read_lock(state_dir)
    assert found.present and not found.alive and found.why is None and found.rebooted


def test_a_lock_whose_connection_is_gone_is_alive_while_its_installer_runs(tmp_path):
    state_dir = tmp_path / "state"
    lock("take", state_dir, "run-A", "ctl:1", "T")
    set_field(state_dir / "lock", "pid", 4194304)
    with flock_held(state_dir / "lock.busy"):
        found = read_lock(state_dir)
        assert found.alive and found.why == "busy"
        assert "still running on the host" in found.why_alive()
        assert lock("take", state_dir, "run-B", "ctl:2", "T").returncode == 3
    assert not read_lock(state_dir).alive


def test_release_removes_only_this_runs_lock(tmp_path):
    state_dir = tmp_path / "state"
    assert lock("release", tmp_path / "missing", "run-A").stdout == "not-ours\n"
    assert not (tmp_path / "missing").exists()
    state_dir.mkdir()
    assert lock("release", state_dir, "run-A").stdout == "not-ours\n"      # no lock
    lock("take", state_dir, "run-A", "ctl:1", "T")
    assert lock("release", state_dir, "run-B").stdout == "not-ours\n"
    assert (state_dir / "lock").exists()
    assert lock("release", state_dir, "run-A").stdout == "released\n"
    assert not (state_dir / "lock").exists() and read_lock(state_dir) == LockState()
    assert lock("take", state_dir, "run-B", "ctl:2", "T").stdout == "taken\n"


def test_a_state_directory_with_a_trailing_slash_is_the_same_lock(tmp_path):
    state_dir = tmp_path / "state"
    lock("take", f"{state_dir}/", "run-A", "ctl:1", "T")
    assert read_lock(state_dir).run_id == "run-A"
    assert lock("take", state_dir, "run-A", "ctl:1", "T").stdout == "ours\n"


def test_take_without_flock_says_what_is_missing(tmp_path):
    (tmp_path / "state").mkdir()
    done = lock("take", tmp_path / "state", "run-A", "ctl:1", "T", env={"PATH": str(tmp_path / "empty-bin")})
    assert done.returncode == 1 and "'flock' (util-linux) is needed on the host" in done.stderr
    assert not (tmp_path / "state" / "lock").exists()


def test_an_unknown_action_is_refused(tmp_path):
    done = lock("steal", tmp_path)
    assert done.returncode == 2 and "unknown action 'steal'" in done.stderr


def test_the_lock_commands_and_fact_are_the_script(tmp_path):
    state_dir = str(tmp_path / "state")
    assert sh(take_lock_command(state_dir, "run-A", "ctl:1", "T")).stdout == "taken\n"
    output = sh(lock_read_command(state_dir)).stdout.splitlines()
    assert output == lock("read", state_dir).stdout.splitlines()
    assert HostLock().command(state_dir=state_dir) == lock_read_command(state_dir)
    found = HostLock().process(output)
    assert found.present and found.alive and found.run_id == "run-A"
    assert sh(release_lock_command(state_dir, "run-A")).stdout == "released\n"
    assert HostLock.default() == LockState()


def test_atomic_write_copies_a_file_byte_for_byte_by_rename(tmp_path):
    """With SOURCE (the known-good unit kept the first time servestack replaces a unit): an exact copy,
    the mode given, the directory made, the old file replaced by rename, nothing left beside it."""
    source, target = tmp_path / "unit.service", tmp_path / "state" / "good.service"
    source.write_bytes(b"[Service]\nExecStart=/x\n\n")                  # no final-newline rewriting
    target.parent.mkdir()
    target.write_text("old\n")
    reader = tmp_path / "reader"
    os.link(target, reader)
    assert bash("atomic-write.sh", str(target), "640", str(source)).returncode == 0
    assert target.read_bytes() == source.read_bytes() and mode_of(target) == 0o640
    assert reader.read_text() == "old\n" and sorted(p.name for p in target.parent.iterdir()) == ["good.service"]


def test_atomic_copy_of_a_missing_file_leaves_the_target_untouched(tmp_path):
    target = tmp_path / "good.service"
    target.write_text("old\n")
    assert bash("atomic-write.sh", str(target), "644", str(tmp_path / "absent")).returncode != 0
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["good.service"]


def test_atomic_copy_command_runs_atomic_write_with_the_source():
    assert shlex.split(atomic_copy_command("/etc/a", "/var/b", "600")) == [
        "bash", "-c", script_text("atomic-write.sh"), "atomic-write.sh", "/var/b", "600", "/etc/a"]
