"""The deploy's verification step alone, limited to the checks that hold on any CUDA 13 host.

    pyinfra -y INVENTORY docs/validation/verify_host_level.py

Used by run_on_device.sh to exercise operations/verify.py (the checks of servestack/checks read
through servestack.reads, one batched remote command) on a real GPU host that never had
servestack's deploy. Without a release (`release=None`) the checks judge the active venv.
"""

from operations.verify import verify
from servestack.checks.catalogue import CHECKS
from servestack.pyinfra_hooks import index_deploy_file

index_deploy_file(__file__)  # as deploy.py: pyinfra inspects this file's frame for every operation

verify(names=tuple(check.name for check in CHECKS if not check.deployed))
