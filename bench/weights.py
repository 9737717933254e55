"""Benchmark: the bytes a converge takes from the STAND-IN Hub (issue 31). Run by hand (root, sandbox tools),
not a test:

    .venv/bin/python bench/weights.py

One lab host on the default profile (Kimi-K2.5-NVFP4 with its EAGLE-3 draft, pinned to the stand-in Hub's
commits: sandbox/standins/hub.py serves them under the artifact server's /hub):

1. fresh: the first converge stages the model and the draft. Measured: the bytes of files the stand-in Hub
   sent (resolve bodies) against the two revisions' total size (goal: each file once), and its requests;
2. converged: the next converge. Measured the same (goal: no byte and no request: a staged host reads only
   the weights step's records).

Writes bench/results/<git short sha>[-dirty]-weights-<UTC>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import git_sha, utc_stamp, write_result  # noqa: E402
from sandbox.lab import ARTIFACT_PORT, Lab  # noqa: E402
from sandbox.standins import hub  # noqa: E402
from servestack.manifest import load_manifest  # noqa: E402

console = Console()


def control(lab: Lab, method: str) -> list | dict:
    """A call of the artifact server's control client (sandbox.artifacts.ArtifactControl), in the lab's
    controller namespace."""
    code = (f"import json; from sandbox.artifacts import ArtifactControl as C; "
            f"print(json.dumps(C('http://127.0.0.1:{ARTIFACT_PORT}').{method}()))")
    result = subprocess.run(lab.controller_argv([sys.executable, "-c", code]), cwd=ROOT, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout)


def converge(lab: Lab) -> dict:
    """One converge (`-y --json`) from a reset request log: its time, changes and what it took from the Hub."""
    control(lab, "reset")
    argv = lab.controller_argv([str(Path(sys.executable).parent / "pyinfra"), str(lab.inventory_path), "deploy.py",
                                "-y", "--json"])
    started = time.perf_counter()
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"deploy.py failed:\n{(result.stdout + result.stderr)[-4000:]}")
    records = [record for record in control(lab, "requests") if record["path"].startswith(hub.PREFIX + "/")]
    return {"converge_s": round(elapsed, 1), "changes": json.loads(result.stdout)["results"]["totals"]["success"],
            "hub_bytes": hub.served_bytes(records),
            "hub_requests": {kind: sum(1 for record in records if test(record)) for kind, test in (
                ("api", lambda record: "/api/models/" in record["path"]),
                ("resolve_head", lambda record: "/resolve/" in record["path"] and record["method"] == "HEAD"),
                ("resolve_get", lambda record: "/resolve/" in record["path"] and record["method"] == "GET"))}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="bench-weights", help="the lab's sandbox name")
    options = parser.parse_args()
    manifest = load_manifest()
    profile = manifest.service["profiles"][manifest.service["profile"]]
    repos = hub.repositories()
    served = [repos[profile[key]] for key in ("model_path", "draft_model_path") if profile.get(key) in repos]
    out: dict = {"commit": git_sha(), "utc": utc_stamp(),
                 "profile": manifest.service["profile"], "models": {
                     repo.repo: {"files": len(repo.files), "bytes": sum(len(item.data) for item in repo.files)}
                     for repo in served}}
    out["revisions_bytes"] = sum(model["bytes"] for model in out["models"].values())
    lab = Lab(options.name)
    try:
        lab.up(1)
        for stage in ("fresh", "converged"):
            out[stage] = converge(lab)
            out[stage]["sent_over_revisions"] = round(out[stage]["hub_bytes"] / out["revisions_bytes"], 4)
            console.print(f"{stage}: {out[stage]}")
    finally:
        lab.down()
    path = write_result(out, "weights")
    console.print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
