"""CUDA toolkits on a host: the tree at the install path, the kept toolkits, the `/usr/local/cuda`
link chain, servestack's record of them, and the cached runfile.

`CudaToolkits` answers everything the toolkit step decides from, in one remote command that only
stats and reads small files: on a converged host it never reads the runfile.
`ToolkitFingerprint` (a `find` over one tree: the toolkit step records it, the verify step
compares) and `RunfileDigest` (md5 and sha256 of one file, read concurrently, only when an install
is due) are separate because they cost more. The first two are files/scripts/cuda-toolkits.sh.

toolkits.json (`<servestack_state_dir>/toolkits.json`), written by operations/toolkit.py and read
by the verification suite::

    {"schema": 1,
     "target": {"version": "13.0.1", "path": "/usr/local/cuda-13.0", "nvcc_version": "13.0.88"},
     "recorded": "<UTC>", "run_id": "...",
     "toolkits": {"/usr/local/cuda-12.8": {"present": true, "nvcc_version": "12.8.93",
                  "nvcc": "<nvcc --version text>", "version_json": {...} | null,
                  "files": 42, "files_sha256": "<sha256 of the sorted file list with sizes>",
                  "mtimes_sha256": "<sha256 of the sorted files' modification times>"}},
     "link": {"path": "/usr/local/cuda", "hops": [["/usr/local/cuda", "/usr/local/cuda-12.8"]],
              "resolved": "/usr/local/cuda-12.8", "kind": "link"},
     "installed": {"version": "13.0.1", "path": ..., "nvcc_version": ..., "at": "<UTC>",
                   "run_id": ..., "link_policy": "keep", "link": {...}} | absent}
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from servestack.paths import kept_paths, runfile_candidates
from servestack.scripts import script_command

_NVCC = re.compile(r"release (\d+\.\d+), V(\d+(?:\.\d+)+)")


@dataclass(frozen=True)
class NvccVersion:
    """What `nvcc --version` reports: `release` ("13.0") and full `version` ("13.0.88")."""

    release: str
    version: str


def parse_nvcc_version(text: str) -> NvccVersion | None:
    """Parse `nvcc --version` output; None when it names no release."""
    match = _NVCC.search(text)
    return NvccVersion(match.group(1), match.group(2)) if match else None


def parse_json_object(text: str) -> dict | None:
    """A JSON object, or None when the text is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class Tree:
    """A toolkit directory as found: existence, its nvcc, version.json and package owner."""

    path: str
    exists: bool = False
    empty: bool = False
    symlink_to: str | None = None
    nvcc: NvccVersion | None = None
    nvcc_text: str = ""
    nvcc_error: str | None = None
    version_json: dict | None = None
    version_json_invalid: bool = False
    dpkg_owner: str | None = None


@dataclass(frozen=True)
class LinkChain:
    """`/usr/local/cuda` and each symlink hop behind it, as recorded in toolkits.json."""

    path: str
    hops: tuple[tuple[str, str], ...] = ()
    resolved: str | None = None
    kind: str = "absent"        # "link", "dangling", "directory", "file" or "absent"

    def describe(self) -> str:
        if self.kind == "absent":
            return f"{self.path} (absent)"
        if not self.hops:
            return f"{self.path} (a {self.kind}, not a link)"
        text = " -> ".join([self.hops[0][0]] + [target for _, target in self.hops])
        return text + (" (dangling)" if self.kind == "dangling" else "")

    def to_record(self) -> dict:
        return {"path": self.path, "hops": [list(hop) for hop in self.hops],
                "resolved": self.resolved, "kind": self.kind}

    @classmethod
    def from_record(cls, record: dict) -> "LinkChain":
        return cls(record["path"], tuple(tuple(hop) for hop in record.get("hops", ())),
                   record.get("resolved"), record.get("kind", "link"))


@dataclass(frozen=True)
class FileStat:
    """Size, mtime and inode of a file (what identifies "the same file" within one run)."""

    path: str
    size: int
    mtime: int
    inode: int


@dataclass(frozen=True)
class ToolkitState:
    """Everything the toolkit step decides from (see `CudaToolkits`)."""

    install: Tree
    arch: str | None = None
    kept: dict = field(default_factory=dict)          # path -> present (bool)
    link: LinkChain = LinkChain("/usr/local/cuda")
    record: dict | None = None                        # parsed toolkits.json
    record_invalid: bool = False
    marker: dict | None = None                        # an install in progress (toolkit-install.json)
    files: dict = field(default_factory=dict)         # path -> FileStat | None




