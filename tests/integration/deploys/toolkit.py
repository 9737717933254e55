"""Preflight and the CUDA toolkit step of deploy.py on their own (tests)."""

from operations import base, preflight, toolkit

base.servestack_base()
if preflight.preflight():
    toolkit.cuda_toolkit()
    preflight.release_lock()
