"""The host-state probe (facts/probe.py) and its per-stage cache (servestack/probe.py).

Fact commands run here are read-only (`sha256sum` of a temporary file, `cat /etc/group`).
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from pyinfra.facts.files import Sha256File
from pyinfra.facts.server import Groups, Which

from facts.probe import BEGIN, END, FactRequest, HostProbe, ProbeRequest, split_probe_output, split_requests
from facts.service import UnitState
from facts.verify import ProbeScript, VerificationProbe
from servestack import probe


def run_locally(command: str) -> list[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()


def test_each_fact_gets_its_own_output_and_exit_status(tmp_path):
    (tmp_path / "a").write_text("hello\n")
    request = ProbeRequest((FactRequest.of(Sha256File, path=str(tmp_path / "a")),
                            FactRequest.of(Sha256File, path=str(tmp_path / "missing")),
                            FactRequest.of(Groups)))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert [found[index][0] for index in range(3)] == [0, 0, 0]
    values = [fact.value(found[index][1]) for index, fact in enumerate(request.facts)]
    direct = run_locally(f"sha256sum {tmp_path / 'a'}")[0].split()[0]
    assert values[0] == direct
    assert values[1] is None
    assert "root" in values[2]


def test_output_without_a_final_newline_keeps_its_marker_apart():
    class Printf(Which):
        def command(self, command):
            return f"printf {command}"

    request = ProbeRequest((FactRequest.of(Printf, command="no-newline"), FactRequest.of(Printf, command="x; exit 4")))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert found == {0: (0, ["no-newline"]), 1: (4, ["x"])}


@pytest.mark.parametrize("output", ["", "\\n", "a", "a\\n", "a\\n\\n", "\\na\\n\\nb", "a\\n\\n\\n"])
def test_each_output_reads_as_the_same_lines_as_the_command_run_alone(output):
    class Printf(Which):
        def command(self, command):
            return f"printf '{command}'"

    request = ProbeRequest((FactRequest.of(Printf, command=output), FactRequest.of(Printf, command="x")))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert found == {0: (0, run_locally(f"printf '{output}'")), 1: (0, ["x"])}


class Echo(Which):
    def command(self, command):
        return f"echo {command}"


class BackgroundEcho(Echo):
    probe_background = True


def programs_started(tmp_path, request) -> tuple[dict, list[str]]:
    """Run `request`'s probe with mktemp, cat, rm and tail logging each start: (its facts, the starts)."""
    (tmp_path / "bin").mkdir()
    log = tmp_path / "started"
    log.write_text("")
    for name in ("mktemp", "cat", "rm", "tail"):
        real = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        wrapper = tmp_path / "bin" / name
        wrapper.write_text(f"#!/bin/sh\necho {name} >> {log}\nexec {real} \"$@\"\n")
        wrapper.chmod(0o755)
    lines = subprocess.run(["sh", "-c", HostProbe().command(request)], capture_output=True, text=True, check=True,
                           env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}).stdout.splitlines()
    return HostProbe().process(lines), sorted(log.read_text().split())


def test_the_probe_starts_no_program_for_facts_that_start_none(tmp_path):
    """Framing a fact's output costs forks only: ten facts that start no program start none."""
    request = ProbeRequest(tuple(FactRequest.of(Echo, command=str(i)) for i in range(10)))
    assert programs_started(tmp_path, request) == ({i: (0, [str(i)]) for i in range(10)}, [])


def test_background_facts_cost_mktemp_cat_and_rm_once(tmp_path):
    request = ProbeRequest(tuple(FactRequest.of(BackgroundEcho if i % 3 == 0 else Echo, command=str(i))
                                 for i in range(10)))
    assert programs_started(tmp_path, request) == ({i: (0, [str(i)]) for i in range(10)}, ["cat", "mktemp", "rm"])


def test_background_facts_run_together_and_beside_the_others(tmp_path):
    """Each background fact waits (up to 10 s) for a file that a later fact creates: the probe ends
    with every fact done only if the background ones run at once and the others meanwhile."""
    def waits_for(name):
        path = tmp_path / name
        return f"i=0; while [ ! -e {path} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; test -e {path} && echo saw"

    request = ProbeRequest((FactRequest.of(BackgroundEcho, command=f"x; {waits_for('from-background')}"),
                            FactRequest.of(BackgroundEcho, command=f"y; {waits_for('from-foreground')}; "
                                                                   f"touch {tmp_path / 'from-background'}"),
                            FactRequest.of(Echo, command=f"z; touch {tmp_path / 'from-foreground'}; exit 5")))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert found == {0: (0, ["x", "saw"]), 1: (0, ["y", "saw"]), 2: (5, ["z"])}


def test_a_failing_command_is_reported_with_its_status():
    lines = [f"{BEGIN}0", "partial", f"{END}0 3", f"{BEGIN}1", "cut"]
    assert split_probe_output(lines) == {0: (3, ["partial"]), 1: (None, ["cut"])}


