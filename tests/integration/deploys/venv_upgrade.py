"""The venv steps of deploy.py on their own (tests): backup, build, activate."""

from operations import base, venv

base.servestack_base()
venv.backup()
venv.build()
venv.activate()
