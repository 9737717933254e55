"""Preflight and the CUDA toolkit step of deploy.py on their own (tests)."""

from pyinfra import host

from operations import preflight, toolkit
from servestack.settings import host_settings

settings = host_settings(host)
reads = preflight.host_reads(settings) + toolkit.host_reads(settings)
if preflight.preflight(reads=reads):
    preflight.lock(reads=reads)
    toolkit.cuda_toolkit()
    preflight.release_lock()
