"""The deploy's verification step alone, limited to the checks that hold on any CUDA 13 host.

    pyinfra -y INVENTORY docs/validation/verify_host_level.py

Used by run_on_device.sh to exercise operations/verify.py (checks read through pyinfra facts) on a
real GPU host that never had servestack's deploy.
"""

from operations.verify import verify
from servestack.checks import CHECKS

verify(names=tuple(check.name for check in CHECKS if not check.deployed))
