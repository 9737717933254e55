"""`servestack backups INVENTORY [--limit L ...]`: the environment snapshots kept on each host.

The backup step (operations/venv.py `backup_env`) writes `<servestack_state_dir>/backups/<UTC ts>.json`
before a run changes the ML environment: every package with its exact version and local label,
the Python version, the venv path and what it was then: a release (`venv_path` a link to
`<releases_dir>/<id>/venv`), or a hand-made venv, which the same run's activation then adopts as
release `adopted-<UTC ts>` (the activation history says which). This lists them, oldest first,
each saying what it is a snapshot of; it changes nothing on any host. Hosts are reached as
`servestack verify` and `servestack status` reach them (servestack/verify.py).
"""

from __future__ import annotations

import sys
from typing import Iterable

from facts.batch import FactRequest
from facts.venv import MlEnvBackups, MlEnvState
from operations.venv import mlenv_fact_arguments
from servestack.errors import EXIT_OK, EXIT_UNREACHABLE
from servestack.verify import Unreachable, read_all, targets_from_inventory


def backup_requests(settings) -> list[FactRequest]:
    """The snapshots' summaries, and the environment's state (its releases and activation
    history, to name the release a hand-made venv became)."""
    return [FactRequest.of(MlEnvBackups, state_dir=settings.servestack_state_dir, python=settings.venv_python),
            FactRequest.of(MlEnvState, **mlenv_fact_arguments(settings))]


def collect(inventory_path: str, limit: Iterable[str] | None = None) -> dict[str, list | str]:
    """{host name: [backup summaries, each with "of": what it is a snapshot of] or an error string}."""
    targets = targets_from_inventory(inventory_path, limit, action="list backups", local=False)
    values = read_all(targets, lambda target: backup_requests(target.settings))
    results: dict[str, list | str] = {}
    for target in targets:
        found = values[target.name]
        if isinstance(found, Unreachable):
            results[target.name] = f"could not be read: {found}"
            continue
        backups, state = found
        results[target.name] = [{**backup, "of": snapshot_of(backup, state)} for backup in backups]
    return results


def snapshot_of(backup: dict, state: dict | None) -> str:
    """What a snapshot was taken of, in words: "release r-...", or "hand-made venv, adopted as
    release adopted-..." (the first adoption at or after the snapshot, by the activation history)."""
    if backup.get("release"):
        return f"release {backup['release']}"
    venv_path, realpath = backup.get("venv_path"), backup.get("realpath")
    if realpath and realpath != venv_path:
        return f"a link to {realpath} (not a servestack release)"
    history = (state or {}).get("history") or []
    taken = backup.get("timestamp") or ""
    adopted = next((entry.get("release") for entry in history
                    if entry.get("by") == "adopt" and (entry.get("at") or "") >= taken), None)
    if adopted:
        kept = adopted in ((state or {}).get("releases") or {})
        return f"hand-made venv, adopted as release {adopted}" + ("" if kept else " (no longer kept)")
    return "hand-made venv (not adopted)"


def format_backups(results: dict[str, list | str]) -> str:
    """One block per host: a line per snapshot, oldest first."""
    lines = []
    for host_name, backups in results.items():
        if isinstance(backups, str):
            lines.append(f"{host_name}: {backups}")
            continue
        lines.append(f"{host_name}: {len(backups)} backup(s)")
        for backup in backups:
            of = backup.get("of") or backup.get("release") or backup.get("realpath") or "?"
            reason = f"  ({backup['reason']})" if backup.get("reason") else ""
            lines.append(f"  {backup.get('timestamp') or '?':<17} {backup.get('venv_path')} -> {of}{reason}")
            lines.append(f"    python {backup.get('python')}  torch {backup.get('torch') or '-'}  "
                         f"{backup.get('packages')} packages  {backup.get('file')}")
    return "\n".join(lines)


def backups_main(inventory_path: str, limit: Iterable[str] | None = None) -> int:
    results = collect(inventory_path, limit)
    print(format_backups(results))
    return EXIT_UNREACHABLE if any(isinstance(value, str) for value in results.values()) else EXIT_OK


if __name__ == "__main__":
    sys.exit(backups_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
