"""The one output framing (facts/framing.py) and the batch of facts built on it (facts/batch.py).

Everything here runs with `sh` on this machine; the fact commands are read-only (`sha256sum` of a
temporary file, `cat /etc/group`, `printf`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest
from pyinfra.api import FactBase
from pyinfra.facts.files import Sha256File
from pyinfra.facts.server import Groups, Which

from facts.batch import MAX_COMMAND_CHARS, FactBatch, FactRequest, Unread, batches, section_name
from facts.framing import BEGIN, END, Section, framed, split
from servestack.pyinfra_hooks import MISSING_COMMAND_MARKER
from servestack.scripts import HELPERS, script_text


def run_locally(command: str, shell: str = "sh") -> list[str]:
    return subprocess.run([shell, "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()


def read_batch(requests) -> dict[str, Section]:
    """Run a FactBatch here as pyinfra would run it on a host, and split its output."""
    return FactBatch().process(run_locally(FactBatch().command(tuple(requests))))


class Printf(Which):
    def command(self, command):
        return f"printf '{command}'"


class Echo(Which):
    def command(self, command):
        return f"echo {command}"


class SlowEcho(Echo):
    slow = True


# --- framing --------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["", "\\n", "a", "a\\n", "a\\n\\n", "\\na\\n\\nb", "a\\n\\n\\n"])
def test_a_sections_lines_are_the_commands_lines_run_alone(output):
    lines = run_locally(framed("x", f"printf '{output}'") + "; " + framed("y", "echo after"))
    assert split(lines) == {"x": Section(0, tuple(run_locally(f"printf '{output}'"))), "y": Section(0, ("after",))}


def test_output_without_a_final_newline_keeps_its_end_marker_apart():
    lines = run_locally(framed("a", "printf no-newline") + "; " + framed("b", "printf x; exit 4"))
    assert split(lines) == {"a": Section(0, ("no-newline",)), "b": Section(4, ("x",))}


def test_a_section_runs_with_stdin_closed_and_its_exit_does_not_end_the_script():
    lines = run_locally(framed("a", "cat; exit 2") + "; echo still-here", shell="sh")
    assert split(lines) == {"a": Section(2, ())} and lines[-1] == "still-here"


def test_a_failing_command_is_reported_with_its_status_and_a_cut_section_with_none():
    lines = [f"{BEGIN}0", "partial", "", f"{END}0 3", "outside any section", f"{BEGIN}1", "cut"]
    found = split(lines)
    assert found == {"0": Section(3, ("partial",)), "1": Section(None, ("cut",))}
    assert not found["0"].ok and not found["1"].ok and found["0"].text == "partial"


def test_sections_nest_so_a_script_that_frames_its_own_output_reads_in_a_batch():
    inner = [f"{BEGIN}gpu", "x", "", f"{END}gpu 0"]
    assert split([f"{BEGIN}fact-0", *inner, "", f"{END}fact-0 0", f"{BEGIN}fact-1", "y", "", f"{END}fact-1 0"]) == {
        "fact-0": Section(0, tuple(inner)), "fact-1": Section(0, ("y",))}
    assert split(run_locally(framed("outer", framed("inner", "echo deep"))))["outer"].lines == (
        f"{BEGIN}inner", "deep", "", f"{END}inner 0")


def test_section_text_joins_its_lines():
    assert Section(0, ("a", "", "b")).text == "a\n\nb" and Section(0, ()).ok


@pytest.mark.parametrize("printed", ["", "a", "a\\n", "a\\n\\n", "\\na\\nb\\n"])
@pytest.mark.parametrize("status", [0, 5])
def test_the_shell_section_function_frames_as_framed_does(printed, status):
    """Scripts in files/scripts frame with helpers.sh's `section NAME CMD...`: the parser reads it alike."""
    command = f"printf '{printed}'; exit {status}"
    from_python = split(run_locally(framed("s", command)))
    from_shell = split(run_locally(f"{script_text(HELPERS)}\nsection s sh -c \"{command}\"", shell="bash"))
    assert from_shell == from_python
    assert from_shell["s"].rc == status


# --- a batch of facts -----------------------------------------------------------------------


