"""A stack's wheel hashes, fixed once on the control machine for every host (pure functions and the
controller's own file; no host access).

A release's lock takes its hashes from the index that answers when the host resolves it. So that a
mirror, or a later host, cannot change what is installed, the first release built of a stack fixes
them: `<stack_locks_dir>/<stack>-<pins digest>-py<series>-<arch>.json`, one per stack and pins, host Python
series and architecture (the resolution can differ between them), written from that release's lock::

    {"stack": "sglang-0.5.9", "python": "3.11", "arch": "x86_64",
     "fixed": "<UTC> by <host>, release r-...",
     "packages": {"torch": {"version": "2.9.1+cu130", "hashes": ["sha256:..."]}, ...}}

Every later build of that stack, on any host and from any index, must resolve the same packages and
versions, and may list only files whose hashes are fixed (a mirror may carry fewer of a version's
files, never other bytes); otherwise the host tool refuses the build (ml_env.py
`fixed_hash_problems`) and nothing switches. The install itself checks every file against those
hashes. Commit the file: it is what makes two controllers agree. Deleting it lets the next build fix
the hashes anew.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from servestack.errors import ConfigError
from servestack.hostcode import write_atomically


def hashes_path(locks_dir: str, inputs: dict) -> Path:
    """Where the hashes of the stack a release's `inputs` name are fixed: by its name, a digest of its pins and
    upload-time bound (not of the indexes: a mirror must not matter), the host's Python series and architecture.
    New pins make a new file: they resolve anew."""
    pins = [[package["name"], package["version"]] for package in inputs["packages"]]
    digest = hashlib.sha256(json.dumps([pins, inputs["exclude_newer"], inputs["torch_cuda"]]).encode()).hexdigest()
    return Path(locks_dir) / f"{inputs['stack']}-{digest[:8]}-py{inputs['python']}-{inputs['arch']}.json"


def read_fixed(path: Path) -> dict | None:
    """The fixed document at `path`, or None when none is fixed yet. Raises ConfigError naming the file when
    it is there but not a fixed-hashes document."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read the stack's fixed hashes: {error}") from None
    packages = document.get("packages") if isinstance(document, dict) else None
    if not isinstance(packages, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("hashes"), list) for entry in packages.values()):
        raise ConfigError(f"{path}: expected a JSON object whose 'packages' maps each name to "
                          "{'version', 'hashes'} (written by servestack when a stack's first release is built)")
    return document


def fixed_document(inputs: dict, packages: dict, by: str, at: str) -> dict:
    return {"stack": inputs["stack"], "python": inputs["python"], "arch": inputs["arch"], "fixed": f"{at} by {by}",
            "packages": packages}


def write_fixed(path: Path, document: dict) -> None:
    """Write the document atomically (servestack/hostcode.py: a new file beside it, then rename), creating the
    folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(str(path), json.dumps(document, indent=1, sort_keys=True) + "\n")
