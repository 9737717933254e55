"""The venv steps and the service step of deploy.py on their own (tests): backup, build, activate, service."""

from operations import service, venv

release = venv.plan()
venv.backup(release)
venv.build(release)
venv.activate(release)
service.sglang_service(release)