def test_each_fact_gets_its_own_output_and_exit_status(tmp_path):
    (tmp_path / "a").write_text("hello\n")
    requests = (FactRequest.of(Sha256File, path=str(tmp_path / "a")),
                FactRequest.of(Sha256File, path=str(tmp_path / "missing")),
                FactRequest.of(Groups))
    found = read_batch(requests)
    assert [found[section_name(index)].rc for index in range(3)] == [0, 0, 0]
    values = [request.value(found[section_name(index)]) for index, request in enumerate(requests)]
    assert values[0] == run_locally(f"sha256sum {tmp_path / 'a'}")[0].split()[0]
    assert values[1] is None
    assert "root" in values[2]


def test_in_a_batch_outputs_read_as_the_commands_alone():
    requests = (FactRequest.of(Printf, command="no-newline"), FactRequest.of(Printf, command="x\\n\\n"),
                FactRequest.of(Echo, command="y; exit 4"))
    assert read_batch(requests) == {section_name(0): Section(0, ("no-newline",)),
                                    section_name(1): Section(0, ("x", "")),
                                    section_name(2): Section(4, ("y",))}


def test_a_fact_whose_command_failed_or_was_cut_is_unread():
    request = FactRequest.of(Echo, command="x")
    for section in (Section(1, ("x",)), Section(None, ("x",))):
        with pytest.raises(Unread) as raised:
            request.value(section)
        assert raised.value.request == request
    assert request.value(Section(0, ("x",))) == "x"


def test_an_empty_output_is_the_facts_default_a_copy_each_time():
    shared = {"found": []}

    class WithDefault(Echo):
        @staticmethod
        def default():
            return shared

    request = FactRequest.of(WithDefault, command="")
    value = request.value(Section(0, ()))
    assert value == shared and value is not shared
    value["found"].append(1)
    assert shared == {"found": []}


class NeedsTool(Echo):
    def requires_command(self, command):
        return "no-such-tool-here"


class NeedsSh(Echo):
    requires_command = "sh"


def test_requires_command_guard_prints_pyinfras_marker_when_the_tool_is_missing():
    missing = FactRequest.of(NeedsTool, command="ran")
    assert missing.command().startswith("if command -v no-such-tool-here")
    assert run_locally(missing.command()) == [MISSING_COMMAND_MARKER]
    found = read_batch((missing, FactRequest.of(NeedsSh, command="ran")))
    assert found[section_name(0)] == Section(0, (MISSING_COMMAND_MARKER,))
    assert found[section_name(1)] == Section(0, ("ran",))
    with pytest.raises(Unread):  # read alone, pyinfra decides what a missing command means
        missing.value(found[section_name(0)])
    assert FactRequest.of(NeedsSh, command="ran").value(found[section_name(1)]) == "ran"


def programs_started(tmp_path, requests) -> tuple[dict, list[str]]:
    """Run a batch with mktemp, cat, rm and tail logging each start: (its sections, the starts)."""
    (tmp_path / "bin").mkdir()
    log = tmp_path / "started"
    log.write_text("")
    for name in ("mktemp", "cat", "rm", "tail"):
        real = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        wrapper = tmp_path / "bin" / name
        wrapper.write_text(f"#!/bin/sh\necho {name} >> {log}\nexec {real} \"$@\"\n")
        wrapper.chmod(0o755)
    lines = subprocess.run(["sh", "-c", FactBatch().command(tuple(requests))], capture_output=True, text=True,
                           check=True, env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}).stdout.splitlines()
    return FactBatch().process(lines), sorted(log.read_text().split())


def test_a_batch_starts_no_program_for_facts_that_start_none(tmp_path):
    """Framing a fact's output costs forks only: ten facts that start no program start none."""
    requests = [FactRequest.of(Echo, command=str(i)) for i in range(10)]
    assert programs_started(tmp_path, requests) == ({section_name(i): Section(0, (str(i),)) for i in range(10)}, [])


def test_slow_facts_cost_mktemp_cat_and_rm_once(tmp_path):
    requests = [FactRequest.of(SlowEcho if i % 3 == 0 else Echo, command=str(i)) for i in range(10)]
    assert [request.slow for request in requests[:3]] == [True, False, False]
    assert programs_started(tmp_path, requests) == ({section_name(i): Section(0, (str(i),)) for i in range(10)},
                                                     ["cat", "mktemp", "rm"])


