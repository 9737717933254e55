"""pyinfra loads this file (from the directory you run pyinfra in) before the inventory.

It refuses an inventory file that does not exist before pyinfra reads its name as a module or host
name, and makes servestack validate the manifest and every targeted host's data as soon as the
inventory is loaded, before pyinfra opens any connection: bad input stops the run with one
message naming each host, key and expectation. Then it follows the run for its recap and for
interruptions (servestack/runreport.py). It also sets TCP_NODELAY on every SSH connection
(servestack/pyinfra_hooks.py says why).
"""

import sys

from pyinfra import state
from pyinfra_cli.exceptions import CliError

from servestack import runreport
from servestack.errors import ConfigError
from servestack.preconnect import inventory_file_problem, validate_targets
from servestack.pyinfra_hooks import cli_argument, enable_tcp_nodelay, validate_after_inventory_load


def inventory_loaded(loaded_state) -> None:
    """A refusal is shown as the CLI's own errors are (`--> pyinfra error: ...`), not as an error
    raised at a line of servestack's code."""
    try:
        validate_targets(loaded_state)
        problem = runreport.prompt_problem(sys.argv)
        if problem:
            raise ConfigError(problem)
    except ConfigError as error:
        raise CliError(str(error)) from None
    runreport.install(loaded_state)


missing_inventory = inventory_file_problem(cli_argument("inventory"))
if missing_inventory:   # shown as the CLI shows its own errors: an error raised here would name this line
    CliError(missing_inventory).show()
    sys.exit(1)
validate_after_inventory_load(state, inventory_loaded)
enable_tcp_nodelay()
