"""The ML environment state's memo (facts/venv.py, files/scripts/ml_env.py, servestack/memo.py).

The fact's real command runs here with `sh -c` against a pretend host under tmp_path (venv_path,
releases, state dir, uv), its `python3` a wrapper on PATH that notes every start: a kept memo
answers without one, and anything the state was read from that changes brings python back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyinfra.api import State
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops

import facts.venv
import operations.releases
from facts.venv import MEMO_HEADER, MlEnvState, memo_path, memo_write_command
from operations.releases import HEREDOC, TOOL, encode
from operations.venv import activate_release, backup_env, mlenv_fact_arguments
from servestack import memo, probe
from servestack.settings import host_settings
from tests.unit.fake_host import fake_state, run_here

ACTIVE, OTHER = "r-0123456789ab", "r-ba9876543210"
REAL_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def settle() -> None:
    """Let the racy second pass: what was just written may be kept in a memo."""
    time.sleep(memo.RACY_NS / 1e9 + 0.1)


def release(root: Path, name: str) -> None:
    directory = root / "releases" / name
    (directory / "venv").mkdir(parents=True)
    (directory / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (directory / "release.json").write_text(json.dumps({"id": name, "status": "ok"}))


def fake_uv(path: Path, version: str) -> None:
    path.write_text(f"#!/bin/sh\necho 'uv {version} (abc 2026-01-01)'\n")
    path.chmod(0o755)


class Host:
    """A pretend host under `root`: venv_path links to release ACTIVE, OTHER is kept beside it."""

    def __init__(self, root: Path):
        self.root = root
        self.venv_path = root / "opt" / "ml-env"
        self.releases_dir = root / "releases"
        self.state_dir = root / "state"
        self.uv = root / "uv" / "bin" / "uv"
        for name in (ACTIVE, OTHER):
            release(root, name)
        self.venv_path.parent.mkdir()
        self.venv_path.symlink_to(self.releases_dir / ACTIVE / "venv")
        (self.state_dir / "backups").mkdir(parents=True)
        (self.state_dir / "backups" / "20260101T000000Z.json").write_text(json.dumps({"release": OTHER}))
        (self.state_dir / "releases.json").write_text(json.dumps({"activations": [
            {"release": ACTIVE, "previous": OTHER, "by": "deploy", "at": "20260101T000000Z"}]}))
        self.uv.parent.mkdir(parents=True)
        fake_uv(self.uv, "0.13.9")
        # `python3` as the shell finds it: the real one, noting each start outside the inputs; PATH
        # searches `local` first, where there is none
        self.local, self.bin = root / "local", root / "bin"
        self.local.mkdir()
        self.bin.mkdir()
        self.started = root / "python-started"
        wrapper = self.bin / "python3"
        wrapper.write_text(f"#!/bin/sh\necho started >> {self.started}\nexec {REAL_PYTHON} \"$@\"\n")
        wrapper.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{self.local}:{self.bin}:/usr/bin:/bin"}

    def arguments(self, **overrides) -> dict:
        return {"venv_path": str(self.venv_path), "releases_dir": str(self.releases_dir),
                "state_dir": str(self.state_dir), "uv": str(self.uv), "python": "python3", "packages": False,
                **overrides}

    def starts(self) -> int:
        return len(self.started.read_text().splitlines()) if self.started.exists() else 0

    def sh(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=self.env)

    def read(self, **overrides) -> tuple[dict, bool]:
        """(the fact's value, whether python started) as pyinfra would read it."""
        before = self.starts()
        fact = MlEnvState()
        result = self.sh(fact.command(**self.arguments(**overrides)))
        assert result.returncode == 0, result.stderr
        return fact.process(result.stdout.splitlines()), self.starts() > before

    def keep(self, value: dict) -> None:
        """What the venv operations do with an answer's memo (at the lock's release)."""
        assert value["memo"], "a settled host gives a memo"
        assert self.sh(memo_write_command(str(self.state_dir), value["memo"])).returncode == 0
        assert Path(memo_path(str(self.state_dir))).is_file()


@pytest.fixture
def host(tmp_path) -> Host:
    made = Host(tmp_path)
    settle()
    return made


def without_memo(value: dict) -> dict:
    return {key: item for key, item in value.items() if key != "memo"}


def kept(host: Host) -> dict:
    """Read the state with python, keep its memo; its answer."""
    value, started = host.read()
    assert started
    host.keep(value)
    return value


# --- the host tool -------------------------------------------------------------------------------


def run_state(params: dict) -> dict:
    result = subprocess.run([REAL_PYTHON, "-I", "-S", "-", "state", encode(params)], input=TOOL.read_text(),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_state_carries_a_memo_only_when_asked_and_without_packages(host):
    spec = {"python": "python3", "lib": memo.source(), "header": f"{MEMO_HEADER} {'d' * 64}"}
    paths = {key: value for key, value in host.arguments().items() if key not in ("python", "packages")}
    with_memo = run_state({**paths, "packages": False, "memo": spec})
    assert with_memo["memo"].startswith(f"{MEMO_HEADER} {'d' * 64}\n")
    assert "memo" not in run_state({**paths, "packages": True, "memo": spec})  # the venv's python ran
    assert "memo" not in run_state({**paths, "packages": False})  # the tool run on its own
    assert without_memo(with_memo) == run_state({**paths, "packages": False})


def test_writing_the_memo_imports_nothing_costly(host):
    """`state` runs on every converge: the memo must not bring back what the tool avoids importing."""
    params = {**{key: value for key, value in host.arguments().items() if key != "python"},
              "memo": {"python": "python3", "lib": memo.source(), "header": f"{MEMO_HEADER} {'d' * 64}"}}
    result = subprocess.run([REAL_PYTHON, "-I", "-S", "-X", "importtime", "-", "state", encode(params)],
                            input=TOOL.read_text(), capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout)["memo"], result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert imported & {"subprocess", "shlex", "hashlib", "datetime", "base64", "pathlib", "struct"} == set()


def test_the_memo_names_every_path_the_state_was_read_from(host):
    value, _ = host.read()
    lines = value["memo"].splitlines()
    named = {line[2:] for line in lines if line[:2] in ("P ", "A ")}
    release_files = {str(host.releases_dir / name / leaf) for name in (ACTIVE, OTHER)
                     for leaf in ("release.json", "venv/pyvenv.cfg")}
    assert named >= {str(host.venv_path.parent), str(host.venv_path), str(host.releases_dir), str(host.uv),
                     str(host.state_dir / "releases.json"), str(host.state_dir / "backups"),
                     str(host.state_dir / "backups" / "20260101T000000Z.json"), value["python"]["executable"],
                     str(host.local), str(host.bin)} | release_files
    assert str(host.state_dir) not in named  # the lock and the memo itself live there
    assert lines[-2] == f"R {len(lines[-1])}" and json.loads(lines[-1]) == without_memo(value)


# --- the fact's shell ------------------------------------------------------------------------------


def test_a_kept_memo_answers_without_starting_python(host):
    value = kept(host)
    again, started = host.read()
    assert not started
    assert again == without_memo(value)
    assert again["releases"].keys() == {ACTIVE, OTHER} and again["uv"] == "0.13.9"


def test_the_packages_are_always_read_by_python(host):
    kept(host)
    value, started = host.read(packages=True)
    assert started and "memo" not in value


def _add_release(host: Host) -> None:
    release(host.root, "r-aaaaaaaaaaaa")


def _remove_release(host: Host) -> None:
    shutil.rmtree(host.releases_dir / OTHER)


def _rewrite_a_record(host: Host) -> None:
    record = host.releases_dir / OTHER / "release.json"
    record.write_text(record.read_text().replace('"ok"', '"failed"'))


def _repoint_the_link(host: Host) -> None:
    temporary = host.venv_path.with_name("ml-env.new")
    temporary.symlink_to(host.releases_dir / OTHER / "venv")
    os.replace(temporary, host.venv_path)


def _add_a_backup(host: Host) -> None:
    (host.state_dir / "backups" / "20260102T000000Z.json").write_text(json.dumps({"release": ACTIVE}))


def _rewrite_the_history(host: Host) -> None:
    (host.state_dir / "releases.json").write_text(json.dumps({"activations": []}))


def _replace_uv(host: Host) -> None:
    temporary = host.uv.with_name("uv.new")
    fake_uv(temporary, "0.14.0")
    os.replace(temporary, host.uv)


def _remove_a_venv(host: Host) -> None:
    (host.releases_dir / OTHER / "venv" / "pyvenv.cfg").unlink()


@pytest.mark.parametrize("change, seen", [
    (_add_release, lambda value: "r-aaaaaaaaaaaa" in value["releases"]),
    (_remove_release, lambda value: OTHER not in value["releases"]),
    (_rewrite_a_record, lambda value: value["releases"][OTHER]["status"] == "failed"),
    (_repoint_the_link, lambda value: value["venv_path"]["release"] == OTHER),
    (_add_a_backup, lambda value: value["backups"][-1] == "20260102T000000Z.json"),
    (_rewrite_the_history, lambda value: value["history"] == []),
    (_replace_uv, lambda value: value["uv"] == "0.14.0"),
    (_remove_a_venv, lambda value: value["releases"][OTHER]["has_venv"] is False),
])
def test_any_change_to_what_the_state_was_read_from_brings_python_back(host, change, seen):
    kept(host)
    change(host)
    value, started = host.read()
    assert started and seen(value)


def test_a_python_put_earlier_on_path_brings_python_back(host):
    kept(host)
    (host.local / "python3").symlink_to(host.bin / "python3")  # e.g. one installed in /usr/local/bin
    assert host.read()[1]


def test_a_memo_for_other_settings_or_another_servestack_is_not_used(host, monkeypatch, tmp_path):
    kept(host)
    assert host.read(releases_dir=str(host.releases_dir) + "/")[1]  # other params: another digest
    assert host.read(python=str(host.bin / "python3"))[1]  # another interpreter
    newer = tmp_path / "ml_env.py"
    newer.write_text(TOOL.read_text() + "\n# another servestack version\n")
    monkeypatch.setattr(facts.venv, "TOOL", newer)
    monkeypatch.setattr(operations.releases, "TOOL", newer)
    value, started = host.read()
    assert started and value["memo"] and value["memo"].split("\n", 1)[0] != memo_header(host)
    monkeypatch.undo()
    assert not host.read()[1]  # the kept memo still answers the servestack that kept it


def memo_header(host: Host) -> str:
    return Path(memo_path(str(host.state_dir))).read_text().split("\n", 1)[0]


def test_no_memo_for_what_changed_within_the_racy_second(host):
    _rewrite_the_history(host)
    value, started = host.read()
    assert started and value["memo"] is None
    settle()
    assert host.read()[0]["memo"]


def _garbage(text: str) -> str:
    return "\x00\x01 not a memo\nR 2\n{}\n"


def _cut_in_the_answer(text: str) -> str:
    return text[:-20]


def _longer_answer(text: str) -> str:
    return text.rstrip("\n") + ' "x"\n'


def _no_length(text: str) -> str:
    head, answer = text.rstrip("\n").rsplit("\n", 1)
    return head.rsplit("\n", 1)[0] + "\nR\n" + answer + "\n"


def _a_stat_line_edited(text: str) -> str:
    return text.replace("\nS ", "\nS 1", 1)


def _an_input_dropped(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("P ")) or "x"


def _header_only(text: str) -> str:
    return text.split("\n", 1)[0] + "\n"


def _empty(text: str) -> str:
    return ""


@pytest.mark.parametrize("corrupt", [_garbage, _cut_in_the_answer, _longer_answer, _no_length, _a_stat_line_edited,
                                     _an_input_dropped, _header_only, _empty])
def test_a_corrupt_memo_falls_back_to_python(host, corrupt):
    value = kept(host)
    path = Path(memo_path(str(host.state_dir)))
    path.write_text(corrupt(path.read_text()))
    again, started = host.read()
    assert started and without_memo(again) == without_memo(value)


def test_a_directory_at_the_memo_path_falls_back_to_python(host):
    Path(memo_path(str(host.state_dir))).mkdir()
    assert host.read()[1]


def test_a_memo_whose_paths_changed_since_the_read_is_not_written(host):
    value, _ = host.read()
    _add_a_backup(host)  # e.g. a later step of the same run
    result = host.sh(memo_write_command(str(host.state_dir), value["memo"]))
    assert result.returncode == 0, result.stderr  # not writing it is no failure
    assert not Path(memo_path(str(host.state_dir))).exists()
    assert not Path(memo_path(str(host.state_dir)) + ".tmp").exists()


# --- the venv operations keep it ---------------------------------------------------------------------


def make_state(host: Host, **options) -> State:
    return fake_state({"venv_path": str(host.venv_path), "venv_releases_dir": str(host.releases_dir),
                       "servestack_state_dir": str(host.state_dir), "uv_install_dir": str(host.uv.parent.parent),
                       "venv_python": "python3"}, **options)


@pytest.fixture
def run_locally(monkeypatch, host):
    """The @fake connector, but the commands aimed at the pretend host really run there."""
    run_here(monkeypatch, lambda command: str(host.root) in command or HEREDOC in command,  # params: base64
             host.sh)


def fake_host(state: State):
    return state.inventory.get_host("@fake/gpu1")


def test_the_operation_keeps_the_memo_at_execute_never_in_a_dry_run(host, run_locally):
    memo_file = Path(memo_path(str(host.state_dir)))
    dry = make_state(host)
    add_op(dry, activate_release, release=ACTIVE)
    assert dry.get_meta_for_host(fake_host(dry)).ops_no_change == 1
    assert not memo_file.exists()  # prepare (and so --dry) writes nothing

    converged = make_state(host)
    add_op(converged, activate_release, release=ACTIVE)
    run_ops(converged)
    assert converged.get_meta_for_host(fake_host(converged)).ops_change == 0
    assert memo_file.is_file()
    value, started = host.read()
    assert not started and "memo" not in value

    again = make_state(host)  # answered from the memo: nothing to keep
    add_op(again, activate_release, release=ACTIVE)
    kept_before = memo_file.stat()
    run_ops(again)
    assert memo_file.stat().st_ino == kept_before.st_ino


def test_under_yes_the_memo_read_at_prepare_is_kept_at_execute(host, run_locally):
    state = make_state(host, check_for_changes=False)  # pyinfra -y: operations do not run at prepare
    target = fake_host(state)
    settings = host_settings(target)
    assert probe.fact(target, MlEnvState, **mlenv_fact_arguments(settings))["memo"]  # a deploy function's read
    reads = host.starts()
    add_op(state, activate_release, release=ACTIVE)
    assert not Path(memo_path(str(host.state_dir))).exists()
    run_ops(state)
    assert host.starts() == reads  # execute started from prepare's read
    assert Path(memo_path(str(host.state_dir))).is_file()
    assert not host.read()[1]


def test_no_memo_is_kept_once_a_venv_operation_changed_the_host(host, run_locally, monkeypatch):
    # No racy second here: the read after the change would carry a memo, but this run changed the host.
    shipped = memo.source().replace("RACY_NS = 1000000000", "RACY_NS = -10**18")
    monkeypatch.setattr(memo, "source", lambda: shipped)
    state = make_state(host)
    add_op(state, activate_release, release=OTHER)
    add_op(state, backup_env, target=OTHER)
    run_ops(state)
    assert os.readlink(host.venv_path) == str(host.releases_dir / OTHER / "venv")
    settings = host_settings(fake_host(state))
    assert probe.cached(fake_host(state), MlEnvState, **mlenv_fact_arguments(settings))["memo"]  # read after it
    assert not Path(memo_path(str(host.state_dir))).exists()
