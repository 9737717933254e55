"""pyinfra loads this file (from the directory you run pyinfra in) before the inventory.

It refuses an inventory file that does not exist before pyinfra reads its name as a module or host
name, and makes servestack validate the manifest and every targeted host's data as soon as the
inventory is loaded, before pyinfra opens any connection: bad input stops the run with one
message naming each host, key and expectation. Then it follows the run for its recap and for
interruptions (servestack/runreport.py). It also sets TCP_NODELAY on every SSH connection
(servestack/pyinfra_hooks.py says why). Run from another directory, deploy.py and rollback.py make
the same checks after connecting (servestack/run_checks.py).
"""

from pyinfra import state

from servestack.run_checks import before_connecting

before_connecting(state)
