"""Errors servestack raises for bad input, before any host is touched."""

from pyinfra.api.exceptions import PyinfraError


class ConfigError(PyinfraError):
    """Bad manifest or host data: the message names the file or host, the key and what was expected."""
