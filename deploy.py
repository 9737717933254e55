"""The servestack upgrade, one line per step (docs/design.md says what each leaves on a host).

    pyinfra inventory.py deploy.py --dry --diff     # what would change, per host; changes nothing
    pyinfra inventory.py deploy.py                  # apply

A host that fails preflight is refused with one line per problem and runs no other step. What one
step decides (the release this run leaves active) is passed to the next as an argument.
"""

from functools import partial

from pyinfra import host, state

from operations import patches, preflight, prestart, service, speculation, toolkit, venv, verify, weights
from servestack.pyinfra_hooks import index_deploy_file
from servestack.run_checks import after_connecting
from servestack.settings import host_settings

after_connecting(state)     # the checks config.py makes, when pyinfra ran from another directory
index_deploy_file(__file__)  # pyinfra inspects this file's frame for every operation


def host_reads(settings, release=None):
    """What the steps read of a host, each step's own list: read in one remote command at prepare
    (unless -y: preflight says why) and one at execute, right after the lock is taken (servestack/reads.py)."""
    return [request for step in (preflight, toolkit, venv, patches, weights, prestart, service, speculation, verify)
            for request in step.host_reads(settings, release)]


def upgrade(release):
    """The upgrade's steps, after preflight and under the host's lock, towards `release` (``venv.plan()``)."""
    venv.backup(release=release)
    toolkit.cuda_toolkit()
    venv.build(release=release)
    patches.patches(release=release)
    weights.weights(release=release)
    prestart.prestart(release=release)
    venv.activate(release=release)
    service.sglang_service(release=release)
    speculation.speculation(release=release)
    verify.verify(release=release)
    weights.prune()


settings = host_settings(host)
preflight.locked_run(reads=partial(host_reads, settings),
                     decides=[*venv.host_reads(settings), *service.deploy_reads(settings),
                              *weights.host_reads(settings)],
                     choose=venv.plan,      # None: the host was refused (no python to build with)
                     steps=upgrade)
