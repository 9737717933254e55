"""The venv steps and the service step of deploy.py on their own (tests): backup, build, activate, service."""

from operations import base, service, venv

base.servestack_base()
venv.backup()
venv.build()
venv.activate()
service.sglang_service()
