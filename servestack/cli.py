"""The `servestack` command: fleet reports.

    servestack doctor INVENTORY [--limit L ...] [--json]   preflight checks as a report; changes nothing
    servestack status INVENTORY [--limit L ...] [--json]   each host's release, rollback target, last run, service
    servestack verify INVENTORY [--limit L ...] [--junit FILE]  the verification suite as a per-host table
    servestack backups INVENTORY [--limit L ...]       list the environment snapshots kept on each host
    servestack bench INVENTORY [--limit L ...] [--runs N] [--concurrency 1,4,16] [--json FILE] [--plot FILE.png]
                     [--dry | -y]
                                                    tok/s with and without speculation; the host ends in the
                                                    configuration its service_speculation policy chooses
    servestack keys [--manifest FILE] [--json]      every host-data key, its default and meaning

Exit status, the same for every command (servestack/errors.py):
  0    all good
  1    a check failed, or a host failed
  2    bad input (inventory, host data, options, output paths): one line per problem naming the host,
       the key or file and what was expected, never a traceback, before any host is contacted
  3    a host could not be reached (and no check failed on a host that was)
  130  interrupted; 143 terminated; 141 the reader of the output went away
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from servestack.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, ConfigError
from servestack.fleet import LIMIT_HELP


def _inventory_parser(commands, name: str, help_text: str):
    parser = commands.add_parser(name, help=help_text)
    parser.add_argument("inventory")
    parser.add_argument("--limit", action="append", default=None, metavar="L", help=LIMIT_HELP)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servestack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _inventory_parser(commands, "doctor", "preflight checks as a report").add_argument(
        "--json", action="store_true", dest="as_json")
    _inventory_parser(commands, "status", "each host's releases, last run and service; changes nothing"
                      ).add_argument("--json", action="store_true", dest="as_json")
    _inventory_parser(commands, "verify", "run the verification suite, per-host table").add_argument(
        "--junit", default=None)
    _inventory_parser(commands, "backups", "list environment snapshots on each host")
    bench = _inventory_parser(commands, "bench", "measure tok/s with and without speculation (restarts the "
                                                 "service through its health gate; ends as the policy chooses)")
    bench.add_argument("--runs", type=int, default=None,
                       help="requests at concurrency 1, and rounds per further level (default: the manifest's)")
    bench.add_argument("--concurrency", default=None,
                       help="levels, e.g. 1,4,16 (1 is always measured; default: the manifest's)")
    bench.add_argument("--json", default=None, dest="json_path", metavar="FILE", help="write the JSON document")
    bench.add_argument("--plot", default=None, dest="plot_path", metavar="FILE.png",
                       help="draw a chart (needs the 'plot' extra: matplotlib)")
    asking = bench.add_mutually_exclusive_group()
    asking.add_argument("--dry", action="store_true", help="show which hosts it would restart; change nothing")
    asking.add_argument("-y", "--yes", action="store_true",
                        help="restart and measure without asking (needed without a terminal)")
    keys = commands.add_parser("keys", help="every host-data key with its default and meaning")
    keys.add_argument("--manifest", default=None,
                      help="the manifest whose defaults to show (default: files/stack.toml)")
    keys.add_argument("--json", action="store_true", dest="as_json", help="one JSON object instead of the table")
    return parser


def key_rows(manifest_path: str | None = None) -> tuple[str, list[dict]]:
    """The manifest shown (relative to the project) and each host-data key: name, default, meaning. A
    manifest that cannot give every default raises ManifestError (exit 2)."""
    from servestack.manifest import DEFAULT_MANIFEST, PROJECT_ROOT, load_manifest
    from servestack.keys import host_keys

    path = Path(manifest_path).resolve() if manifest_path else DEFAULT_MANIFEST
    manifest = load_manifest(path)
    shown = path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path
    return str(shown), [{"name": key.name, "default": key.default(manifest), "meaning": key.help}
                        for key in host_keys(manifest).values()]


def print_keys(manifest_path: str | None = None, as_json: bool = False) -> int:
    """The key table (a key's name is never wrapped), or with `as_json` one JSON object
    {"manifest": PATH, "keys": [{"name", "default", "meaning"}]}."""
    from rich.table import Table

    from servestack.verify import report_console

    shown, rows = key_rows(manifest_path)
    if as_json:
        print(json.dumps({"manifest": shown, "keys": rows}, indent=2, default=str))
        return 0
    table = Table(title=f"servestack host-data keys (defaults from {shown})")
    table.add_column("key", no_wrap=True, min_width=max(len(row["name"]) for row in rows))
    table.add_column("default", overflow="fold")
    table.add_column("meaning", overflow="fold")
    for row in rows:
        default = row["default"]
        table.add_row(row["name"], "—" if default in (None, (), {}) else str(default), row["meaning"])
    report_console().print(table)
    return 0


def output_path_problem(option: str, path: str | None) -> str | None:
    """Why `path` cannot be written (its folder is missing or not writable, or it is a folder), checked
    before anything runs so that no result is lost at the end; None when it can."""
    if path is None:
        return None
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return f"{option} {path}: is a folder, expected a file to write"
    if not folder.is_dir():
        return f"{option} {path}: {folder} " + ("is not a folder" if folder.exists() else "does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{option} {path}: not writable"
    return None


def check_output_paths(args) -> None:
    """Refuse, before anything runs, output paths the command could not write."""
    paths = {"bench": [("--json", getattr(args, "json_path", None)), ("--plot", getattr(args, "plot_path", None))],
             "verify": [("--junit", getattr(args, "junit", None))]}.get(args.command, [])
    problems = [problem for option, path in paths if (problem := output_path_problem(option, path))]
    if problems:
        raise ConfigError("\n".join(problems))


def _fleet_report(args) -> int:
    check_output_paths(args)
    if args.command == "doctor":
        from servestack.doctor import doctor_main
        return doctor_main(args.inventory, args.limit, args.as_json)
    if args.command == "status":
        from servestack.status import status_main
        return status_main(args.inventory, args.limit, args.as_json)
    if args.command == "verify":
        from servestack.verify import verify_main
        return verify_main(args.inventory, args.limit, args.junit)
    if args.command == "bench":
        from servestack.bench import bench_main
        return bench_main(args.inventory, args.limit, args.runs, args.concurrency, args.json_path, args.plot_path,
                          yes=args.yes, dry=args.dry)
    from servestack.backups import backups_main
    return backups_main(args.inventory, args.limit)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = print_keys(args.manifest, args.as_json) if args.command == "keys" else _fleet_report(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except ConfigError as error:
        return _refused(str(error))
    except KeyboardInterrupt:
        print("servestack: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`| head`): nothing more to say to it, and nothing left for Python to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _refused(message: str) -> int:
    print(f"servestack: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
