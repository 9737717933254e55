"""The servestack upgrade, one line per step.

    pyinfra inventory.py deploy.py --dry --diff     # what would change, per host; changes nothing
    pyinfra inventory.py deploy.py                  # apply
"""

from operations import base

base.servestack_base()
