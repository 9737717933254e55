"""Re-activate the previous ML environment release on each host.

    pyinfra inventory.py rollback.py --dry --diff                    # what would change
    pyinfra inventory.py rollback.py                                 # roll back
    pyinfra inventory.py rollback.py --data venv_rollback_to=r-0123456789ab   # to a named release

What "previous" means: the release that was active before the most recent *deploy* switched
`venv_path` (default /opt/ml-env). A rollback is not a deploy, so running rollback.py twice leaves
the host where the first run put it (the second run changes nothing). To roll forward, run
deploy.py again: the newer release is kept, so it is re-activated without being rebuilt. A
hand-made venv adopted on the first deploy is a release too (`adopted-<UTC timestamp>`), so the
first rollback returns to it. `servestack backups inventory.py` and
`<venv_releases_dir>/*/release.json` on the host show what is kept.

A host with nothing to roll back to (no deploy switched it yet, or the previous release was
pruned or never passed its checks) is refused with a message saying so and listing what is kept;
nothing is changed on it. Before switching, the active environment is snapshotted like in
deploy.py; after it, the service step re-renders the unit for the re-activated release (its
ExecStart names the release's python) and restarts it through the same health gate as deploy.py.
"""

from functools import partial

from pyinfra import host, state

from operations import preflight, service, venv
from servestack.pyinfra_hooks import index_deploy_file
from servestack.run_checks import after_connecting
from servestack.settings import host_settings

after_connecting(state)     # the checks config.py makes, when pyinfra ran from another directory
index_deploy_file(__file__)  # pyinfra inspects this file's frame for every operation


def host_reads(settings, release=None):
    """What the steps read of a host (see deploy.py)."""
    return [request for step in (preflight, venv, service) for request in step.host_reads(settings, release)]


def roll_back(release):
    """Re-activate `release` (``venv.rollback_target()``) and restart the service on it."""
    venv.rollback(release=release)
    service.sglang_service(release=release)


settings = host_settings(host)
preflight.locked_run(reads=partial(host_reads, settings),
                     decides=[*venv.host_reads(settings), *service.deploy_reads(settings)],
                     choose=venv.rollback_target,   # None: the host was refused (nothing to roll back to)
                     steps=roll_back)
