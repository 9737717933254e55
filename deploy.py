"""The servestack upgrade, one line per step (docs/design.md says what each leaves on a host).

    pyinfra inventory.py deploy.py --dry --diff     # what would change, per host; changes nothing
    pyinfra inventory.py deploy.py                  # apply

A host that fails preflight is refused with one line per problem and runs no other step.
"""

from operations import base, patches, preflight, service, toolkit, venv, verify
from servestack.stackorder import index_deploy_file

index_deploy_file(__file__)  # pyinfra inspects this file's frame for every operation (stackorder.py)
base.servestack_base()
if preflight.preflight():
    venv.backup()
    toolkit.cuda_toolkit()
    venv.build()
    patches.patches()
    venv.activate()
    service.sglang_service()
    verify.verify()
    preflight.release_lock()
