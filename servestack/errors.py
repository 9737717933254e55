"""Errors servestack raises for bad input, before any host is touched."""

from pyinfra.api.exceptions import PyinfraError


class ConfigError(PyinfraError):
    """Bad manifest or host data: the message names the file or host, the key and what was expected."""


class ManifestError(ConfigError):
    """A manifest that cannot be used: the message names the manifest file and the key.

    `problem` is the message without any host prefix, so that an inventory whose hosts share one
    broken manifest reports it once; `others`, the host's other problems (servestack/settings.py), so
    that the manifest's does not hide them.
    """

    def __init__(self, message: str, problem: str | None = None, others: list[str] | None = None):
        super().__init__(message)
        self.problem = problem or message
        self.others = others or []
