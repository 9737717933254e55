"""How a benchmark keeps its figures (every script in bench/): one JSON file in bench/results/, named by the
commit measured (with -dirty when tracked files differ from it), the benchmark's kind and the UTC time."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def git_sha() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (sha.strip() or "nogit") + ("-dirty" if dirty else "")


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_result(out: dict, kind: str = "") -> Path:
    """Write `out` as bench/results/<commit>[-<kind>]-<utc>.json; its 'commit' and 'utc' are set here
    unless the benchmark set them (a label instead of the commit)."""
    out.setdefault("commit", git_sha())
    out.setdefault("utc", utc_stamp())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "-".join(part for part in (out["commit"], kind, out["utc"]) if part)
    path = path.with_name(path.name + ".json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path
