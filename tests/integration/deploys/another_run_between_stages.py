"""deploy.py, with another servestack run on each host between pyinfra's prepare and execute stages
(tests): as this run's execute stage starts, "another run" takes the host's lock, edits the
SGLang unit file and releases the lock, before this run takes the lock itself."""

import runpy

from pyinfra import state
from pyinfra.api import StringCommand
from pyinfra.api.state import BaseStateCallback

from facts.host import release_lock_command, take_lock_command
from servestack.paths import unit_path
from servestack.settings import host_settings

EDIT = "# edited by another servestack run"


class AnotherRunFirst(BaseStateCallback):
    done: set = set()

    @staticmethod
    def operation_host_start(state, host, op_hash):  # execute stage only
        if host.name in AnotherRunFirst.done:
            return
        AnotherRunFirst.done.add(host.name)
        settings = host_settings(host)
        state_dir, other = settings.servestack_state_dir, "another-run"
        command = (f"( {take_lock_command(state_dir, other, 'elsewhere:1', 'T')}\n) >/dev/null && "
                   f"echo '{EDIT}' >> {unit_path(settings)} && "
                   f"( {release_lock_command(state_dir, other)}\n)")
        ok, output = host.run_shell_command(StringCommand(command))
        assert ok, output


if not any(isinstance(handler, AnotherRunFirst) for handler in state.callback_handlers):
    state.add_callback_handler(AnotherRunFirst())

runpy.run_path("deploy.py")
