"""Toolkit facts: nvcc/version.json parsers against real output, and the facts' shell commands run
here against throwaway trees in a temporary directory (they only read; nothing is installed)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from facts.toolkit import (
    CudaToolkits,
    Fingerprint,
    LinkChain,
    RunfileDigest,
    ToolkitFingerprint,
    fingerprint_command,
    parse_fingerprint,
    parse_nvcc_version,
    parse_tree,
)
from sandbox.standins.toolkit import write_toolkit_tree
from tests.unit.h200_captures import fixture_lines


def run(command: str) -> list[str]:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def fact_output(fact, **arguments) -> object:
    return fact.process(run(fact.command(**arguments)))


def test_nvcc_version_of_real_13_0():
    version = parse_nvcc_version("\n".join(fixture_lines("nvcc-version.txt")))
    assert (version.release, version.version) == ("13.0", "13.0.88")


def test_nvcc_version_absent():
    assert parse_nvcc_version("sh: 1: nvcc: not found") is None


def package_installed_tree_lines() -> list[str]:
    """What the toolkit fact prints for the real H200 host's package-installed /usr/local/cuda-13.0."""
    nvcc = fixture_lines("nvcc-version.txt")
    assert "No such file" in fixture_lines("cuda-version-json.txt")[0]
    packages = [line.split()[1] for line in fixture_lines("dpkg-cuda.txt")]
    assert "cuda-nvcc-13-0" in packages
    return (["tree_exists", "tree_nvcc_exit 0"] + [f"tree_nvcc {line}" for line in nvcc]
            + ["tree_dpkg cuda-nvcc-13-0: /usr/local/cuda-13.0/bin/nvcc"])


def test_parse_package_installed_tree():
    tree = parse_tree("/usr/local/cuda-13.0", package_installed_tree_lines())
    assert tree.exists and not tree.empty
    assert tree.nvcc.version == "13.0.88"
    assert tree.version_json is None
    assert tree.dpkg_owner == "cuda-nvcc-13-0"


def toolkits(tmp_path: Path, **overrides):
    arguments = {"install_path": str(tmp_path / "usr/local/cuda-13.0"),
                 "keep_paths": [str(tmp_path / "usr/local/cuda-12.8")],
                 "link_path": str(tmp_path / "usr/local/cuda"),
                 "state_dir": str(tmp_path / "state"),
                 "files": [str(tmp_path / "cache/x.run"), str(tmp_path / "cache/x.run.part")]}
    arguments.update(overrides)
    return fact_output(CudaToolkits(), **arguments)


def test_toolkits_fact_on_a_pre_upgrade_tree(tmp_path):
    write_toolkit_tree(tmp_path / "usr/local/cuda-12.8")
    (tmp_path / "usr/local/cuda").symlink_to("cuda-12.8")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache/x.run.part").write_bytes(b"x" * 1000)
    state = toolkits(tmp_path)
    assert state.arch == os.uname().machine
    assert not state.install.exists
    assert state.kept == {str(tmp_path / "usr/local/cuda-12.8"): True}
    assert state.link.hops == ((str(tmp_path / "usr/local/cuda"), "cuda-12.8"),)
    assert state.link.kind == "link" and state.link.resolved == str(tmp_path / "usr/local/cuda-12.8")
    assert state.files[str(tmp_path / "cache/x.run")] is None
    assert state.files[str(tmp_path / "cache/x.run.part")].size == 1000
    assert state.record is None and state.marker is None


def test_toolkits_fact_reads_an_installed_toolkit(tmp_path):
    write_toolkit_tree(tmp_path / "usr/local/cuda-13.0", "13.0.1", "13.0.88")
    install = toolkits(tmp_path).install
    assert install.exists and install.nvcc.version == "13.0.88"
    assert install.version_json["cuda"]["version"] == "13.0.1"
    assert install.dpkg_owner is None and install.nvcc_error is None


def test_toolkits_fact_reads_records_with_escapes(tmp_path):
    # Recorded nvcc text holds "\n" escapes: the fact must not turn them into line breaks.
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    record = {"schema": 1, "toolkits": {"/x": {"nvcc": "line one\nline two"}}}
    (state_dir / "toolkits.json").write_text(json.dumps(record, indent=1))
    (state_dir / "toolkit-install.json").write_text(json.dumps({"path": "/p", "run_id": "r"}))
    state = toolkits(tmp_path)
    assert state.record == record and not state.record_invalid
    assert state.marker == {"path": "/p", "run_id": "r"}


