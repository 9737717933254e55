"""The ground every step stands on: validated settings and servestack's state directory."""

from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.files import Directory
from pyinfra.operations import files

from facts.probe import FactRequest
from servestack import probe
from servestack.settings import host_settings

STATE_DIR_OWNER = ("root", "root")
STATE_DIR_MODE = "755"


@probe.expects
def _expected_facts(host_) -> list[FactRequest]:
    return [FactRequest.of(Directory, path=host_settings(host_).servestack_state_dir)]


# Read at prepare, also under -y: the execute stage starts from that read, so its first remote
# read is the one preflight's lock take carries (servestack/probe.py `run_and_read_ahead`).
probe.decides(Directory)


@operation()
def state_directory(path: str):
    """
    servestack's state directory, root-owned, mode 755 (pyinfra's ``files.directory``).

    + path: the directory (``servestack_state_dir``)
    """
    found = probe.fact(host, Directory, path=path)
    if found and (found.get("user"), found.get("group")) == STATE_DIR_OWNER \
            and str(found.get("mode")) == STATE_DIR_MODE:
        host.noop(f"directory {path} exists")
        return
    yield from files.directory._inner(path=path, user=STATE_DIR_OWNER[0], group=STATE_DIR_OWNER[1],
                                      mode=STATE_DIR_MODE)
    probe.changed(host)  # the state directory holds the lock and every record


@deploy("servestack base")
def servestack_base():
    """Validate this host's settings and make sure servestack's state directory exists."""
    settings = host_settings(host)
    state_directory(name="servestack state directory", path=settings.servestack_state_dir)
