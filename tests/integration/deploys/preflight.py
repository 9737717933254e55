"""Preflight of deploy.py on its own (tests): checks, lock taken and released."""

from operations import base, preflight

base.servestack_base()
if preflight.preflight():
    preflight.release_lock()
