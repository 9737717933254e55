"""`servestack bench`: the controller side of the speculation benchmark (issue 17).

    servestack bench INVENTORY [--limit L ...] [--runs 10] [--concurrency 1,4,16] [--json FILE] [--plot FILE.png]
                     [--dry | -y]

What is measured, per host: the manifest's fixed request (`[service.speculation_benchmark]`: prompt,
output length, temperature 0) sent `runs` times at concurrency 1 by files/scripts/bench-client.py,
which runs on the host itself over loopback, then `runs` rounds at each further concurrency level;
per run the output tokens/s (the whole request) and the decode tokens/s (after the first token);
the accept length from /server_info. Two configurations: the host's service profile with its
speculative flags ("speculation") and the same without them ("baseline"), each started through the
deploy's own health gate, so each is measured on a freshly started server (operations/speculation.py
does the host side). Under service_speculation = "adaptive" a third, "adaptive": SGLang's adaptive
speculation with the config written from the first two's numbers per concurrency level; the table,
the JSON and the chart show it beside them, and whether it is at or above the better of the two. The
host ends in the configuration its policy chooses, and the measurement and the decision are recorded
on the host (servestack/speculation_policy.py: the policy and the record).

`servestack bench` runs `operations.speculation.bench_now` through pyinfra's CLI (the deploy's lock,
preflight, health gate and recap), then reads each host's record and prints a table per host, and
writes the JSON document (`--json`) and a chart (`--plot`, needs the `plot` extra: matplotlib).
Numbers from the sandbox's stand-in server are SIMULATED, and every output says so.

It restarts production services, so it asks first, as the deploy does: it shows what it would do (a
pyinfra `--dry` run: which hosts it would restart, how often, and how long each restart may wait) and
asks on the terminal; `-y` runs without asking, and without a terminal to ask on it refuses (exit 2)
unless given `-y`. `--dry` shows the plan and changes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterable

from facts.batch import FactRequest
from facts.service import ServiceRecord
from servestack.errors import EXIT_FAILED, EXIT_OK, ConfigError, exit_status
from servestack.manifest import PROJECT_ROOT
from servestack.paths import speculation_record_path
from servestack.speculation_policy import (
    ADAPTIVE,
    BASELINE,
    SPECULATION,
    crossover,
    gain_of,
    level_means,
    means,
    record_decision,
)
from servestack.verify import Unreachable, read_all, report_console, targets_from_inventory

ON_DEMAND = "operations.speculation.bench_now"   # what `servestack bench` runs with pyinfra
SIMULATED_NOTICE = ("SIMULATED: these numbers come from the sandbox's stand-in server (its /server_info says "
                    "servestack_standin), not from SGLang on GPUs")
NOT_APPLICABLE = "n/a"


# --- servestack bench's options -----------------------------------------------------------------

def parse_levels(text: str | None) -> list[int] | None:
    """--concurrency 1,4,16 -> [1, 4, 16]; ConfigError for anything else."""
    if text is None:
        return None
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or any(level < 1 or level > 1024 for level in levels):
        raise ConfigError(f"--concurrency {text!r}: expected comma-separated levels from 1 to 1024, like 1,4,16")
    return sorted(set(levels))


# --- servestack status's column ------------------------------------------------------------------

def status_summary(record: dict | None, active_release: str | None, policy: str | None = None,
                   min_gain: float | None = None) -> dict | str:
    """The speculation column of `servestack status`: "n/a" until a run records a measurement. With the
    host's `policy` and `min_gain`: also what they choose from the recorded numbers now ("now")."""
    found = means(record)
    if record is None or found is None:
        return NOT_APPLICABLE
    speculation, baseline = found
    measured_for = (record.get("identity") or {}).get("release")
    now = None
    if policy is not None and min_gain is not None:
        decision = record_decision(policy, min_gain, record)
        now = decision.configuration if decision else None
    return {"decision": record.get("decision"), "now": now, "policy": record.get("policy"),
            "min_gain": record.get("min_gain"),
            "speculation_tok_s": speculation, "baseline_tok_s": baseline, "gain": record.get("gain"),
            "accept_length": (record["configurations"][SPECULATION] or {}).get("accept_length"),
            "measured_at": record.get("measured_at"), "by": record.get("by"), "release": measured_for,
            "for_active_release": measured_for == active_release, "simulated": bool(record.get("simulated"))}


