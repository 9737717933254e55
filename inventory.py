"""Example fleet inventory: copy this file and edit the hosts.

Each entry is (name, host data). Fleet-wide defaults live in group_data/all.py and, for this
group, group_data/gpu_hosts.py (SSH user, sudo). Every servestack key is listed in README.md
("Host data"). Placeholder names ending in `.example` are refused until you replace them, and
servestack never targets the machine it runs on unless a host sets servestack_allow_local.
"""

gpu_hosts = [
    ("gpu-node-01.example", {"ssh_hostname": "gpu-node-01.example"}),
    ("gpu-node-02.example", {"ssh_hostname": "gpu-node-02.example", "service_env": {"NCCL_P2P_DISABLE": "1"}}),
]
