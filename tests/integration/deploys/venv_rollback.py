"""rollback.py without the service step (tests): backup, re-activate the previous release."""

from operations import base, venv

base.servestack_base()
venv.rollback()