def test_toolkits_fact_on_an_empty_dir_and_a_broken_nvcc(tmp_path):
    (tmp_path / "usr/local/cuda-13.0").mkdir(parents=True)
    assert toolkits(tmp_path).install.empty
    nvcc = tmp_path / "usr/local/cuda-13.0/bin/nvcc"
    nvcc.parent.mkdir()
    nvcc.write_bytes(b"\x7fELF\x02\x01\x01" + b"\x00" * 57)
    nvcc.chmod(0o755)
    install = toolkits(tmp_path).install
    assert install.exists and not install.empty
    assert install.nvcc is None and "failed" in install.nvcc_error


@pytest.mark.parametrize("entry", [".hidden", "..dots", "-dash", "dangling-link", "sub/"])
def test_a_tree_holding_any_single_entry_is_not_empty_as_ls_A_says(tmp_path, entry):
    tree = tmp_path / "usr/local/cuda-13.0"
    tree.mkdir(parents=True)
    if entry == "dangling-link":
        (tree / entry).symlink_to(tmp_path / "nowhere")
    elif entry.endswith("/"):
        (tree / entry).mkdir()
    else:
        (tree / entry).write_text("")
    assert subprocess.run(["ls", "-A", str(tree)], capture_output=True, text=True).stdout.strip()
    install = toolkits(tmp_path).install
    assert install.exists and not install.empty


def test_link_chain_through_alternatives_like_the_real_host(tmp_path):
    # The real host: /usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0
    assert fixture_lines("cuda-links.txt")[0].endswith("cuda -> /etc/alternatives/cuda")
    (tmp_path / "usr/local/cuda-13.0").mkdir(parents=True)
    (tmp_path / "etc/alternatives").mkdir(parents=True)
    (tmp_path / "etc/alternatives/cuda").symlink_to(tmp_path / "usr/local/cuda-13.0")
    (tmp_path / "usr/local/cuda").symlink_to(tmp_path / "etc/alternatives/cuda")
    chain = toolkits(tmp_path).link
    assert [target for _, target in chain.hops] == [str(tmp_path / "etc/alternatives/cuda"),
                                                    str(tmp_path / "usr/local/cuda-13.0")]
    assert chain.resolved == str(tmp_path / "usr/local/cuda-13.0")
    assert chain.describe() == (f"{tmp_path}/usr/local/cuda -> {tmp_path}/etc/alternatives/cuda -> "
                                f"{tmp_path}/usr/local/cuda-13.0")
    assert LinkChain.from_record(json.loads(json.dumps(chain.to_record()))) == chain


def test_link_chain_absent_dangling_and_directory(tmp_path):
    assert toolkits(tmp_path).link.kind == "absent"
    (tmp_path / "usr/local").mkdir(parents=True)
    (tmp_path / "usr/local/cuda").symlink_to("cuda-99.9")
    chain = toolkits(tmp_path).link
    assert chain.kind == "dangling" and chain.describe().endswith("(dangling)")
    (tmp_path / "usr/local/cuda").unlink()
    (tmp_path / "usr/local/cuda").mkdir()
    chain = toolkits(tmp_path).link
    assert chain.kind == "directory" and chain.hops == ()


def test_fingerprint_reports_a_changed_size_or_file_list_as_such(tmp_path):
    root = write_toolkit_tree(tmp_path / "cuda-12.8")
    before = fact_output(ToolkitFingerprint(), path=str(root))
    assert before.present and before.nvcc_version == "12.8.93" and before.files > 20
    assert fact_output(ToolkitFingerprint(), path=str(root)) == before
    (root / "targets/x86_64-linux/include/cuda.h").write_text("changed, and longer than before\n" * 3)
    after = fact_output(ToolkitFingerprint(), path=str(root))
    assert before.differences(after) == [f"file list or sizes changed ({before.files} files before, "
                                         f"{after.files} now)"]
    (root / "extra").write_text("")
    assert fact_output(ToolkitFingerprint(), path=str(root)).files == before.files + 1


def rewrite_keeping_the_size(path: Path, seconds_later: int = 1) -> os.stat_result:
    """Other bytes of the same length, written `seconds_later` than the file was (the clock the kernel stamps
    files with can give a write right after another the same time); returns the file's stat from before."""
    before = path.stat()
    path.write_bytes(bytes(byte ^ 0xFF for byte in path.read_bytes()))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + seconds_later * 10**9))
    return before


def test_fingerprint_sees_a_file_rewritten_with_its_size_unchanged(tmp_path):
    root = write_toolkit_tree(tmp_path / "cuda-12.8")
    header = root / "targets/x86_64-linux/include/cuda.h"
    before = fact_output(ToolkitFingerprint(), path=str(root))
    was = rewrite_keeping_the_size(header)
    after = fact_output(ToolkitFingerprint(), path=str(root))
    assert (after.files, after.files_sha256) == (before.files, before.files_sha256)   # list and sizes: the same
    assert before.differences(after) == [f"a file was rewritten with its size unchanged: same {before.files} "
                                         "files and sizes, other modification times"]
    os.utime(header, ns=(was.st_atime_ns, was.st_mtime_ns))     # what it cannot see: the time put back
    assert before.differences(fact_output(ToolkitFingerprint(), path=str(root))) == []


