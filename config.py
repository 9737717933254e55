"""pyinfra loads this file (from the directory you run pyinfra in) before the inventory.

It makes servestack validate the manifest and every targeted host's data as soon as the
inventory is loaded, before pyinfra opens any connection: bad input stops the run with one
message naming each host, key and expectation. It also sets TCP_NODELAY on every SSH connection
(servestack/pyinfra_hooks.py says why).
"""

from pyinfra import state

from servestack.preconnect import validate_targets
from servestack.pyinfra_hooks import enable_tcp_nodelay, validate_after_inventory_load

validate_after_inventory_load(state, validate_targets)
enable_tcp_nodelay()
