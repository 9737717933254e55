"""Data for the `gpu_hosts` group of inventory.py: how servestack reaches the hosts.

These are pyinfra's own keys (ssh_*, _sudo): servestack leaves them alone (README "Host data").
"""

ssh_user = "ubuntu"
_sudo = True