def test_a_record_made_before_fingerprints_had_times_is_compared_without_them(tmp_path):
    root = write_toolkit_tree(tmp_path / "cuda-12.8")
    record = fact_output(ToolkitFingerprint(), path=str(root)).to_record()
    old = Fingerprint.from_record(str(root), {key: value for key, value in record.items() if key != "mtimes_sha256"})
    rewrite_keeping_the_size(root / "targets/x86_64-linux/include/cuda.h")
    now = fact_output(ToolkitFingerprint(), path=str(root))
    assert old.mtimes_sha256 is None and old.differences(now) == []
    (root / "extra").write_text("")
    assert old.differences(fact_output(ToolkitFingerprint(), path=str(root)))[0].startswith("file list or sizes")


def test_fingerprint_round_trips_through_the_record(tmp_path):
    root = write_toolkit_tree(tmp_path / "cuda-12.8")
    now = fact_output(ToolkitFingerprint(), path=str(root))
    again = Fingerprint.from_record(str(root), json.loads(json.dumps(now.to_record())))
    assert again.differences(now) == []
    gone = fact_output(ToolkitFingerprint(), path=str(tmp_path / "missing"))
    assert not gone.present and again.differences(gone) == ["was present, now missing"]


def test_fingerprint_counts_and_hashes_the_sorted_listing_with_shell_builtins(tmp_path):
    """Entries named with glob characters, spaces and tabs count once each (no word splitting but
    on newlines, no globbing); the hashes are the sorted listing's and the sorted files' times' (find's
    own, read by a second find here); no grep, cut or sed is started."""
    root = write_toolkit_tree(tmp_path / "cuda-12.8")
    for name in ("a*b", "sp ace", "tab\tname", "[x]"):
        (root / name).write_text(name)
    (root / "empty-dir").mkdir()
    listing = subprocess.run(
        ["sh", "-c", f"find {root}/ -mindepth 1 \\( -type f -printf 'f\\t%P\\t%s\\n' \\) -o \\( -type l -printf "
                     "'l\\t%P\\t%l\\n' \\) -o -printf '%y\\t%P\\n' | LC_ALL=C sort"],
        capture_output=True, text=True, check=True).stdout
    times = subprocess.run(["sh", "-c", f"find {root}/ -mindepth 1 -type f -printf 't\\t%P\\t%T@\\n' | LC_ALL=C sort"],
                           capture_output=True, text=True, check=True).stdout
    bin_dir, log = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    for name in ("grep", "cut", "sed"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {log}\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    out = subprocess.run(["sh", "-c", fingerprint_command(str(root))], capture_output=True, text=True, check=True,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}).stdout
    found = parse_fingerprint(str(root), out.splitlines())
    assert found.files == len(listing.splitlines()) and found.nvcc_version == "12.8.93"
    assert found.files_sha256 == hashlib.sha256(listing.encode()).hexdigest()
    assert found.mtimes_sha256 == hashlib.sha256(times.encode()).hexdigest()
    assert not log.exists()


def test_runfile_digest_reads_size_md5_and_sha256(tmp_path):
    path = tmp_path / "x.run"
    path.write_bytes(b"hello")
    digest = fact_output(RunfileDigest(), path=str(path))
    assert digest.stat.size == 5
    assert digest.md5 == "5d41402abc4b2a76b9719d911017c592"
    assert digest.sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert not fact_output(RunfileDigest(), path=str(tmp_path / "nope")).present