def parse_tree(path: str, lines: list[str]) -> Tree:
    """Parse the `tree_*` lines of cuda-toolkits.sh `state`."""
    values: dict = {"path": path}
    nvcc_lines, nvcc_exit = [], None
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "tree_exists":
            values["exists"] = True
        elif key == "tree_empty":
            values.update(exists=True, empty=True)
        elif key == "tree_symlink":
            values["symlink_to"] = rest
        elif key == "tree_nvcc_exit":
            nvcc_exit = int(rest)
        elif key == "tree_nvcc":
            nvcc_lines.append(rest)
        elif key == "tree_version_json":
            parsed = parse_json_object(rest)
            values["version_json"] = parsed
            values["version_json_invalid"] = parsed is None
        elif key == "tree_dpkg":
            values["dpkg_owner"] = rest.split(":", 1)[0].strip() or rest
    nvcc_text = "\n".join(nvcc_lines)
    if nvcc_exit is not None:
        values["nvcc_text"] = nvcc_text
        values["nvcc"] = parse_nvcc_version(nvcc_text) if nvcc_exit == 0 else None
        if nvcc_exit != 0 or values["nvcc"] is None:
            detail = nvcc_lines[-1].strip() if nvcc_lines else "no output"
            values["nvcc_error"] = f"bin/nvcc --version failed (exit {nvcc_exit}): {detail}"
    elif values.get("exists") and not values.get("empty"):
        values["nvcc_error"] = "no bin/nvcc"
    return Tree(**values)


def parse_link_chain(path: str, lines: list[str]) -> LinkChain:
    """Parse the `hop`, `link_kind` and `link_resolved` lines of cuda-toolkits.sh `state`."""
    hops, kind, resolved = [], "absent", None
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "hop":
            link, _, target = rest.partition(" -> ")
            hops.append((link, target))
        elif key == "link_kind":
            kind = rest.strip()
        elif key == "link_resolved":
            resolved = rest
    return LinkChain(path, tuple(hops), resolved, kind)


def stat_command(path: str) -> str:
    """Print `file <size> <mtime> <inode> <path>` or `nofile <path>`."""
    p = shlex.quote(path)
    return (f"if [ -f {p} ]; then printf 'file %s %s\\n' \"$(stat -c '%s %Y %i' {p})\" {p}; "
            f"else printf 'nofile %s\\n' {p}; fi")


def parse_stats(lines: list[str]) -> dict:
    files: dict = {}
    for line in lines:
        if line.startswith("file "):
            size, mtime, inode, path = line[5:].split(" ", 3)
            files[path] = FileStat(path, int(size), int(mtime), int(inode))
        elif line.startswith("nofile "):
            files[line[7:]] = None
    return files


def toolkits_command(install_path: str, keep_paths: tuple[str, ...], link_path: str,
                     state_dir: str, files: tuple[str, ...]) -> str:
    return script_command("cuda-toolkits.sh", "state", install_path, link_path, state_dir, *keep_paths, "--", *files)


def parse_toolkits(install_path: str, link_path: str, lines: list[str]) -> ToolkitState:
    kept = {}
    record = marker = arch = None
    record_invalid = False
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "arch":
            arch = rest.strip() or None
        elif key == "keep":
            present, _, path = rest.partition(" ")
            kept[path] = present == "1"
        elif key == "record":
            record = parse_json_object(rest)
            record_invalid = record is None
        elif key == "marker":
            marker = parse_json_object(rest) or {"invalid": rest}
    return ToolkitState(
        arch=arch,
        install=parse_tree(install_path, lines),
        kept=kept,
        link=parse_link_chain(link_path, lines),
        record=record,
        record_invalid=record_invalid,
        marker=marker,
        files=parse_stats(lines),
    )


class CudaToolkits(FactBase):
    """The install path's tree, kept toolkits' presence, the link chain, records, runfile stats.

    + install_path: where the wanted toolkit goes (e.g. /usr/local/cuda-13.0)
    + keep_paths: toolkits that must stay untouched (e.g. ("/usr/local/cuda-12.8",))
    + link_path: the shared link (/usr/local/cuda)
    + state_dir: servestack's state directory (toolkits.json, toolkit-install.json)
    + files: runfile paths to stat (cached file, partial download, pre-staged file)
    """

    slow = True  # starts nvcc (facts/batch.py)

    def command(self, install_path, keep_paths, link_path, state_dir, files=()):
        self.install_path, self.link_path = install_path, link_path   # for process (pyinfra's own way)
        return toolkits_command(install_path, tuple(keep_paths), link_path, state_dir, tuple(files))

    @staticmethod
    def default():
        return None

    def process(self, output):
        return parse_toolkits(self.install_path, self.link_path, output)


def toolkit_fact_arguments(settings) -> dict:
    """`CudaToolkits`' arguments for a host: what the toolkit step, preflight and the checks read."""
    return {
        "install_path": settings.cuda_install_path,
        "keep_paths": kept_paths(settings),
        "link_path": settings.manifest.cuda["link_path"],
        "state_dir": settings.servestack_state_dir,
        "files": runfile_candidates(settings),
    }


