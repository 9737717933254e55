"""servestack/reads.py: facts read once per stage and host, read again after an operation changed
the host, several in one remote command.

Each test runs a real pyinfra State: @fake hosts (pyinfra answers each fact's command; reads are
counted in the connector's `executed_commands`) and, where a batch must really run, the @local
host (fact commands here are read-only but for files in a temporary directory; the operations run
write only there).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import Config, FactBase, FunctionCommand, Inventory, State, operation
from pyinfra.api.connect import connect_all
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.connectors.local import LocalConnector
from pyinfra.context import ctx_host
from pyinfra.facts.server import Groups, Which
from pyinfra.operations import server

from facts.batch import FactRequest
from servestack import reads
from tests.unit.fake_host import fake_state

GROUPS = {"cat /etc/group": ["root:x:0:", "adm:x:4:"]}


def fake_host(responses=None):
    state = fake_state({"fake_responses": responses or GROUPS})
    return state.inventory.get_host("@fake/gpu1")


def reads_of(fake, text: str) -> int:
    """How many commands the @fake host ran that contain `text`."""
    return sum(text in command for command in fake.connector.executed_commands)


@operation()
def reader(label: str, seen: list, request: FactRequest):
    """Reads a fact before it yields (as servestack's operations do) and yields nothing."""
    seen.append((label, host.state.is_executing, reads.fact(host, request.cls, **dict(request.kwargs))))
    return
    yield


@operation()
def changes_nothing():
    host.noop("nothing to do")
    return
    yield


def _callback():
    return True


@operation()
def runs_a_callback():
    yield FunctionCommand(_callback, (), {})


# --- the memo, with pyinfra answering each fact (@fake) -------------------------------------------


def test_a_read_is_answered_again_within_a_stage():
    fake = fake_host()
    assert reads.fact(fake, Groups) == ["root", "adm"]
    assert reads.fact(fake, Groups) == ["root", "adm"]
    assert reads_of(fake, "cat /etc/group") == 1
    reads.fact(fake, Which, command="sh")
    reads.fact(fake, Which, command="bash")          # other arguments: another read
    assert reads_of(fake, "command -v") == 2
    values = reads.read(fake, [FactRequest.of(Groups), FactRequest.of(Which, command="sh"),
                               FactRequest.of(Which, command="git")])
    assert values[0] == ["root", "adm"]
    assert reads_of(fake, "cat /etc/group") == 1 and reads_of(fake, "command -v") == 3


def test_the_host_context_proxy_and_the_host_share_one_memo():
    fake = fake_host()
    reads.fact(fake, Groups)
    with ctx_host.use(fake):
        assert reads.fact(host, Groups) == ["root", "adm"]
    assert reads_of(fake, "cat /etc/group") == 1


def test_each_host_has_its_own_reads():
    inventory = Inventory((["@fake/a", "@fake/b"], {"fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": GROUPS}))
    state = State(inventory, Config())
    connect_all(state)
    a, b = inventory.get_host("@fake/a"), inventory.get_host("@fake/b")
    reads.fact(a, Groups)
    reads.fact(b, Groups)
    reads.fact(a, Groups)
    assert reads_of(a, "cat /etc/group") == 1 and reads_of(b, "cat /etc/group") == 1


def test_each_reader_gets_its_own_copy_of_a_value():
    fake = fake_host()
    groups = reads.fact(fake, Groups)
    groups.clear()
    assert reads.fact(fake, Groups) == ["root", "adm"], "a reader changed the remembered value"
    one, two = reads.read(fake, [FactRequest.of(Groups), FactRequest.of(Groups)])
    assert one == two and one is not two
    assert reads_of(fake, "cat /etc/group") == 1


def test_a_value_pickle_could_not_copy_is_copied_all_the_same():
    class WithCallable(FactBase):
        def command(self):
            return "echo callable"

        def process(self, output):
            return {"f": lambda: None, "items": list(output)}

    fake = fake_host({"echo callable": ["x"]})
    value = reads.fact(fake, WithCallable)
    value["items"].clear()
    again = reads.fact(fake, WithCallable)
    assert again["items"] == ["x"] and callable(again["f"])
    assert reads_of(fake, "echo callable") == 1


def test_at_prepare_a_change_an_operation_would_make_is_not_a_new_read():
    """At prepare pyinfra only collects commands: the host is as read, reading it again would cost
    a remote command for the same answer."""
    fake = fake_host()
    seen: list = []
    add_op(fake.state, reader, label="before", seen=seen, request=FactRequest.of(Groups))
    add_op(fake.state, server.shell, commands=["echo change"])
    add_op(fake.state, reader, label="after", seen=seen, request=FactRequest.of(Groups))
    assert [(label, executing) for label, executing, _ in seen] == [("before", False), ("after", False)]
    assert reads_of(fake, "cat /etc/group") == 1
    assert fake.connector.executed_commands.count("echo change") == 0


def test_prepare_and_execute_are_separate_stages():
    """Execute reads the host again: what prepare read was before any of this run's changes, and
    another run may have changed the host since."""
    fake = fake_host()
    seen: list = []
    reads.fact(fake, Groups)      # a deploy function's read at prepare
    add_op(fake.state, reader, label="op", seen=seen, request=FactRequest.of(Groups))
    assert reads_of(fake, "cat /etc/group") == 1
    run_ops(fake.state)
    assert [(label, executing) for label, executing, _ in seen] == [("op", False), ("op", True)]
    assert reads_of(fake, "cat /etc/group") == 2


class Hardware(FactBase):
    """A fact of the hardware (as facts/gpu.py NvidiaGpus): read once per run."""

    once_per_run = True

    def command(self):
        return "cat /etc/group"

    def process(self, output):
        return list(output)


def test_a_fact_of_the_hardware_read_at_prepare_is_not_read_again_at_execute():
    fake = fake_host()
    seen: list = []
    reads.fact(fake, Hardware)
    add_op(fake.state, reader, label="op", seen=seen, request=FactRequest.of(Hardware))
    add_op(fake.state, runs_a_callback)   # a change: other facts would be read again now
    add_op(fake.state, reader, label="after", seen=seen, request=FactRequest.of(Hardware))
    run_ops(fake.state)
    assert [(label, executing) for label, executing, _ in seen][-2:] == [("op", True), ("after", True)]
    assert reads_of(fake, "cat /etc/group") == 1
    assert seen[-1][2] == ["root:x:0:", "adm:x:4:"]


def test_a_fact_of_the_hardware_prepare_did_not_read_is_read_at_execute():
    fake = fake_host()
    seen: list = []
    state = fake.state
    state.check_for_changes = False   # -y: the operation reads at execute only
    add_op(state, reader, label="op", seen=seen, request=FactRequest.of(Hardware))
    run_ops(state)
    assert [(label, executing) for label, executing, _ in seen] == [("op", True)]
    assert reads_of(fake, "cat /etc/group") == 1


def test_after_an_operation_ran_commands_at_execute_the_next_read_is_new():
    fake = fake_host()
    seen: list = []
    add_op(fake.state, reader, label="before", seen=seen, request=FactRequest.of(Groups))
    add_op(fake.state, reader, label="again", seen=seen, request=FactRequest.of(Groups))
    add_op(fake.state, server.shell, commands=["echo change"])
    add_op(fake.state, reader, label="after", seen=seen, request=FactRequest.of(Groups))
    prepared = reads_of(fake, "cat /etc/group")
    run_ops(fake.state)
    commands = fake.connector.executed_commands
    assert prepared == 1
    # at execute: one read for `before` and `again`, the change, then a new read for `after`
    assert commands[1:] == ["cat /etc/group", "echo change", "cat /etc/group"]
    assert reads.changes_so_far(fake) == 1


def test_an_operation_that_changed_nothing_leaves_the_reads_as_they_are():
    fake = fake_host()
    seen: list = []
    add_op(fake.state, reader, label="before", seen=seen, request=FactRequest.of(Groups))
    add_op(fake.state, changes_nothing)
    add_op(fake.state, server.shell, commands=[])
    add_op(fake.state, reader, label="after", seen=seen, request=FactRequest.of(Groups))
    run_ops(fake.state)
    assert reads_of(fake, "cat /etc/group") == 2      # once at prepare, once at execute
    assert reads.changes_so_far(fake) == 0


def test_a_python_callback_an_operation_ran_counts_as_a_change():
    """pyinfra counts an operation that ran any command, a FunctionCommand too, as a change: the
    callback may have changed the host."""
    fake = fake_host()
    seen: list = []
    add_op(fake.state, reader, label="before", seen=seen, request=FactRequest.of(Groups))
    add_op(fake.state, runs_a_callback)
    add_op(fake.state, reader, label="after", seen=seen, request=FactRequest.of(Groups))
    run_ops(fake.state)
    assert reads_of(fake, "cat /etc/group") == 3


# --- batches, run on this machine (@local) --------------------------------------------------------


class Logged(FactBase):
    """Prints `text`; each run of its command adds a line to `log`.

    + log: a file
    + text: what it prints
    """

    def command(self, log, text):
        return f"echo read >> {log}; echo {text}"


class Slow(Logged):
    slow = True


class FailsOnce(FactBase):
    """Fails the first time it runs (as a command cut by a transient error), prints `ok` after."""

    def command(self, flag):
        return f"if [ -e {flag} ]; then echo ok; else touch {flag}; exit 3; fi"


class AlwaysFails(FactBase):
    def command(self, log):
        return f"echo read >> {log}; exit 3"

    @staticmethod
    def default():
        return "default"


class NeedsTool(FactBase):
    requires_command = "no-such-tool-here"

    def command(self):
        return "echo ran"

    @staticmethod
    def default():
        return "default"


class FileText(FactBase):
    """A file's text, or None."""

    def command(self, path):
        return f"cat {path} 2>/dev/null || true"

    def process(self, output):
        return "\n".join(output)


class KeepsItsPath(FactBase):
    """Like pyinfra's Sha256File: `command` keeps its argument for `process`; counts its renders."""

    renders = 0

    def command(self, path):
        KeepsItsPath.renders += 1
        self.path = path
        return "echo found"

    def process(self, output):
        return f"{output[0]} {self.path}"


def local_host(monkeypatch, also_fake: bool = False):
    """The @local host of a connected State (with a @fake host beside it: the State then goes on
    when the local one fails); `.ran` lists the commands it ran."""
    names = ["@local", "@fake/other"] if also_fake else ["@local"]
    inventory = Inventory((names, {"fake_delay": 0, "fake_delay_jitter": 0}))
    state = State(inventory, Config())
    connect_all(state)
    local = inventory.get_host("@local")
    ran: list = []
    run = LocalConnector.run_shell_command

    def counting(self, command, *args, **kwargs):
        ran.append(str(command))
        return run(self, command, *args, **kwargs)

    monkeypatch.setattr(LocalConnector, "run_shell_command", counting)
    return local, ran


def log_lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_several_facts_are_read_in_one_remote_command(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch)
    log = tmp_path / "log"
    requests = [FactRequest.of(Logged, log=str(log), text=text) for text in ("a", "b")]
    requests.append(FactRequest.of(Slow, log=str(log), text="c"))
    assert reads.read(local, requests) == ["a", "b", "c"]
    assert len(ran) == 1 and reads.commands(local) == 1 and log_lines(log) == 3
    assert reads.fact(local, Logged, log=str(log), text="b") == "b"
    assert len(ran) == 1 and log_lines(log) == 3
    assert reads.read(local, [requests[0], FactRequest.of(Groups)])[1]  # only Groups is read
    assert len(ran) == 2 and log_lines(log) == 3


def test_large_reads_are_split_under_the_argument_limit(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch)
    log = tmp_path / "log"
    requests = [FactRequest.of(Logged, log=str(log), text=f"{i}{' ' * 60_000}") for i in range(3)]
    assert reads.read(local, requests) == ["0", "1", "2"]
    assert reads.commands(local) == len(ran) == 3


def test_a_fact_whose_command_fails_in_a_batch_is_read_alone_by_host_get_fact(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch)
    flag = tmp_path / "flag"
    values = reads.read(local, [FactRequest.of(FailsOnce, flag=str(flag)), FactRequest.of(Groups)])
    assert values[0] == "ok" and "root" in values[1]
    assert len(ran) == 2 and reads.commands(local) == 1   # the batch, then FailsOnce alone
    assert local not in local.state.failed_hosts


def test_a_fact_that_fails_alone_too_fails_the_host_as_pyinfra_does(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch, also_fake=True)
    log = tmp_path / "log"
    values = reads.read(local, [FactRequest.of(AlwaysFails, log=str(log)), FactRequest.of(Groups)])
    assert values[0] == "default" and "root" in values[1]
    assert log_lines(log) == 2 and len(ran) == 2
    assert local in local.state.failed_hosts


def test_a_missing_command_in_a_batch_is_pyinfras_default(monkeypatch):
    local, ran = local_host(monkeypatch)
    assert reads.read(local, [FactRequest.of(NeedsTool), FactRequest.of(Groups)])[0] == "default"
    assert len(ran) == 2 and local not in local.state.failed_hosts


def test_after_an_operation_changed_the_host_a_batched_read_sees_the_change(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch)
    path = tmp_path / "file"
    path.write_text("before\n")
    seen: list = []
    request = FactRequest.of(FileText, path=str(path))
    add_op(local.state, reader, label="before", seen=seen, request=request)
    add_op(local.state, server.shell, commands=[f"echo after > {path}"])
    add_op(local.state, reader, label="after", seen=seen, request=request)
    assert path.read_text() == "before\n" and reads.commands(local) == 1
    run_ops(local.state)
    assert seen == [("before", False, "before"), ("after", False, "before"),
                    ("before", True, "before"), ("after", True, "after")]
    assert reads.commands(local) == 2      # execute's: one before the change, one after


def test_one_fact_object_renders_the_command_and_processes_its_output(monkeypatch, tmp_path):
    local, ran = local_host(monkeypatch)
    KeepsItsPath.renders = 0
    requests = [FactRequest.of(KeepsItsPath, path=str(tmp_path / name)) for name in ("a", "b")]
    assert reads.read(local, requests) == [f"found {tmp_path / 'a'}", f"found {tmp_path / 'b'}"]
    assert len(ran) == 1 and KeepsItsPath.renders == 2  # once each: not again to process the output