def logging_path(tmp_path, names) -> tuple[dict, Path]:
    """A PATH whose `names` log their name to a file, then run the real program."""
    import shutil

    bin_dir, log = tmp_path / "logging-bin", tmp_path / "started"
    bin_dir.mkdir()
    for name in names:
        real = shutil.which(name)
        if real:
            (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {log}\nexec {real} \"$@\"\n")
            (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def converged_toolkits(tmp_path) -> dict:
    """A converged host's toolkits under tmp_path: 13.0 and the kept 12.8 (stand-in trees), the link
    through an alternatives link, the record, a cached runfile (one with a space in its name)."""
    install = write_toolkit_tree(tmp_path / "cuda-13.0", version="13.0.1", nvcc_version="13.0.88")
    kept = write_toolkit_tree(tmp_path / "cuda-12.8")
    (tmp_path / "alternatives").mkdir()
    (tmp_path / "alternatives" / "cuda").symlink_to(install)
    (tmp_path / "cuda").symlink_to("alternatives/cuda")
    state = tmp_path / "state"
    state.mkdir()
    (state / "toolkits.json").write_text('{"schema": 1,\n "target": {"version": "13.0.1"}}\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cuda.run").write_bytes(b"runfile")
    (cache / "pre staged.run").write_bytes(b"staged")
    return {"install_path": str(install), "keep_paths": (str(kept), str(tmp_path / "cuda-12.6")),
            "link_path": str(tmp_path / "cuda"), "state_dir": str(state) + "/",
            "files": (str(cache / "cuda.run"), str(cache / "cuda.run.part"), str(cache / "pre staged.run"))}


def test_the_toolkits_state_of_a_converged_host(tmp_path):
    """Each part of CudaToolkits against what Python reads of the same files."""
    arguments = converged_toolkits(tmp_path)
    state = fact_output(CudaToolkits(), **arguments)
    assert state.arch == os.uname().machine
    assert state.install.exists and not state.install.empty and state.install.nvcc.version == "13.0.88"
    assert state.install.version_json == json.loads((tmp_path / "cuda-13.0" / "version.json").read_text())
    assert state.kept == {str(tmp_path / "cuda-12.8"): True, str(tmp_path / "cuda-12.6"): False}
    assert state.link == LinkChain(str(tmp_path / "cuda"),
                                   ((str(tmp_path / "cuda"), "alternatives/cuda"),
                                    (str(tmp_path / "alternatives/cuda"), str(tmp_path / "cuda-13.0"))),
                                   str(tmp_path / "cuda-13.0"), "link")
    assert state.record == {"schema": 1, "target": {"version": "13.0.1"}} and state.marker is None
    for path in arguments["files"]:
        if os.path.exists(path):
            stat = os.stat(path)
            assert (state.files[path].size, state.files[path].mtime, state.files[path].inode) == (
                stat.st_size, int(stat.st_mtime), stat.st_ino)
        else:
            assert state.files[path] is None


def test_the_toolkits_state_starts_only_uname_nvcc_readlink_and_one_stat(tmp_path):
    """It runs twice on every converge: builtins read the small files, resolve the link's directory
    and test the trees; one `stat` serves every runfile path."""
    arguments = converged_toolkits(tmp_path)
    env, log = logging_path(tmp_path, ("uname", "readlink", "stat", "tr", "sed", "head", "cat", "grep", "dpkg",
                                       "pwd", "ls", "find"))
    nvcc = Path(arguments["install_path"]) / "bin" / "nvcc"
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    nvcc.write_text(f"#!/bin/sh\necho nvcc >> {log}\nprintf '%s' {shlex.quote(text)}\n")   # no `cat`
    result = subprocess.run(["sh", "-c", CudaToolkits().command(**arguments)], capture_output=True, text=True,
                            env=env, check=True)
    assert "tree_nvcc_exit 0" in result.stdout.splitlines()
    # readlink: the link, then its hop through alternatives
    assert sorted(log.read_text().split()) == ["nvcc", "readlink", "readlink", "stat", "uname"]


def test_a_tree_without_version_json_is_judged_by_the_dpkg_package_that_lists_its_nvcc(tmp_path):
    """dpkg -S runs only when one grep over the package lists finds bin/nvcc there."""
    tree = write_toolkit_tree(tmp_path / "cuda-13.0", version="13.0.1", nvcc_version="13.0.88")
    (tree / "version.json").unlink()
    admin = tmp_path / "dpkg"
    (admin / "info").mkdir(parents=True)
    (admin / "diversions").write_text("")
    bin_dir, log = tmp_path / "bin", tmp_path / "dpkg.log"
    bin_dir.mkdir()
    (bin_dir / "dpkg").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho \"cuda-nvcc-13-0: $2\"\n")
    (bin_dir / "dpkg").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DPKG_ADMINDIR": str(admin)}

    def tree_read():
        out = subprocess.run(["sh", "-c", CudaToolkits().command(str(tree), (), str(tmp_path / "cuda"),
                                                                  str(tmp_path / "state"))],
                             capture_output=True, text=True, env=env, check=True).stdout
        return parse_tree(str(tree), out.splitlines())

    assert tree_read().dpkg_owner is None and not log.exists()
    (admin / "info" / "cuda-nvcc-13-0.list").write_text(f"/usr\n{tree}/bin/nvcc\n")
    assert tree_read().dpkg_owner == "cuda-nvcc-13-0"
    assert log.read_text() == f"-S {tree}/bin/nvcc\n"
