"""Preflight of deploy.py on its own (tests): checks, lock taken and released."""

from pyinfra import host

from operations import preflight
from servestack.settings import host_settings

settings = host_settings(host)
if preflight.preflight(reads=preflight.host_reads(settings)):
    preflight.lock(reads=preflight.host_reads(settings))
    preflight.release_lock()
