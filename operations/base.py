"""The ground every step stands on: validated settings and servestack's state directory."""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files

from servestack.settings import host_settings


@deploy("servestack base")
def servestack_base():
    """Validate this host's settings and make sure servestack's state directory exists."""
    settings = host_settings(host)
    files.directory(
        name="servestack state directory",
        path=settings.servestack_state_dir,
        user="root",
        group="root",
        mode="755",
    )
