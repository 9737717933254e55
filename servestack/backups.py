"""`servestack backups INVENTORY [--limit L]`: the environment snapshots kept on each host.

The backup step (operations/venv.py `backup_env`) writes `<servestack_state_dir>/backups/<UTC ts>.json`
before a run changes the ML environment: every package with its exact version and local label,
the Python version, the venv path and the release it resolved to. This lists them, oldest first;
it changes nothing on any host.
"""

from __future__ import annotations

import fnmatch
import os
import sys

from facts.venv import MlEnvBackups
from servestack.settings import host_settings, validate_inventory
from servestack.targets import refuse_local_targets


def _limited(inventory, limit: str | None) -> list:
    if not limit:
        return list(inventory)
    patterns = [part.strip() for part in limit.split(",") if part.strip()]
    return [host for host in inventory
            if any(fnmatch.fnmatch(host.name, pattern) or pattern in host.groups for pattern in patterns)]


def collect(inventory_path: str, limit: str | None = None) -> dict[str, list | str]:
    """{host name: [backup summaries] or an error string}, reading each host over its connector."""
    from pyinfra.api import Config, State
    from pyinfra.api.connect import connect_all, disconnect_all
    from pyinfra.api.state import StateStage
    from pyinfra.context import ctx_config, ctx_inventory, ctx_state
    from pyinfra_cli.inventory import make_inventory

    state = State(check_for_changes=False)
    ctx_state.set(state)
    config = Config()
    ctx_config.set(config)
    inventory = make_inventory(inventory_path, cwd=os.getcwd())
    ctx_inventory.set(inventory)
    hosts = _limited(inventory, limit)
    validate_inventory(hosts)
    refuse_local_targets(hosts)
    state.init(inventory, config, initial_limit=hosts)
    state.set_stage(StateStage.Connect)
    connect_all(state)
    results: dict[str, list | str] = {}
    try:
        for host in hosts:
            if host not in state.activated_hosts:
                results[host.name] = "could not connect"
                continue
            settings = host_settings(host)
            results[host.name] = host.get_fact(MlEnvBackups, state_dir=settings.servestack_state_dir,
                                               python=settings.venv_python)
    finally:
        disconnect_all(state)
    return results


def format_backups(results: dict[str, list | str]) -> str:
    """One block per host: a line per snapshot, oldest first."""
    lines = []
    for host_name, backups in results.items():
        if isinstance(backups, str):
            lines.append(f"{host_name}: {backups}")
            continue
        lines.append(f"{host_name}: {len(backups)} backup(s)")
        for backup in backups:
            where = backup.get("release") or backup.get("realpath") or "?"
            lines.append(f"  {backup.get('timestamp') or '?':<17} {backup.get('venv_path')} -> {where}  "
                         f"python {backup.get('python')}  torch {backup.get('torch') or '-'}  "
                         f"{backup.get('packages')} packages  {backup.get('file')}")
    return "\n".join(lines)


def backups_main(inventory_path: str, limit: str | None = None) -> int:
    results = collect(inventory_path, limit)
    print(format_backups(results))
    return 1 if any(isinstance(value, str) for value in results.values()) else 0


if __name__ == "__main__":
    sys.exit(backups_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
