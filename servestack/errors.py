"""Errors servestack raises for bad input, before any host is touched, and the exit statuses of its commands.

Every `servestack` command (doctor, status, verify, backups, bench, keys) ends with one of:

    0    all good: every host was read and every check passed
    1    a check failed, or a host failed (a host was read and something on it is wrong, or the
         benchmark did not measure it)
    2    bad input: the inventory, host data, options or output paths; one line per problem naming
         the host, the key or file and what was expected, never a traceback, found before any host
         is contacted (doctor still reports the other hosts, each refused one with the deploy's lines)
    3    a host could not be reached (and no check failed on a host that was)
    130  interrupted (Ctrl-C); 143 when terminated (SIGTERM); 141 when the reader of the output
         went away (`servestack doctor --json | head`)

The deploy and the rollback are pyinfra's own commands and keep pyinfra's exit statuses (docs/operating.md).
"""

from pyinfra.api.exceptions import PyinfraError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141


def exit_status(failed: bool, unreachable: bool) -> int:
    """The contract's status for a run: a failed check before an unreachable host, else all good."""
    return EXIT_FAILED if failed else EXIT_UNREACHABLE if unreachable else EXIT_OK


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