def test_requires_command_guard_matches_pyinfra():
    class NeedsTool(Which):
        requires_command = "no-such-tool-here"

    command = FactRequest.of(NeedsTool, command="sh").command()
    assert command.startswith("if command -v no-such-tool-here")


def test_keys_tell_arguments_and_probe_scripts_apart():
    assert FactRequest.of(Sha256File, path="/a").key != FactRequest.of(Sha256File, path="/b").key
    one = FactRequest.of(VerificationProbe, probe=ProbeScript("patches", "echo 1"))
    other = FactRequest.of(VerificationProbe, probe=ProbeScript("patches", "echo 2"))
    assert one.key != other.key
    assert str(ProbeRequest((one,))) == "VerificationProbe"


def test_large_probes_are_split_under_the_argument_limit():
    facts = [FactRequest.of(VerificationProbe, probe=ProbeScript(str(i), "echo " + "x" * 40_000)) for i in range(5)]
    requests = split_requests(facts)
    assert len(requests) == 3
    assert all(len(request.command()) < 131072 for request in requests)


class FakeState:
    """What the probe asks of pyinfra's State: the stage and whether it detects changes."""

    def __init__(self):
        self.is_executing = False
        self.check_for_changes = True   # False under `pyinfra -y`

    def should_check_for_changes(self):
        return self.check_for_changes


class FakeHost:
    """A host whose probe runs locally; counts HostProbe reads."""

    def __init__(self, name="h1"):
        self.name = name
        self.state = FakeState()
        self.connector = object()
        self.probes = []
        self.commands = []

    current_op_global_arguments: dict = {}

    def get_fact(self, cls, **kwargs):
        assert cls is HostProbe
        self.probes.append([fact.name for fact in kwargs["request"].facts])
        return HostProbe().process(run_locally(HostProbe().command(kwargs["request"])))

    def run_shell_command(self, command, **arguments):
        self.commands.append(command)
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        return done.returncode == 0, SimpleNamespace(stdout_lines=done.stdout.splitlines(),
                                                     stderr_lines=done.stderr.splitlines())


@pytest.fixture
def providers(monkeypatch, tmp_path):
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(probe, "_PROVIDERS", [])
    monkeypatch.setattr(probe, "_VOLATILE", set())
    monkeypatch.setattr(probe, "_DECIDING", set())
    probe.expects(lambda host: [FactRequest.of(Groups), FactRequest.of(Sha256File, path=str(tmp_path / "f"))])
    probe.expects(lambda host: [FactRequest.of(VerificationProbe, probe=ProbeScript("g", "echo hi"))],
                  volatile=(VerificationProbe,))
    return tmp_path


def test_one_read_per_stage_answers_every_expected_fact(providers):
    host = FakeHost()
    assert "root" in probe.fact(host, Groups)
    assert probe.fact(host, Sha256File, path=str(providers / "f"))
    assert host.probes == [["Groups", "Sha256File", "VerificationProbe"]]


def test_execute_starts_from_prepares_reads_and_rereads_only_the_verification(providers):
    host = FakeHost()
    probe.fact(host, Groups)
    host.state.is_executing = True      # nothing executed at prepare, whatever it predicted
    assert "root" in probe.fact(host, Groups)
    assert probe.fact(host, Sha256File, path=str(providers / "f"))
    assert len(host.probes) == 1, "prepare's reads were not reused"
    probe.fact(host, VerificationProbe, probe=ProbeScript("g", "echo hi"))
    assert host.probes[1] == ["VerificationProbe"]


def test_execute_rereads_what_an_operation_changed_after_starting_from_prepare(providers):
    host = FakeHost()
    probe.fact(host, Groups)
    host.state.is_executing = True
    probe.changed(host, Groups)          # an operation's commands ran
    probe.fact(host, Groups)
    assert host.probes[1] == ["Groups"]
    probe.changed(host)                  # the lock was taken by another run since prepare
    probe.fact(host, Sha256File, path=str(providers / "f"))
    assert host.probes[2] == ["Sha256File", "Groups"]


def test_under_yes_prepare_reads_only_what_deploy_functions_decide_on(providers):
    probe.decides(Groups)
    host = FakeHost()
    host.state.check_for_changes = False  # pyinfra -y: operations do not run at prepare
    probe.fact(host, UnitState, unit="nothing-such.service")
    assert host.probes == [["UnitState", "Groups"]]
    host.state.is_executing = True  # execute starts from what prepare read, reads the rest
    probe.fact(host, Groups)
    assert len(host.probes) == 1
    probe.fact(host, Sha256File, path=str(providers / "f"))
    assert host.probes[1] == ["Sha256File", "VerificationProbe"]


def test_a_change_rereads_only_what_was_dropped(providers):
    host = FakeHost()
    host.state.is_executing = True
    probe.fact(host, Groups)
    probe.changed(host, Sha256File)
    probe.fact(host, Groups)
    assert len(host.probes) == 1
    probe.fact(host, Sha256File, path=str(providers / "f"))
    # the verification probe is volatile: dropped on any change, not read ahead once the host changed
    assert host.probes[1] == ["Sha256File"]


