"""The SGLang service: running as its user with the pinned CUDA environment, answering a real
request, keeping its secrets out of the unit (skipped with the reason where systemd is not running)."""

import pytest

pytestmark = pytest.mark.deployed


def test_service_active(target):
    """The unit is enabled and active."""
    target.check("service_active")


def test_service_user(target):
    """Its main process runs as service_user."""
    target.check("service_user")


def test_service_environment(target):
    """The live process has CUDA_HOME, PATH and LD_LIBRARY_PATH on the new toolkit only, and service_env."""
    target.check("service_environment")


def test_service_secrets(target):
    """The unit holds no secret; the secrets file is 0600 root."""
    target.check("service_secrets")


def test_service_health(target):
    """GET /health answers 200."""
    target.check("service_health")


def test_service_generate(target):
    """A real POST /generate returns text."""
    target.check("service_generate")
