"""Validate the inventory the moment pyinfra has loaded it, before any host connects
(config.py hooks `validate_targets` there: servestack/pyinfra_hooks.py).

Everything that can be refused without a connection is refused here, in one message, one line per
problem, every host's problems at once: the manifest, the host data (types, strict keys,
consistency), the secrets `service_secret_env` names (they must be set in this machine's
environment, which the secrets file is written from) and targets that would act on this machine.
"""

from servestack.errors import ConfigError
from servestack.settings import check_inventory, secret_problems
from servestack.targets import REFUSAL, target_problems


def targets_problems(hosts, environ=None) -> list[str]:
    """Every line `validate_targets` refuses `hosts` with, in inventory order (none: they may run)."""
    _settings, problems = check_inventory(hosts)
    for index, host in enumerate(hosts):
        problems += [(index, line) for line in secret_problems(host.name, host.data.dict(), environ)]
    problems += target_problems(hosts)
    problems.sort(key=lambda item: item[0])  # stable: each host's lines stay in that order
    return [line for _index, line in problems]


def validate_targets(state, environ=None) -> None:
    """Refuse the run, naming every problem of every host in its limit, before any connection; and a
    run with no host at all (a --limit that matches none, an empty inventory), which would
    otherwise do nothing and succeed: an emergency rollback with a typo must not report success."""
    hosts = [host for host in state.inventory if state.is_host_in_limit(host)]
    if not hosts:
        names = [host.name for host in state.inventory]
        raise ConfigError(f"{REFUSAL}\nno host to run on: " + (
            f"none of the inventory's hosts ({', '.join(names)}) is in the --limit given (pyinfra's --limit takes "
            "one group or host name or glob per --limit; a comma does not separate two)" if names
            else "the inventory has no hosts"))
    problems = targets_problems(hosts, environ)
    if problems:
        raise ConfigError(REFUSAL + "\n" + "\n".join(problems))