def status_cell(summary: dict | str) -> str:
    if not isinstance(summary, dict):
        return str(summary)
    gain = "n/a" if summary["gain"] is None else f"{summary['gain']:+.1%}"
    lines = [f"{summary['decision']} ({summary['policy']})",
             f"{summary['speculation_tok_s']:.1f} vs {summary['baseline_tok_s']:.1f} tok/s ({gain})"]
    if summary.get("accept_length") is not None:
        lines.append(f"accept length {summary['accept_length']:.2f}")
    if summary.get("now") not in (None, summary["decision"]):
        lines.append(f"now {summary['now']}: the host's service_speculation settings changed since")
    lines.append(f"measured {summary['measured_at']} by {summary['by']}")
    if not summary["for_active_release"]:
        lines.append(f"for release {summary['release']}, not the active one")
    if summary["simulated"]:
        lines.append("SIMULATED (stand-in)")
    return "\n".join(lines)


# --- the report ----------------------------------------------------------------------------------

def host_report(record: dict | None, request: str | None, failure: str | None = None) -> dict:
    """One host's part of the JSON document: its record when this run measured it."""
    if failure:
        return {"measured": False, "error": failure}
    if record is None or means(record) is None:
        return {"measured": False, "error": "no measurement is recorded on the host (see the run's output above)"}
    if request is not None and record.get("request") != request:
        return {"measured": False, "error": "this run recorded no measurement (see its output above); the last "
                                            f"one is from {record.get('measured_at')} ({record.get('by')})"}
    identity = record.get("identity") or {}
    return {"measured": True, "error": None, "profile": identity.get("profile"), "release": identity.get("release"),
            "policy": record.get("policy"), "min_gain": record.get("min_gain"), "decision": record.get("decision"),
            "why": record.get("why"), "gain": record.get("gain"), "simulated": bool(record.get("simulated")),
            "crossover": crossover(record), "measured_at": record.get("measured_at"), "method": record.get("method"),
            "adaptive": record.get(ADAPTIVE), "configurations": record.get("configurations")}


def document(reports: dict[str, dict], request: str | None = None) -> dict:
    simulated = any(report.get("simulated") for report in reports.values())
    return {"simulated": simulated, "notice": SIMULATED_NOTICE if simulated else None, "request": request,
            "hosts": reports}


def render_json(reports: dict[str, dict], request: str | None = None) -> str:
    return json.dumps(document(reports, request), indent=2)


def _range(stats: dict | None, digits: int = 1) -> str:
    return "-" if not stats else f"{stats['min']:.{digits}f}-{stats['max']:.{digits}f}"


def _mean(stats: dict | None, digits: int = 1) -> str:
    return "-" if not stats else f"{stats['mean']:.{digits}f}"


def shown_configurations(configurations: dict) -> list[str]:
    """The configurations a report shows, in order: speculation, baseline, adaptive where measured."""
    return [config for config in (SPECULATION, BASELINE, ADAPTIVE) if config in configurations]


def adaptive_verdict(configurations: dict) -> str | None:
    """Whether the adaptive configuration is at or above the better of speculation and baseline at each
    level measured (the goal of issue 33); None when it was not measured."""
    adaptive = level_means(configurations, ADAPTIVE)
    if not adaptive:
        return None
    others = [level_means(configurations, config) for config in (SPECULATION, BASELINE)]
    below = [f"{level} ({gain_of(tok_s, max(found[level] for found in others)):+.1%})"
             for level, tok_s in sorted(adaptive.items())
             if all(level in found for found in others) and tok_s < max(found[level] for found in others)]
    levels = ", ".join(map(str, sorted(adaptive)))
    if not below:
        return f"adaptive is at or above the better of speculation and baseline at every level measured ({levels})"
    return ("adaptive is below the better of speculation and baseline at concurrency " + ", ".join(below)
            + f" (levels measured: {levels})")


def host_tables(name: str, report: dict) -> list:
    """The rich tables of one measured host: the configurations at concurrency 1, then per level."""
    from rich.table import Table

    configurations = report["configurations"]
    title = f"{name}: {report['profile']} on {report['release']}"
    if report["simulated"]:
        title += " (SIMULATED by the sandbox stand-in)"
    main = Table(title=title, title_justify="left", min_width=len(title))
    for column in ("configuration", "runs", "mean tok/s", "min-max", "decode tok/s", "TTFT s", "accept length",
                   "gain over baseline"):
        main.add_column(column, justify="left" if column == "configuration" else "right")
    baseline = configurations[BASELINE]["output_tok_s"]["mean"]
    shown = shown_configurations(configurations)
    for config in shown:
        result = configurations[config]
        speed = result["output_tok_s"]
        gain = gain_of(speed["mean"], baseline) if config != BASELINE else None
        accept = result.get("accept_length")
        main.add_row(config, str(len(result["runs"])), _mean(speed), _range(speed), _mean(result["decode_tok_s"]),
                     _mean(result["ttft_s"], 3), "-" if accept is None else f"{accept:.2f}",
                     "-" if gain is None else f"{gain:+.1%}")
    tables = [main]
    levels = [level["concurrency"] for level in configurations[SPECULATION]["concurrency"]]
    if len(levels) > 1:
        heading = f"{name}: aggregate output tok/s by concurrency (mean of the rounds)"
        load = Table(title=heading, title_justify="left", min_width=len(heading))
        adaptive = ADAPTIVE in shown
        for column in ("concurrency", "speculation", "baseline", "gain", *(("adaptive", "adaptive gain")
                                                                             if adaptive else ())):
            load.add_column(column, justify="right")
        by_level = {config: {level["concurrency"]: level["tok_s"] for level in configurations[config]["concurrency"]}
                    for config in shown}
        for level in levels:
            spec, base = by_level[SPECULATION].get(level), by_level[BASELINE].get(level)
            row = [str(level), _mean(spec), _mean(base), _gain(spec, base)]
            if adaptive:
                row += [_mean(by_level[ADAPTIVE].get(level)), _gain(by_level[ADAPTIVE].get(level), base)]
            load.add_row(*row)
        tables.append(load)
    return tables


