"""Reading a converged host (servestack/reads.py): a no-op converge reads each host in one remote
command per stage, a dry run changes nothing, and the counts hold for the real deploy.py.

Remote commands are counted by bench/counting_pyinfra.py (a wrapper of pyinfra's SSH connector).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from facts.batch import section_name
from facts.framing import BEGIN
from facts.toolkit import toolkits_command
from pyinfra_run import ROOT, apply, run_pyinfra
from servestack.paths import kept_paths, runfile_candidates
from servestack.settings import host_settings
from servestack.fleet import load_inventory

pytestmark = pytest.mark.integration

COUNTER = ROOT / "bench" / "counting_pyinfra.py"
MAX_NOOP_COMMANDS = 4     # the prepare read, the lock's take, the execute read under the lock, the release
MAX_DRY_COMMANDS = 2      # the read before and after the planned release is known


def counted_run(lab, *args: str, texts: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """pyinfra's CLI with the deploy, counting remote commands (`texts`: keep each command's text there)."""
    env = {**os.environ, **({"BENCH_COMMAND_TEXTS": str(texts)} if texts else {})}
    with tempfile.NamedTemporaryFile(suffix=".json") as counts:
        argv = lab.controller_argv([sys.executable, str(COUNTER), counts.name, str(lab.inventory_path),
                                    "deploy.py", *args])
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        return result, json.loads(Path(counts.name).read_text() or "{}")


def toolkit_reads(texts: Path, settings) -> int:
    """How many times the commands sent read the toolkits (their command's text, wherever it is)."""
    command = toolkits_command(settings.cuda_install_path, kept_paths(settings), settings.manifest.cuda["link_path"],
                               settings.servestack_state_dir, tuple(runfile_candidates(settings)))
    return sum(path.read_text().count(command) for path in texts.iterdir())


def test_a_converged_host_is_read_in_a_handful_of_commands(lab):
    the_lab = lab(1)
    apply(the_lab)
    first, counts = counted_run(the_lab, "-y", "--json")
    assert first.returncode == 0 and json.loads(first.stdout)["results"]["totals"]["success"] == 0, first.stderr[-4000:]
    assert counts["h1"]["commands"] <= MAX_NOOP_COMMANDS and counts["h1"]["transfers"] == 0, counts
    texts = Path(tempfile.mkdtemp(prefix="servestack-commands-"))
    try:
        noop, counts = counted_run(the_lab, "-y", "--json", "-v", texts=texts)  # -v: pyinfra shows no-op reasons
        assert noop.returncode == 0, noop.stderr[-4000:]
        assert json.loads(noop.stdout)["results"]["totals"]["success"] == 0
        assert counts["h1"]["commands"] <= MAX_NOOP_COMMANDS and counts["h1"]["transfers"] == 0, counts
        # preflight and the toolkit step share one read of the toolkits per stage (nvcc, records, runfile stats)
        assert toolkit_reads(texts, host_settings(list(load_inventory(the_lab.inventory_path))[0])) == 2
        # the execute stage reads the host after the lock's take, under the lock
        sent = [path.read_text() for path in sorted(texts.iterdir())]
        take = [index for index, text in enumerate(sent) if "lock.sh take" in text.replace("'", "")]
        reads = [index for index, text in enumerate(sent) if f"echo '{BEGIN}{section_name(0)}'" in text]  # batches
        assert len(take) == 1 and len(reads) == 2 and reads[0] < take[0] < reads[1], (take, reads)
        # under -y pyinfra runs no operation while it prepares: that read is what the deploy decides
        # from (preflight, which also judges whether systemd runs the host, and the release plan); the
        # operations' own reads (the secrets file's hash) come at execute
        unit_state, secrets = "systemctl show --property=LoadState", "/etc/servestack/sglang.service.env"
        assert unit_state in sent[reads[0]] and secrets not in sent[reads[0]] and secrets in sent[reads[1]]
        # under the lock the lock is not read again: the take said this run holds it
        lock_read = "lock.sh read /var/lib/servestack"
        assert lock_read in sent[reads[0]] and lock_read not in sent[reads[1]]
    finally:
        shutil.rmtree(texts, ignore_errors=True)
    # the heavy checks (torch, the CUDA sample, the patch check) were recorded by the converge and reused
    assert "not re-run: recorded at" in noop.stderr, noop.stderr[-4000:]
    record = json.loads(the_lab.exec(the_lab.hosts[0], "cat /var/lib/servestack/verified.json", check=True).stdout)
    assert {"cuda_sample", "torch_cuda_build", "patches_applied"} <= set(record["checks"])

    before = the_lab.fingerprints()
    dry, counts = counted_run(the_lab, "--dry")
    assert dry.returncode == 0, dry.stderr[-4000:]
    assert the_lab.fingerprints() == before, "a dry run changed a host"
    assert counts["h1"]["commands"] <= MAX_DRY_COMMANDS, counts


ANOTHER_RUN = "tests/integration/deploys/another_run_between_stages.py"


def changes_in_results_table(output: str) -> int:
    """The "Success" (changed) column of the "Grand total" row of pyinfra's results table."""
    row = [line.split() for line in output.splitlines() if line.strip().startswith("Grand total")][-1]
    return 0 if row[3] == "-" else int(row[3])


def test_another_run_between_prepare_and_execute_is_seen_by_the_read_under_the_lock(lab):
    """Another run that took the lock between this run's prepare and execute stages (here: it edits
    the unit file) is seen: execute reads the host again once it holds the lock, and puts the unit
    back. Without -y, prepare reads everything, and pyinfra waits for the user's go between the stages."""
    the_lab = lab(1)
    apply(the_lab)
    host = the_lab.hosts[0]
    run = run_pyinfra(the_lab, target=ANOTHER_RUN, answer="\n")  # (with --json, pyinfra would only plan)
    assert run.returncode == 0, run.output[-6000:]
    assert changes_in_results_table(run.output) >= 1, "the unit the other run edited was not put back"
    unit = the_lab.exec(host, "cat /etc/systemd/system/sglang.service", check=True).stdout
    assert "edited by another servestack run" not in unit
