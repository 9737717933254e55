"""Benchmark: how fast a converged fleet re-converges (no-op) and dry-runs, and how many remote
commands each host gets. Run by hand (root, sandbox tools), not a test:

    .venv/bin/python bench/converge.py                 # 1, 4 and 8 hosts, 5 timed runs each
    .venv/bin/python bench/converge.py --hosts 1 --repeat 3

One lab of max(--hosts) sandbox hosts is booted and converged with the real deploy.py; then K
rounds (--repeat) each time, for every fleet size N (`--limit`: the first N hosts), one no-op
converge (`pyinfra -y --json`, which must report zero changes), one dry run (`pyinfra --dry`) and,
as the floor to compare with, plain pyinfra running a one-command deploy (`server.shell("true")`,
`-y`, the same inventory, from a directory without servestack's config.py).
With --shape, two more modes split the no-op's gap from plain (SHAPE_DEPLOY): "shape", as many
operations and remote commands as the no-op has, each command `true`; "texts", the same with the
texts the no-op sent each host (kept from one more no-op before the rounds).
Wall time is the whole pyinfra process, as a user sees it (Python start-up, inventory, connecting,
facts, operations). The median of the K runs is reported, and the ratios N/1 both of the medians
and "paired" (the median of each round's own ratio: the sizes of one round ran moments apart). Remote
commands are counted by bench/counting_pyinfra.py, a wrapper around pyinfra's SSH connector (see its
docstring).

Prints a table with the 8/1 ratios and writes bench/results/<git short sha>-<UTC>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import git_sha, utc_stamp, write_result  # noqa: E402
from sandbox import cgroups  # noqa: E402
from sandbox.lab import Lab  # noqa: E402

COUNTER = ROOT / "bench" / "counting_pyinfra.py"
console = Console()


class BenchFailed(Exception):
    pass


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _hosts_cpu_usec(lab: Lab) -> dict[str, int | None]:
    return {host.name: cgroups.cpu_usec(host.machine) for host in lab.hosts}


PLAIN_DEPLOY = 'from pyinfra.operations import server\n\nserver.shell(name="one command", commands=["true"])\n'

# The no-op's shape without servestack's code: as many operations and remote commands per host as
# the no-op has, issued where the no-op issues them (the first while the deploy file runs, the last
# by the last operation, the others by the first), each `true` or, with SHAPE_TEXTS, the text the
# no-op sent that host (read from SHAPE_TEXTS/<host>-<n>.sh). So the gap from plain splits into
# pyinfra's cost of the shape (mode "shape"), the host's cost of what the commands do ("texts")
# and servestack's own controller code (the rest, up to "noop").
SHAPE_DEPLOY = '''import os

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.server import Command
from pyinfra.operations import server

TEXTS = os.environ.get("SHAPE_TEXTS")


def text(number):
    if not TEXTS:
        return "true"
    with open(os.path.join(TEXTS, f"{host.name}-{number}.sh")) as handle:
        return handle.read()


@operation(is_idempotent=True)
def nothing():
    host.noop("nothing to do")
    return
    yield


COMMANDS, OPERATIONS = int(os.environ["SHAPE_COMMANDS"]), int(os.environ["SHAPE_OPERATIONS"])
host.get_fact(Command, command=text(1))
server.shell(name="first", commands=[text(number) for number in range(2, COMMANDS)])
for number in range(OPERATIONS - 2):
    nothing(name=f"nothing {number}")
server.shell(name="last", commands=[text(COMMANDS)])
'''


def pyinfra(lab: Lab, hosts: list[str], *args: str, deploy: str = "deploy.py", cwd: Path = ROOT,
            timeout: int = 3600, env: dict | None = None) -> tuple[float, dict, subprocess.CompletedProcess]:
    """One pyinfra run against `hosts`; (wall seconds, counts per host, the process).

    Counts per host: remote commands and transfers (counting_pyinfra.py) and the CPU time the host
    used meanwhile (its cgroup: sshd, the probe's shells and programs); "controller" holds the
    pyinfra process's own CPU time."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        counts_path = handle.name
    limits = [argument for name in hosts for argument in ("--limit", name)]
    argv = [sys.executable, str(COUNTER), counts_path, str(lab.inventory_path), deploy, *limits, *args]
    cpu_before, hosts_before = _children_cpu_s(), _hosts_cpu_usec(lab)
    started = time.perf_counter()
    result = subprocess.run(lab.controller_argv(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    elapsed = time.perf_counter() - started
    cpu_after, hosts_after = _children_cpu_s(), _hosts_cpu_usec(lab)
    try:
        counts = json.loads(Path(counts_path).read_text() or "{}")
    finally:
        os.unlink(counts_path)
    for name in hosts:
        before, after = hosts_before.get(name), hosts_after.get(name)
        if before is not None and after is not None:
            counts.setdefault(name, {})["cpu_ms"] = (after - before) // 1000
    startup = counts.pop("_startup_cpu_s", None)
    counts["controller"] = {"cpu_s": round(cpu_after - cpu_before, 3), "startup_cpu_s": startup}
    return elapsed, counts, result


def cpu_floor_s(counts: dict, hosts: list[str]) -> float | None:
    """The least wall time this run's CPU allows here: the start-up runs alone, then the controller's
    other CPU time and every host's share this machine's CPUs (see README.md)."""
    controller = counts.get("controller", {})
    cpu = [counts.get(name, {}).get("cpu_ms") for name in hosts]
    if controller.get("startup_cpu_s") is None or controller.get("cpu_s") is None or None in cpu:
        return None
    startup = controller["startup_cpu_s"]
    shared = controller["cpu_s"] - startup + sum(cpu) / 1000
    return round(startup + shared / (os.cpu_count() or 1), 3)


def changes(result: subprocess.CompletedProcess) -> int:
    try:
        return int(json.loads(result.stdout)["results"]["totals"].get("success", 0))
    except (ValueError, KeyError) as error:
        output = (result.stdout + result.stderr)[-4000:]
        raise BenchFailed(f"pyinfra failed (exit {result.returncode}):\n{output}") from error


def converge(lab: Lab, hosts: list[str]) -> None:
    for attempt in (1, 2):
        elapsed, _, result = pyinfra(lab, hosts, "-y", "--json")
        if result.returncode != 0:
            raise BenchFailed(f"converge failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
        console.print(f"converge {attempt}: {changes(result)} change(s) in {elapsed:.1f} s")
        if changes(result) == 0:
            return
    raise BenchFailed("the fleet does not converge: the second run still changed something")


def per_host(counts: dict, hosts: list[str]) -> dict:
    commands = [counts.get(name, {}).get("commands", 0) for name in hosts]
    transfers = [counts.get(name, {}).get("transfers", 0) for name in hosts]
    cpu = [counts[name]["cpu_ms"] for name in hosts if "cpu_ms" in counts.get(name, {})]
    return {"commands_max": max(commands), "commands_min": min(commands), "transfers_max": max(transfers),
            "host_cpu_ms": round(statistics.mean(cpu)) if cpu else None,
            "controller_cpu_s": counts.get("controller", {}).get("cpu_s"),
            "controller_startup_cpu_s": counts.get("controller", {}).get("startup_cpu_s"),
            "cpu_floor_s": cpu_floor_s(counts, hosts)}


MODES = ("noop", "dry", "plain")
SHAPE_MODES = ("shape", "texts")


@dataclass(frozen=True)
class Shape:
    """The no-op's shape (--shape): its operations and remote commands per host, and where the
    commands' texts are kept (SHAPE_DEPLOY)."""

    operations: int
    commands: int
    texts: Path


def sort_by_host(sent: Path, texts: Path) -> None:
    """counting_pyinfra.py's NNN-HOST.sh (NNN counts every host's commands) moved to texts/HOST-N.sh
    (N counts that host's)."""
    numbers: dict[str, int] = {}
    for path in sorted(sent.iterdir()):
        name = path.stem.split("-", 1)[1]
        numbers[name] = numbers.get(name, 0) + 1
        path.rename(texts / f"{name}-{numbers[name]}.sh")


def no_op_shape(lab: Lab, names: list[str], plain_dir: Path) -> Shape:
    """One more no-op converge of `names`, keeping what it sent (BENCH_COMMAND_TEXTS): each host's
    commands in the order sent, as <host>-<n>.sh."""
    sent, texts = Path(tempfile.mkdtemp(prefix="servestack-bench-sent-")), plain_dir / "texts"
    texts.mkdir()
    _, counts, result = pyinfra(lab, names, "-y", "--json", env={"BENCH_COMMAND_TEXTS": str(sent)})
    if result.returncode != 0 or changes(result):
        output = (result.stdout + result.stderr)[-4000:]
        raise BenchFailed(f"the no-op before --shape failed or changed something:\n{output}")
    sort_by_host(sent, texts)
    sent.rmdir()
    commands = {counts[name]["commands"] for name in names}
    if len(commands) != 1 or min(commands) < 3:
        raise BenchFailed(f"--shape needs the same 3 or more remote commands on every host, not {sorted(commands)}")
    operations = len(json.loads(result.stdout)["results"]["operations"])
    (plain_dir / "shape.py").write_text(SHAPE_DEPLOY)
    return Shape(operations, commands.pop(), texts)


def timed_run(lab: Lab, hosts: list[str], mode: str, plain_dir: Path,
              shape: Shape | None = None) -> tuple[float, dict]:
    """One no-op converge, dry run, plain one-command deploy or (with `shape`) shape run of `hosts`:
    wall time, per-host counts."""
    args = ("-y", "--json") if mode != "dry" else ("--dry",)
    where: dict = {"deploy": str(plain_dir / "plain.py"), "cwd": plain_dir} if mode == "plain" else {}
    if mode in SHAPE_MODES:
        env = {"SHAPE_OPERATIONS": str(shape.operations), "SHAPE_COMMANDS": str(shape.commands)}
        if mode == "texts":
            env["SHAPE_TEXTS"] = str(shape.texts)
        where = {"deploy": str(plain_dir / "shape.py"), "cwd": plain_dir, "env": env}
    elapsed, counts, result = pyinfra(lab, hosts, *args, **where)
    if result.returncode != 0:
        raise BenchFailed(f"{mode} on {len(hosts)} host(s) failed (exit {result.returncode}):\n"
                          f"{(result.stdout + result.stderr)[-4000:]}")
    if mode == "noop" and changes(result):
        raise BenchFailed(f"a no-op converge of {len(hosts)} host(s) changed {changes(result)} thing(s)")
    return elapsed, per_host(counts, hosts)


def measure_rounds(lab: Lab, names: list[str], sizes: list[int], repeat: int, with_shape: bool = False) -> list[dict]:
    """`repeat` rounds, each timing every fleet size and mode once: a machine whose speed drifts
    (a shared VM) then slows every size alike instead of whichever size was measured during the slump."""
    samples: dict[tuple[int, str], list[tuple[float, dict]]] = {}
    plain_dir = Path(tempfile.mkdtemp(prefix="servestack-bench-plain-"))
    (plain_dir / "plain.py").write_text(PLAIN_DEPLOY)
    shape = no_op_shape(lab, names, plain_dir) if with_shape else None
    modes = MODES + (SHAPE_MODES if with_shape else ())
    for round_number in range(1, repeat + 1):
        for size in sizes:
            for mode in modes:
                samples.setdefault((size, mode), []).append(timed_run(lab, names[:size], mode, plain_dir, shape))
        console.print(f"round {round_number}/{repeat}: " + ", ".join(
            f"{mode} {size}: {samples[(size, mode)][-1][0]:.2f} s" for size in sizes for mode in modes))
    rows = []
    for size in sizes:
        for mode in modes:
            times = [elapsed for elapsed, _ in samples[(size, mode)]]
            median_run = samples[(size, mode)][times.index(sorted(times)[len(times) // 2])][1]
            rows.append({"hosts": size, "mode": mode, "times_s": [round(t, 3) for t in times],
                         "median_s": round(statistics.median(times), 3), **median_run})
    return rows


def ratios(rows: list[dict]) -> dict:
    """N hosts / the smallest fleet, by medians, and `paired`: the median of the ratios of the runs of
    one round (taken moments apart, so machine drift cancels)."""
    out = {}
    plain = {row["hosts"]: row for row in rows if row["mode"] == "plain"}
    for row in rows:
        if row["mode"] in ("noop", *SHAPE_MODES) and row["hosts"] in plain:
            base = plain[row["hosts"]]
            out[f"{row['mode']}/plain {row['hosts']}"] = round(row["median_s"] / base["median_s"], 2)
            paired = [t / b for t, b in zip(row["times_s"], base["times_s"])]
            out[f"{row['mode']}/plain {row['hosts']} paired"] = round(statistics.median(paired), 2)
    for mode in ("noop", "dry"):
        by_size = {row["hosts"]: row for row in rows if row["mode"] == mode}
        smallest = min(by_size)
        base = by_size[smallest]
        for size, row in by_size.items():
            if size != smallest:
                out[f"{mode} {size}/{smallest}"] = round(row["median_s"] / base["median_s"], 2)
                paired = [t / b for t, b in zip(row["times_s"], base["times_s"])]
                out[f"{mode} {size}/{smallest} paired"] = round(statistics.median(paired), 2)
                if row.get("cpu_floor_s"):
                    out[f"{mode} {size}/{smallest} CPU floor"] = round(row["cpu_floor_s"] / base["median_s"], 2)
    return out


def show(rows: list[dict], out: dict) -> None:
    table = Table(title=f"no-op converge and dry run of a converged fleet ({out['commit']}, {out['utc']})")
    for column in ("mode", "hosts", "median s", "runs s", "remote commands / host", "transfers / host",
                   "host CPU ms / host", "controller CPU s", "CPU floor s"):
        table.add_column(column)
    for row in rows:
        spread = f"{row['commands_min']}-{row['commands_max']}" if row["commands_min"] != row["commands_max"] \
            else str(row["commands_max"])
        table.add_row(row["mode"], str(row["hosts"]), f"{row['median_s']:.2f}",
                      " ".join(f"{t:.2f}" for t in row["times_s"]), spread, str(row["transfers_max"]),
                      str(row.get("host_cpu_ms")), str(row.get("controller_cpu_s")), str(row.get("cpu_floor_s")))
    console.print(table)
    console.print(f"(the hosts share this machine's {out['cpus']} CPUs with the controller: CPU columns of the "
                  "median run; its CPU floor: start-up + the rest of its CPU time / CPUs)")
    for name, value in out["ratios"].items():
        console.print(f"ratio {name}: {value:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--name", default="bench", help="sandbox name (short)")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument("--label", default=None, help="name the results by this instead of the git commit")
    parser.add_argument("--shape", action="store_true",
                        help="also time the no-op's shape without servestack's code (modes shape, texts: SHAPE_DEPLOY)")
    options = parser.parse_args()
    sizes = sorted(set(options.hosts))
    lab = Lab(options.name)
    rows: list[dict] = []
    try:
        started = time.perf_counter()
        lab.up(max(sizes))
        console.print(f"lab up: {max(sizes)} host(s) in {time.perf_counter() - started:.1f} s")
        names = [host.name for host in lab.hosts]
        converge(lab, names)
        rows = measure_rounds(lab, names, sizes, options.repeat, options.shape)
    except BenchFailed as error:
        console.print(f"[red]bench failed:[/] {error}", markup=True, highlight=False)
        return 1
    finally:
        lab.down()
    out = {"commit": options.label or git_sha(), "utc": utc_stamp(),
           "cpus": os.cpu_count(), "repeat": options.repeat, "note": options.note, "rows": rows}
    out["ratios"] = ratios(rows)
    path = write_result(out)
    show(rows, out)
    console.print(f"written: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