@dataclass(frozen=True)
class Fingerprint:
    """What must not change in a kept toolkit: nvcc, version.json, the file list with sizes and the files'
    modification times (a file rewritten with its size unchanged). A record made before fingerprints had
    the times (no `mtimes_sha256`) is compared without them.

    What it cannot see: a file rewritten with both its size and its modification time kept (`cp -p`,
    `touch -r`, `tar -x` of a same-size file with the same time), and changes of owner or mode.
    """

    path: str
    present: bool
    nvcc_version: str | None = None
    nvcc: str = ""
    version_json: dict | None = None
    files: int = 0
    files_sha256: str | None = None
    mtimes_sha256: str | None = None

    def to_record(self) -> dict:
        return {"present": self.present, "nvcc_version": self.nvcc_version, "nvcc": self.nvcc,
                "version_json": self.version_json, "files": self.files, "files_sha256": self.files_sha256,
                "mtimes_sha256": self.mtimes_sha256}

    @classmethod
    def from_record(cls, path: str, record: dict) -> "Fingerprint":
        return cls(path, bool(record.get("present")), record.get("nvcc_version"), record.get("nvcc", ""),
                   record.get("version_json"), int(record.get("files") or 0), record.get("files_sha256"),
                   record.get("mtimes_sha256"))

    def differences(self, other: "Fingerprint") -> list[str]:
        """What changed from `self` (the record) to `other` (now), in words."""
        if self.present != other.present:
            return ["was present, now missing" if self.present else "was absent, now present"]
        changes = []
        if self.nvcc_version != other.nvcc_version:
            changes.append(f"nvcc reported {self.nvcc_version}, now {other.nvcc_version}")
        if self.version_json != other.version_json:
            changes.append("version.json changed")
        if (self.files, self.files_sha256) != (other.files, other.files_sha256):
            changes.append(f"file list or sizes changed ({self.files} files before, {other.files} now)")
        elif None not in (self.mtimes_sha256, other.mtimes_sha256) and self.mtimes_sha256 != other.mtimes_sha256:
            changes.append(f"a file was rewritten with its size unchanged: same {self.files} files and sizes, "
                           "other modification times")
        return changes


def fingerprint_command(path: str) -> str:
    """The fingerprint lines of the tree at `path`: nvcc, version.json, file count and hash."""
    return script_command("cuda-toolkits.sh", "fingerprint", path)


def parse_fingerprint(path: str, lines: list[str]) -> Fingerprint:
    if "fp_present" not in lines:
        return Fingerprint(path, present=False)
    nvcc_lines, nvcc_exit, version_json, files, files_sha256, mtimes_sha256 = [], None, None, 0, None, None
    for line in lines:
        key, _, rest = line.partition(" ")
        if key == "fp_nvcc":
            nvcc_lines.append(rest)
        elif key == "fp_nvcc_exit":
            nvcc_exit = int(rest)
        elif key == "fp_version_json":
            version_json = parse_json_object(rest)
        elif key == "fp_files":
            count, _, digest = rest.partition(" ")
            files, files_sha256 = int(count), digest.strip()
        elif key == "fp_mtimes":
            mtimes_sha256 = rest.strip()
    text = "\n".join(nvcc_lines)
    nvcc = parse_nvcc_version(text) if nvcc_exit == 0 else None
    return Fingerprint(path, True, nvcc.version if nvcc else None, text, version_json, files, files_sha256,
                       mtimes_sha256)


class ToolkitFingerprint(FactBase):
    """Fingerprint (`Fingerprint`) of the toolkit tree at `path`, computed on the host in one command.

    + path: toolkit root, e.g. /usr/local/cuda-12.8
    """

    def command(self, path):
        self.path = path
        return fingerprint_command(path)

    @staticmethod
    def default():
        return None

    def process(self, output):
        return parse_fingerprint(self.path, output)


@dataclass(frozen=True)
class Digest:
    """Size, md5 and sha256 of a file, with the stat that identifies the bytes hashed."""

    path: str
    present: bool
    stat: FileStat | None = None
    md5: str | None = None
    sha256: str | None = None


def digest_command(path: str) -> str:
    """Stat, then md5sum and sha256sum run concurrently (the page cache makes it one disk read)."""
    p = shlex.quote(path)
    return (f"if [ -f {p} ]; then {stat_command(path)}; "
            f"{{ md5sum {p} | sed 's/^/md5 /' & sha256sum {p} | sed 's/^/sha256 /'; wait; }}; "
            f"else printf 'nofile %s\\n' {p}; fi")


def parse_digest(path: str, lines: list[str]) -> Digest:
    stat = parse_stats(lines).get(path)
    if stat is None:
        return Digest(path, present=False)
    sums = {}
    for line in lines:
        key, _, rest = line.partition(" ")
        if key in ("md5", "sha256"):
            sums[key] = rest.split()[0].lstrip("\\") if rest.split() else None
    return Digest(path, True, stat, sums.get("md5"), sums.get("sha256"))


class RunfileDigest(FactBase):
    """md5 and sha256 of the file at `path` (reads it once; only when an install is due: preflight
    reads it, and the toolkit step reuses that read in the same stage).

    + path: the runfile
    """

    def command(self, path):
        self.path = path
        return digest_command(path)

    @staticmethod
    def default():
        return None

    def process(self, output):
        return parse_digest(self.path, output)