def test_slow_facts_run_together_in_the_background_and_beside_the_others(tmp_path):
    """Each slow fact waits (up to 10 s) for a file that a later fact creates: the batch ends with
    every fact done only if the slow ones run at once and the others meanwhile."""
    def waits_for(name):
        path = tmp_path / name
        return (f"i=0; while [ ! -e {path} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
                f"test -e {path} && echo saw")

    requests = (FactRequest.of(SlowEcho, command=f"x; {waits_for('from-background')}"),
                FactRequest.of(SlowEcho, command=f"y; {waits_for('from-foreground')}; "
                                                 f"touch {tmp_path / 'from-background'}"),
                FactRequest.of(Echo, command=f"z; touch {tmp_path / 'from-foreground'}; exit 5"))
    assert read_batch(requests) == {section_name(0): Section(0, ("x", "saw")),
                                    section_name(1): Section(0, ("y", "saw")),
                                    section_name(2): Section(5, ("z",))}


def test_a_batch_leaves_no_temporary_directory(tmp_path):
    requests = (FactRequest.of(SlowEcho, command="a"), FactRequest.of(Echo, command="b"))
    subprocess.run(["sh", "-c", FactBatch().command(requests)], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


def test_the_unit_state_reads_alike_alone_and_in_a_batch():
    from facts.service import UnitState

    request = FactRequest.of(UnitState, unit="nothing-such.service")
    found = read_batch((request,))
    assert found[section_name(0)] == Section(0, tuple(run_locally(request.command())))


@dataclass(frozen=True)
class Script:
    name: str
    text: str


class RunsScript(FactBase):
    def command(self, script):
        return script.text


def test_keys_tell_arguments_and_dataclass_arguments_apart():
    assert FactRequest.of(Sha256File, path="/a").key != FactRequest.of(Sha256File, path="/b").key
    assert FactRequest.of(Sha256File, path="/a").key == FactRequest.of(Sha256File, path="/a").key
    one = FactRequest.of(RunsScript, script=Script("patches", "echo 1"))
    other = FactRequest.of(RunsScript, script=Script("patches", "echo 2"))
    assert one.key != other.key and one.key == FactRequest.of(RunsScript, script=Script("patches", "echo 1")).key
    assert one.name == "RunsScript"
    assert FactRequest.of(Which, command="a").kwargs == (("command", "a"),)


def test_large_batches_are_split_under_the_argument_limit():
    requests = [FactRequest.of(RunsScript, script=Script(str(i), "echo " + "x" * 40_000)) for i in range(5)]
    groups = batches(requests)
    assert [len(group) for group in groups] == [2, 2, 1]
    assert [request for group in groups for request in group] == requests
    assert all(len(FactBatch().command(group)) < MAX_COMMAND_CHARS < 131072 for group in groups)
    assert batches([]) == [] and batches(requests[:1]) == [tuple(requests[:1])]


def test_batches_are_measured_as_they_arrive_after_the_transports_quoting():
    """testinfra over SSH with sudo quotes a command three times; a script full of `'` more than doubles:
    the verification suite's reads of a sudo host once failed with "Argument list too long: '/bin/sh'"."""
    from facts.batch import quoted

    text = "echo 'a' 'b' 'c' " * 150            # 2.5 KB, about 49 KB once quoted three times
    requests = [FactRequest.of(RunsScript, script=Script(str(i), text)) for i in range(6)]
    assert len(batches(requests)) == 1                          # as sent by pyinfra over paramiko
    over_testinfra = batches(requests, quotes=3)
    assert len(over_testinfra) > 1
    assert all(len(quoted(FactBatch().command(group), 3)) < 131072 for group in over_testinfra)
    assert len(quoted(FactBatch().command(tuple(requests)), 3)) > 131072   # unsplit, it would not run


def test_a_split_batch_still_reads_every_fact():
    requests = [FactRequest.of(RunsScript, script=Script(str(i), f"echo {i} {'x' * 40_000} >/dev/null; echo {i}"))
                for i in range(3)]
    values = [request.value(read_batch(group)[section_name(index)])
              for group in batches(requests) for index, request in enumerate(group)]
    assert values == ["0", "1", "2"]


def test_a_fact_that_keeps_its_arguments_for_process_reads_them_in_a_batch():
    class KeepsArgument(Which):
        """As pyinfra's Sha256File keeps `path` for `process`."""

        def command(self, command):
            self.seen = command
            return f"echo {command}"

        def process(self, output):
            return (self.seen, output)

    assert FactRequest.of(KeepsArgument, command="a").value(Section(0, ("a",))) == ("a", ["a"])
    assert FactRequest.of(KeepsArgument, command="b").value(Section(0, ("b",))) == ("b", ["b"])


def test_an_empty_batch_is_a_command_that_does_nothing():
    assert run_locally(FactBatch().command(())) == [] and FactBatch.default() == {}
