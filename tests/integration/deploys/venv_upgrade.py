"""The venv steps of deploy.py on their own (tests): backup, build, activate."""

from operations import venv

release = venv.plan()
venv.backup(release)
venv.build(release)
venv.activate(release)