def test_an_unexpected_fact_is_read_with_the_missing_expected_ones(providers):
    host = FakeHost()
    probe.fact(host, UnitState, unit="nothing-such.service")
    assert host.probes == [["UnitState", "Groups", "Sha256File", "VerificationProbe"]]
    assert probe.cached(host, Groups) is not None
    assert probe.cached(host, Which, command="sh") is None


def test_at_prepare_a_predicted_change_drops_nothing(providers):
    """At prepare pyinfra only collects commands: the host is as read, re-reading it would cost a
    remote command for the same answer."""
    host = FakeHost()
    probe.fact(host, Groups)
    probe.changed(host)
    assert probe.cached(host, Groups) is not None
    probe.fact(host, Sha256File, path=str(providers / "f"))
    assert len(host.probes) == 1


def test_the_lock_take_carries_the_execute_stages_read_in_its_own_command(providers):
    """Under -y, prepare reads what the deploy functions decide on; at execute, the take of the lock
    reads the rest in the same remote command (under the lock), and no step reads the host again."""
    probe.decides(Groups)
    host = FakeHost()
    host.state.check_for_changes = False
    probe.fact(host, Groups)
    host.state.is_executing = True
    ok, stdout, stderr = probe.run_and_read_ahead(host, "echo taken; echo generation 7")
    assert (ok, stdout, stderr) == (True, ["taken", "generation 7"], [])
    assert len(host.commands) == 1 and "echo taken" in host.commands[0]
    assert probe.fact(host, Sha256File, path=str(providers / "f"))
    probe.fact(host, VerificationProbe, probe=ProbeScript("g", "echo hi"))
    assert host.probes == [["Groups"]] and len(host.commands) == 1, "a step read the host again"
    assert probe.reads(host) == 1


def test_a_refused_take_reads_nothing_and_keeps_its_own_output_and_status(providers):
    host = FakeHost()
    host.state.is_executing = True
    ok, stdout, _ = probe.run_and_read_ahead(host, "echo 'held by run x'; exit 3")
    assert (ok, stdout) == (False, ["held by run x"])
    assert probe.cached(host, Groups) is None
    probe.fact(host, Groups)
    assert host.probes == [["Groups", "Sha256File", "VerificationProbe"]]


def test_a_take_with_nothing_left_to_read_is_the_command_alone(providers):
    host = FakeHost()
    host.state.is_executing = True
    probe.fact(host, Groups)
    assert probe.run_and_read_ahead(host, "echo taken") == (True, ["taken"], [])
    assert host.commands == ["echo taken"]


class SharedRead(Which):
    """Two facts reading the same thing: `$shared` is set by the prelude, which logs each run."""

    def probe_parts(self, command):
        log, label = command.split(":")
        return f"shared=$(echo read >> {log}; echo value)", f"echo {label} $shared"

    def command(self, command):
        return "\n".join(self.probe_parts(command))


def test_a_read_two_facts_share_runs_once_in_the_probe_and_each_reads_as_alone(tmp_path):
    log = tmp_path / "reads"
    request = ProbeRequest((FactRequest.of(SharedRead, command=f"{log}:a"),
                            FactRequest.of(SharedRead, command=f"{log}:b"), FactRequest.of(Groups)))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert found[0] == (0, ["a value"]) and found[1] == (0, ["b value"]) and found[2][0] == 0
    assert log.read_text() == "read\n"
    assert run_locally(request.facts[0].command()) == ["a value"]


def test_the_unit_state_reads_alike_alone_and_in_the_probe():
    request = ProbeRequest((FactRequest.of(UnitState, unit="nothing-such.service"),))
    found = HostProbe().process(run_locally(HostProbe().command(request)))
    assert found[0] == (0, run_locally(request.facts[0].command()))


def test_every_reader_gets_its_own_copy_of_a_value(providers):
    host = FakeHost()
    groups = probe.fact(host, Groups)
    groups.clear()
    assert probe.fact(host, Groups) and probe.cached(host, Groups), "a reader changed the cached value"
    stage = probe._stage(host)
    key = FactRequest.of(Groups).key
    stage.values[key] = probe._freeze({"f": lambda: None})  # pickle cannot copy it: deepcopy does
    value = probe.fact(host, Groups)
    value.clear()
    assert list(probe.fact(host, Groups)) == ["f"]


def test_a_command_is_built_once_per_fact_and_arguments_not_per_host():
    built = []

    class Counted(Which):
        def command(self, command):
            built.append(command)
            self.seen = command  # a fact that keeps its argument for `process`, as Sha256File does
            return f"echo {command}"

        def process(self, output):
            return (self.seen, output)

    hosts = [FactRequest.of(Counted, command="a") for _ in range(8)]
    assert {request.command() for request in hosts} == {"echo a"}
    assert [request.value(["a"]) for request in hosts] == [("a", ["a"])] * 8
    assert built == ["a"]
    assert FactRequest.of(Counted, command="b").value(["b"]) == ("b", ["b"]) and built == ["a", "b"]
