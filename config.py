"""pyinfra loads this file (from the directory you run pyinfra in) before the inventory.

It makes servestack validate the manifest and every targeted host's data as soon as the
inventory is loaded, before pyinfra opens any connection: bad input stops the run with one
message naming each host, key and expectation. It also sets TCP_NODELAY on every SSH connection
and prefers AES-GCM (servestack/sshtune.py: ~7x cheaper remote commands, less controller CPU per
packet) and makes pyinfra's per-operation bookkeeping cheaper for the controller
(servestack/stackorder.py, servestack/argcache.py).
"""

from pyinfra import state

from servestack.argcache import cache_global_arguments, fast_host_defaults
from servestack.preconnect import validate_after_inventory_load
from servestack.sshtune import enable_tcp_nodelay, prefer_aes_gcm
from servestack.stackorder import use_frame_order

validate_after_inventory_load(state)
enable_tcp_nodelay()
prefer_aes_gcm()
use_frame_order()
cache_global_arguments()
fast_host_defaults()