def _gain(stats: dict | None, base: dict | None) -> str:
    gain = gain_of(stats["mean"], base["mean"]) if stats and base else None
    return "-" if gain is None else f"{gain:+.1%}"


def crossover_text(level: int | None, levels: list[int]) -> str:
    if level is None:
        return f"speculation pays at every concurrency measured ({', '.join(map(str, levels))})"
    if level == min(levels):
        return f"speculation does not pay at any concurrency measured ({', '.join(map(str, levels))})"
    return f"speculation stops paying at concurrency {level}"


def render_tables(reports: dict[str, dict], console) -> None:
    from rich.text import Text

    for name, report in reports.items():
        if not report["measured"]:
            console.print(Text(f"{name}: not measured: {report['error']}", style="bold red"))
            continue
        for table in host_tables(name, report):
            console.print(table)
        console.print(Text(f"{name}: {report['why']}"))
        levels = [entry["concurrency"] for entry in report["configurations"][SPECULATION]["concurrency"]]
        if len(levels) > 1:
            console.print(Text(f"{name}: {crossover_text(report['crossover'], levels)}"))
        verdict = adaptive_verdict(report["configurations"])
        if verdict:
            console.print(Text(f"{name}: {verdict}"))
    if any(report.get("simulated") for report in reports.values()):
        console.print(Text(SIMULATED_NOTICE, style="bold yellow"))


def plot(reports: dict[str, dict], path: str | Path) -> Path:
    """A PNG: per measured host, output tok/s per run at concurrency 1 and aggregate tok/s per
    concurrency, speculation vs baseline."""
    import matplotlib  # the optional `plot` extra: imported only when a chart is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    measured = {name: report for name, report in reports.items() if report["measured"]}
    if not measured:
        raise ConfigError("--plot: no host was measured, nothing to plot")
    colours = {SPECULATION: "tab:blue", BASELINE: "tab:orange", ADAPTIVE: "tab:green"}
    figure, axes = plt.subplots(len(measured), 2, figsize=(12, 4.2 * len(measured)), squeeze=False)
    for row, (name, report) in enumerate(measured.items()):
        per_run, per_level = axes[row]
        shown = shown_configurations(report["configurations"])
        for config in shown:
            result = report["configurations"][config]
            speeds = [run["output_tok_s"] for run in result["runs"]]
            runs = range(1, len(speeds) + 1)
            accept = result.get("accept_length")
            label = f"{config} (mean {result['output_tok_s']['mean']:.1f}" + (
                f", accept length {accept:.2f})" if accept is not None else ")")
            per_run.plot(runs, speeds, marker="o", color=colours[config], label=label)
            per_run.axhline(result["output_tok_s"]["mean"], color=colours[config], linestyle="--", linewidth=1)
            levels = result["concurrency"]
            per_level.plot([level["concurrency"] for level in levels], [level["tok_s"]["mean"] for level in levels],
                           marker="o", color=colours[config], label=config)
        by_level = {config: level_means(report["configurations"], config) for config in shown}
        for level, spec in by_level[SPECULATION].items():
            base = by_level[BASELINE].get(level)
            level_gain = gain_of(spec, base) if base else None
            if base and level_gain is not None:
                per_level.annotate(f"{level_gain:+.1%}", (level, max(spec, base)), textcoords="offset points",
                                   xytext=(0, 8), ha="center", fontsize=9,
                                   color=colours[SPECULATION] if level_gain > 0 else colours[BASELINE])
        gain = report["gain"]
        per_run.set_title(f"{name}: concurrency 1, output tok/s per run"
                          + ("" if gain is None else f" (speculation {gain:+.1%})"))
        per_run.set_xlabel("run")
        per_run.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        per_run.set_ylabel("output tokens/s")
        per_run.set_ylim(0, 1.2 * max(run["output_tok_s"] for config in shown
                                      for run in report["configurations"][config]["runs"]))
        per_run.legend(loc="lower right")
        per_run.grid(alpha=0.3)
        per_level.set_title(f"{name}: aggregate output tok/s by concurrency (speculation's gain)")
        per_level.set_xlabel("concurrent requests")
        per_level.set_ylabel("output tokens/s (all requests)")
        per_level.set_xscale("log", base=2)
        per_level.set_xticks([level["concurrency"] for level in report["configurations"][SPECULATION]["concurrency"]])
        per_level.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        if report["crossover"] and report["crossover"] > 1:
            per_level.axvline(report["crossover"], color="grey", linestyle=":",
                              label=f"crossover {report['crossover']}")
        per_level.set_ylim(0, 1.15 * max(max(by_level[config].values()) for config in shown))
        per_level.legend(loc="upper left")
        per_level.grid(alpha=0.3)
    simulated = any(report["simulated"] for report in measured.values())
    adaptive = any(ADAPTIVE in report["configurations"] for report in measured.values())
    figure.suptitle("servestack bench: speculation vs baseline" + (" vs adaptive" if adaptive else "")
                    + (" - SIMULATED by the sandbox stand-in, not GPU measurements" if simulated else ""),
                    color="darkred" if simulated else "black")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# --- servestack bench ----------------------------------------------------------------------------

