"""`pyinfra` with a count of the remote commands it issues per host (used by bench/converge.py).

Usage: python bench/counting_pyinfra.py COUNTS.json <pyinfra arguments...>

It wraps pyinfra's SSH connector (the one the lab's hosts use) before handing over to pyinfra's own
CLI: every `run_shell_command` is one remote command (one SSH exec channel: facts, operation
commands, the commands pyinfra runs around uploads) and every `put_file` / `get_file` one file
transfer (SFTP). Counting at the connector counts exactly what goes over the wire, whatever the
deploy's code does, and does not depend on log formats. The counts are written as JSON
({host: {"commands": n, "transfers": n}}) when pyinfra exits, with "_startup_cpu_s": the CPU time
the process had used when pyinfra began connecting to hosts (imports, inventory, config: the same
for any number of hosts). BENCH_COMMAND_TEXTS=DIR also keeps each command's whole text
(DIR/NNN-host.sh), for tests that look at what was sent.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import defaultdict

from pyinfra.connectors.ssh import SSHConnector

T0 = time.perf_counter()
LOG = os.environ.get("BENCH_COMMAND_LOG")
TEXTS = os.environ.get("BENCH_COMMAND_TEXTS")  # a directory: each command's whole text, NNN-host.sh
COUNTS: dict = defaultdict(lambda: {"commands": 0, "transfers": 0})


def _counted(method, kind: str):
    def wrapper(self, *args, **kwargs):
        COUNTS[self.host.name][kind] += 1
        if TEXTS and kind == "commands" and args:
            number = sum(counts["commands"] for counts in COUNTS.values())
            text = args[0].get_raw_value() if hasattr(args[0], "get_raw_value") else str(args[0])
            with open(os.path.join(TEXTS, f"{number:03d}-{self.host.name}.sh"), "w") as out:
                out.write(text)
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            if LOG:  # BENCH_COMMAND_LOG=path: when, how long and what (its first characters)
                with open(LOG, "a") as log:
                    log.write(f"{started - T0:7.3f} {time.perf_counter() - started:6.3f} {self.host.name} {kind} "
                              f"{str(args[0] if args else '')[:60]!r}\n")
    wrapper.__wrapped__ = method
    return wrapper


def install() -> None:
    SSHConnector.run_shell_command = _counted(SSHConnector.run_shell_command, "commands")
    # put_file / get_file of pyinfra's SSH connector: one SFTP transfer each (the sudo copy around
    # it runs through run_shell_command, counted there)
    SSHConnector.put_file = _counted(SSHConnector.put_file, "transfers")
    SSHConnector.get_file = _counted(SSHConnector.get_file, "transfers")


def note_startup_cpu() -> None:
    """Keep the process's CPU time at the moment pyinfra's CLI starts connecting to the hosts."""
    from pyinfra_cli import cli

    connect_all = cli.connect_all

    def connect_all_noted(*args, **kwargs):
        times = os.times()
        STARTUP["cpu_s"] = round(times.user + times.system, 3)
        return connect_all(*args, **kwargs)

    cli.connect_all = connect_all_noted


STARTUP: dict = {}


def main() -> int:
    counts_path = sys.argv.pop(1)
    install()
    note_startup_cpu()
    atexit.register(lambda: open(counts_path, "w").write(
        json.dumps({**COUNTS, "_startup_cpu_s": STARTUP.get("cpu_s")}, sort_keys=True)))
    sys.argv[0] = "pyinfra"
    from pyinfra_cli.main import main as pyinfra_main
    return pyinfra_main()


if __name__ == "__main__":
    sys.exit(main())
