"""The test harness's command line (`./servestack.sh sandbox ...`, `./servestack.sh rehearse`): sandbox hosts
and the rehearsal, run from a checkout.

    python -m sandbox rehearse [--hosts N] [--keep]   boot sandbox hosts, dry-run, converge twice, verify
    python -m sandbox up --hosts N [--gpu MODEL --capability X.Y --driver V] [--user ubuntu]
    python -m sandbox run -- CMD...                   run a command in the sandbox's controller namespace
    python -m sandbox exec HOST [-- CMD...]           run a command on one sandbox host (a shell without CMD)
    python -m sandbox down                            remove the sandbox hosts and everything they used
    python -m sandbox status                          show the sandbox's hosts and inventory

The sandbox is named by SERVESTACK_SANDBOX ("default" without it). A broken manifest ends the command with
exit status 2 and one line per problem naming the file and the key, never a traceback: the commands import
the lab, which reads the manifest, only once they run.
"""

from __future__ import annotations

import argparse
import os
import sys

from servestack.errors import ConfigError


def _sandbox_parsers(commands) -> None:
    up = commands.add_parser("up", help="boot hosts and write an inventory for them")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--gpu", default=None, help="GPU model the stand-in nvidia-smi reports")
    up.add_argument("--capability", default=None, help="compute capability, e.g. 12.0")
    up.add_argument("--driver", default=None, help="driver version, e.g. 580.82.07")
    up.add_argument("--gpus", type=int, default=None, help="GPUs per host")
    up.add_argument("--user", choices=("root", "ubuntu"), default="root",
                    help="SSH user in the inventory ('ubuntu' uses sudo)")
    run = commands.add_parser("run", help="run a command in the controller namespace")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    exec_ = commands.add_parser("exec", help="run a command on one host")
    exec_.add_argument("host")
    exec_.add_argument("argv", nargs=argparse.REMAINDER)
    down = commands.add_parser("down", help="remove the hosts, namespaces, mounts and state")
    status = commands.add_parser("status", help="show the sandbox's hosts and inventory")
    for parser in (up, run, exec_, down, status):
        parser.set_defaults(name=os.environ.get("SERVESTACK_SANDBOX", "default"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rehearse_ = commands.add_parser("rehearse", help="the whole upgrade on sandbox hosts, proven")
    rehearse_.add_argument("--hosts", type=int, default=None,
                           help="how many hosts (default: one per service profile of the manifest)")
    rehearse_.add_argument("--keep", action="store_true", help="leave the sandbox running afterwards")
    _sandbox_parsers(commands)
    return parser


def _strip_separator(argv: list[str]) -> list[str]:
    return argv[1:] if argv[:1] == ["--"] else argv


def _sandbox(args) -> int:
    from sandbox.lab import Lab, gpu_spec

    lab = Lab(args.name)
    if args.command == "up":
        gpu = gpu_spec(model=args.gpu, capability=args.capability, driver=args.driver, count=args.gpus)
        lab.up(args.hosts, gpu=gpu, user=args.user)
        lab.print_status()
        return 0
    if args.command == "down":
        lab.down()
        return 0
    if args.command == "status":
        lab.print_status()
        return 0
    problem = _unreachable(lab, args.host if args.command == "exec" else None)
    if problem:
        raise ConfigError(problem)
    if args.command == "run":
        return lab.run_in_controller(_strip_separator(args.argv))
    return lab.exec_interactive(args.host, _strip_separator(args.argv))


def _unreachable(lab, host: str | None) -> str | None:
    """Why `sandbox run` / `sandbox exec HOST` cannot reach the sandbox (else ssh or ip netns would say it
    in their own words: "Could not resolve hostname", "Cannot open network namespace")."""
    names = [each.name for each in lab.hosts]
    if not names:
        return f"sandbox {lab.sandbox.name!r} is not up: `./servestack.sh sandbox up --hosts N` starts it"
    if host is not None and host not in names:
        return f"sandbox {lab.sandbox.name!r} has no host {host!r}; its hosts: {', '.join(names)}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "rehearse":
            from sandbox.rehearse import rehearse
            return rehearse(hosts=args.hosts, keep=args.keep)
        return _sandbox(args)
    except ConfigError as error:
        print(f"servestack: {error}", file=sys.stderr)
        return 2