def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def pyinfra_argv(inventory: str, limit: Iterable[str] | None, options: dict, dry: bool = False) -> list[str]:
    limits = [word for pattern in limit or () for word in ("--limit", pattern)]
    return [str(Path(sys.executable).parent / "pyinfra"), "--dry" if dry else "-y", *limits,
            str(Path(inventory).resolve()), ON_DEMAND, json.dumps([[], options])]


NO_TERMINAL = ("servestack bench restarts the service of every host it measures, twice: pass -y to run without "
               "asking, or --dry to see what it would do (standard input is not a terminal to ask on)")


def confirmed(stdin=None) -> bool:
    """The operator's answer, after the plan was shown; y or yes goes on."""
    stdin = stdin or sys.stdin
    print("Restart the services above and benchmark them? [y/N] ", end="", file=sys.stderr, flush=True)
    return stdin.readline().strip().lower() in ("y", "yes")


def run_pyinfra(argv: list[str]) -> int:
    return subprocess.run(argv, cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL, stdout=sys.stderr).returncode


def bench_main(inventory: str, limit: Iterable[str] | None = None, runs: int | None = None,
               concurrency: str | None = None, json_path: str | None = None, plot_path: str | None = None,
               yes: bool = False, dry: bool = False) -> int:
    """Benchmark every host (pyinfra, `operations.speculation.bench_now`), then report from the hosts'
    records; 0 when every host was measured, 1 when one was not, 3 when a host could not be read
    (servestack/errors.py). The CLI checks the output paths before anything runs. Unless `yes`, the plan
    is shown first and the operator asked (`dry`: the plan only, nothing restarted)."""
    levels = parse_levels(concurrency)
    if runs is not None and runs < 1:
        raise ConfigError(f"--runs {runs}: expected at least 1")
    if plot_path and not plotting_available():
        raise ConfigError("--plot needs matplotlib, the 'plot' extra: uv sync --extra plot "
                          "(or pip install 'servestack[plot]')")
    targets = targets_from_inventory(inventory, limit, action="benchmark", local=False)
    if not (yes or dry) and not sys.stdin.isatty():
        raise ConfigError(NO_TERMINAL)
    request = f"bench-{uuid.uuid4().hex[:12]}"
    options = {"runs": runs, "concurrency": levels, "request": request}
    if not yes:
        status = run_pyinfra(pyinfra_argv(inventory, limit, options, dry=True))
        if dry or status != 0 or not confirmed():
            print("servestack bench: nothing was restarted or measured", file=sys.stderr)
            return EXIT_OK if status == 0 else EXIT_FAILED
    status = run_pyinfra(pyinfra_argv(inventory, limit, options))
    found = read_all(targets, lambda target: [FactRequest.of(ServiceRecord,
                                                              path=speculation_record_path(target.settings))])
    reports = {}
    for target in targets:
        value = found[target.name]
        reports[target.name] = (host_report(None, request, f"cannot read its record: {value}")
                                if isinstance(value, Unreachable) else host_report(value[0], request))
    render_tables(reports, report_console())
    if json_path:
        Path(json_path).write_text(render_json(reports, request) + "\n")
    if plot_path and any(report["measured"] for report in reports.values()):
        plot(reports, plot_path)
    elif plot_path:
        print(f"servestack bench: --plot {plot_path}: no chart drawn: no host was measured", file=sys.stderr)
    unread = {name for name, value in found.items() if isinstance(value, Unreachable)}
    failed = any(not report["measured"] for name, report in reports.items() if name not in unread)
    return exit_status(failed or (status != 0 and not unread), bool(unread))
