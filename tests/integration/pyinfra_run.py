"""Run the real pyinfra CLI against a lab's hosts, from the lab's controller namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).parent / "pyinfra")


@dataclass
class PyinfraRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def totals(self) -> dict:
        """`results.totals` of a `--json` run: success (= changed), no_change, error."""
        return json.loads(self.stdout)["results"]["totals"]


def run_pyinfra(lab, *args: str, target: str = "deploy.py", timeout: int = 900,
                answer: str | None = None) -> PyinfraRun:
    """`pyinfra <lab inventory> <target> ARGS` in the controller namespace, from the project root;
    `answer`: what to type at pyinfra's prompts (without -y it asks before executing)."""
    argv = lab.controller_argv([PYINFRA, str(lab.inventory_path), target, *args])
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            input=answer, stdin=None if answer is not None else subprocess.DEVNULL)
    return PyinfraRun(result.returncode, result.stdout, result.stderr)


def apply(lab, target: str = "deploy.py", *args: str) -> PyinfraRun:
    """A real run (`-y --json`); fails the test with pyinfra's output if it did not succeed."""
    run = run_pyinfra(lab, "-y", "--json", *args, target=target)
    assert run.returncode == 0, run.output[-6000:]
    return run


def dry_run(lab, target: str = "deploy.py", *args: str) -> PyinfraRun:
    run = run_pyinfra(lab, "--dry", "--diff", *args, target=target)
    assert run.returncode == 0, run.output[-6000:]
    return run


def small_benchmark_manifest(lab, max_new_tokens: int, runs: int) -> Path:
    """The lab's manifest with a short speculation benchmark (what a deploy under "auto" measures), no warm-up."""
    text = (lab.state_dir / "stack.toml").read_text()
    for old, new in (("\nmax_new_tokens = 256\n", f"\nmax_new_tokens = {max_new_tokens}\n"),
                     ("\nruns = 10\n", f"\nruns = {runs}\n"), ("\nwarmup = 1\n", "\nwarmup = 0\n")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = lab.state_dir / "stack-small-benchmark.toml"
    path.write_text(text)
    return path
