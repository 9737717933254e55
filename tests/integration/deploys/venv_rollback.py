"""rollback.py without the service step (tests): backup, re-activate the previous release."""

from operations import venv

release = venv.rollback_target()
if release is not None:
    venv.rollback(release)
