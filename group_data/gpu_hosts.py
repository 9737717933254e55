"""Data for the `gpu_hosts` group of inventory.py: how servestack reaches the hosts."""

ssh_user = "ubuntu"
_sudo = True
