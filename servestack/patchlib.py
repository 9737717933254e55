"""Exact unified-diff engine for servestack's source patches (stdlib only).

The same source runs in two places: locally (unit tests) and on the target host, where
files/scripts/patch-check.sh runs it with the environment's own python as
`python -I -c THIS_FILE SETS REQUEST` (servestack/scripts.py; `main` reads the arguments).
Hunks match exactly: every context and removed line must be identical, hunks may move
(offset) but there is no fuzz, unlike GNU patch, which happily applies the Kimi patch a
second time to sglang 0.5.10 with fuzz 2.

A patch is in one of four states on a tree:
  applied     its result is there (reverse-applies exactly): nothing to do
  applicable  its context is there (applies exactly)
  upstream    not applicable, but every block of lines it adds is already present
              (the target gained the change by other means, e.g. a newer release)
  conflict    anything else; reported with the file, hunk and reason
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import os
import re
import sys
import types
import zlib
from dataclasses import dataclass
from pathlib import Path

from servestack.hostcode import move_into_place, new_file_beside, remove_if_there, section

APPLIED = "applied"
APPLICABLE = "applicable"
UPSTREAM = "upstream"
CONFLICT = "conflict"

RECORD_NAME = "servestack-patches.json"
RESULT = "result"   # the facts/framing.py section `main` prints its answer in
SUMS_HEADER = "servestack-patch-sums 1"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """A patch set cannot be applied; nothing was changed."""


class PatchFormatError(PatchError):
    """A patch file is not a unified diff this engine supports."""


@dataclass(frozen=True)
class Hunk:
    number: int  # 1-based position in its file section, as GNU patch counts
    header: str
    old_start: int
    new_start: int
    old: tuple  # lines (with their "\n") the hunk expects
    new: tuple  # lines the hunk leaves
    added: tuple  # blocks of consecutive added lines


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to site-packages
    hunks: tuple


@dataclass
class FileResult:
    path: str
    state: str
    before: str | None = None  # the file without this patch
    after: str | None = None  # the file with it
    conflict: dict | None = None

    def hashes(self) -> dict:
        return {"sha256_before": _sha256_text(self.before), "sha256": _sha256_text(self.after)}


@dataclass
class PatchResult:
    name: str
    sha256: str
    state: str
    files: list
    conflict: dict | None = None
    check: str | None = None  # "ok" or why the patched sources fail their checks

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "state": self.state,
            "conflict": self.conflict,
            "check": self.check,
            "diff": self.diff() if self.state == APPLICABLE else "",
            "files": [{"path": f.path, "state": f.state, **f.hashes()} for f in self.files],
        }

    def diff(self) -> str:
        return "".join(
            "".join(
                difflib.unified_diff(
                    split_lines(f.before),
                    split_lines(f.after),
                    fromfile=f"a/{f.path}",
                    tofile=f"b/{f.path}",
                )
            )
            for f in self.files
        )


def split_lines(text: str) -> list:
    """Lines with their "\\n"; unlike str.splitlines, only "\\n" ends a line."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


# --- parsing -------------------------------------------------------------------------


def parse_patch(text: str) -> list:
    """The file sections of a unified diff (git format-patch header and stat are skipped)."""
    lines = split_lines(text)
    files = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = _section_path(lines[i], lines[i + 1])
            i, hunks = _parse_hunks(lines, i + 2, path)
            files.append(FilePatch(path, tuple(hunks)))
        else:
            i += 1
    if not files:
        raise PatchFormatError("no '--- '/'+++ ' file section found")
    return files


def _section_path(old_line: str, new_line: str) -> str:
    old, new = (_strip_prefix(line[4:].rstrip("\n").split("\t")[0]) for line in (old_line, new_line))
    if "/dev/null" in (old, new):
        raise PatchFormatError("creating or deleting files is not supported")
    if old != new:
        raise PatchFormatError(f"renames are not supported: {old} -> {new}")
    parts = Path(new).parts
    if Path(new).is_absolute() or ".." in parts:
        raise PatchFormatError(f"path must stay inside site-packages: {new}")
    return new


def _strip_prefix(path: str) -> str:
    return path[2:] if path.startswith(("a/", "b/")) else path


def _parse_hunks(lines: list, i: int, path: str) -> tuple:
    hunks: list[Hunk] = []
    while i < len(lines) and lines[i].startswith("@@"):
        match = _HUNK_HEADER.match(lines[i])
        if not match:
            raise PatchFormatError(f"{path}: bad hunk header {lines[i]!r}")
        header = lines[i].rstrip("\n")
        old_count = int(match.group(2) or 1)
        new_count = int(match.group(4) or 1)
        old: list[str] = []
        new: list[str] = []
        added: list[tuple[str, ...]] = []
        run: list[str] = []
        i += 1
        while len(old) < old_count or len(new) < new_count:
            if i >= len(lines):
                raise PatchFormatError(f"{path}: hunk {header} is truncated")
            tag, body = lines[i][:1], lines[i][1:]
            if tag not in (" ", "-", "+"):
                # Includes "\ No newline at end of file": such targets simply conflict.
                raise PatchFormatError(f"{path}: unsupported line in hunk {header}: {lines[i]!r}")
            if tag in (" ", "-"):
                old.append(body)
            if tag in (" ", "+"):
                new.append(body)
            if tag == "+":
                run.append(body)
            elif run:
                added.append(tuple(run))
                run = []
            i += 1
        if run:
            added.append(tuple(run))
        if len(old) > old_count or len(new) > new_count:
            raise PatchFormatError(f"{path}: hunk {header} line counts do not match its body")
        if not old or not new:
            raise PatchFormatError(f"{path}: hunk {header} has no context lines")
        hunks.append(
            Hunk(
                number=len(hunks) + 1,
                header=header,
                old_start=int(match.group(1)),
                new_start=int(match.group(3)),
                old=tuple(old),
                new=tuple(new),
                added=tuple(added),
            )
        )
    if not hunks:
        raise PatchFormatError(f"{path}: file section without hunks")
    return i, hunks


# --- matching ------------------------------------------------------------------------


def _find(lines: list, block: tuple, expected: int, start: int = 0) -> int | None:
    """Index of the exact occurrence of block at or after start nearest to expected."""
    best = None
    n = len(block)
    for i in range(start, len(lines) - n + 1):
        if lines[i] == block[0] and tuple(lines[i : i + n]) == block:
            if best is None or abs(i - expected) < abs(best - expected):
                best = i
    return best


def _apply_hunks(lines: list, hunks: tuple, reverse: bool = False) -> list | None:
    """lines with every hunk applied (or reverted) in order, or None if one does not match."""
    out, pos, shift = [], 0, 0
    for hunk in hunks:
        src, dst, stated = (hunk.new, hunk.old, hunk.new_start) if reverse else (hunk.old, hunk.new, hunk.old_start)
        at = _find(lines, src, stated - 1 + shift, pos)
        if at is None:
            return None
        out += lines[pos:at]
        out += dst
        pos = at + len(src)
        shift = at - (stated - 1)
    return out + lines[pos:]


def _content_present(lines: list, hunk: Hunk) -> bool:
    """Every block the hunk adds is in lines, in order (blank edge lines ignored)."""
    blocks = [_strip_blank_edges(block) for block in hunk.added]
    blocks = [block for block in blocks if block]
    if not blocks:
        return False
    start = 0
    for block in blocks:
        at = _find(lines, block, start, start)
        if at is None:
            return False
        start = at + len(block)
    return True


def _strip_blank_edges(block: tuple) -> tuple:
    lines = list(block)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return tuple(lines)


def _mismatch(lines: list, hunk: Hunk) -> str:
    """The first line where an unmatched hunk differs from the file at its stated position."""
    start = hunk.old_start - 1
    found = lines[start : start + len(hunk.old)] + ["<end of file>"] * len(hunk.old)
    k = next(k for k, want in enumerate(hunk.old) if found[k] != want)
    return f"line {start + k + 1}: expected {hunk.old[k]!r}, found {found[k]!r}"


def _conflict(path: str, hunk: Hunk | None, reason: str) -> dict:
    return {
        "path": path,
        "hunk": hunk.number if hunk else None,
        "header": hunk.header if hunk else None,
        "reason": reason,
    }


def evaluate_file(path: str, text: str, file_patch: FilePatch) -> FileResult:
    lines = split_lines(text)
    reverted = _apply_hunks(lines, file_patch.hunks, reverse=True)
    if reverted is not None:
        return FileResult(path, APPLIED, before="".join(reverted), after=text)
    patched = _apply_hunks(lines, file_patch.hunks)
    if patched is not None:
        return FileResult(path, APPLICABLE, before=text, after="".join(patched))

    present = [hunk for hunk in file_patch.hunks if _content_present(lines, hunk)]
    missing = [hunk for hunk in file_patch.hunks if hunk not in present]
    if not missing:
        return FileResult(path, UPSTREAM, before=text, after=text)
    unmatched = [hunk for hunk in missing if _find(lines, hunk.old, 0) is None]
    if unmatched:
        reason = f"context does not match ({_mismatch(lines, unmatched[0])})"
    elif present:
        reason = f"partially applied: hunk #{present[0].number} is present, hunk #{missing[0].number} is not"
    else:
        reason = "hunks match only one by one (overlapping or out of order)"
    hunk = (unmatched or missing)[0]
    return FileResult(path, CONFLICT, before=text, conflict=_conflict(path, hunk, reason))


def _patch_state(files: list) -> str:
    states = {f.state for f in files}
    if CONFLICT in states:
        return CONFLICT
    if len(states) == 1:
        return states.pop()
    if APPLICABLE in states:  # some files patched, others not
        return CONFLICT
    return UPSTREAM


def _patch_conflict(sections: list, files: list) -> dict:
    for f in files:
        if f.conflict:
            return f.conflict
    patched = next(f.path for f in files if f.state != APPLICABLE)
    file_diff, f = next((s, f) for s, f in zip(sections, files) if f.state == APPLICABLE)
    return _conflict(f.path, file_diff.hunks[0], f"partially applied: {patched} is already patched, this file is not")


def evaluate_set(site_packages: Path, patches: list, checks: dict | None = None) -> list:
    """PatchResult for each (name, text) in order; a later patch sees earlier ones applied."""
    texts = {}  # path -> content as the set leaves it so far
    results = []
    for name, patch_text in patches:
        sections = parse_patch(patch_text)
        files = []
        for file_diff in sections:
            path = file_diff.path
            if path not in texts:
                target = site_packages / path
                if not target.is_file():
                    files.append(FileResult(path, CONFLICT, conflict=_conflict(path, None, "file not found")))
                    continue
                texts[path] = target.read_bytes().decode()
            files.append(evaluate_file(path, texts[path], file_diff))
        result = PatchResult(name, hashlib.sha256(patch_text.encode()).hexdigest(), _patch_state(files), files)
        if result.state == CONFLICT:
            result.conflict = _patch_conflict(sections, files)
        else:
            result.check = run_checks(result, (checks or {}).get(name))
            texts.update((f.path, f.after) for f in files)
        results.append(result)
    return results


def run_checks(result: PatchResult, check) -> str:
    """Compile each patched file, then run the patch's behavioural check, if it has one."""
    sources = {f.path: f.after for f in result.files}
    try:
        for path, source in sources.items():
            compile(source, path, "exec")
        if check:
            check(sources)
    except Exception as exc:  # a check exercises patched code: any exception is a failure
        return f"{type(exc).__name__}: {exc}"
    return "ok"


# --- applying ------------------------------------------------------------------------


def refusal(patches: list) -> str | None:
    """Why a set (PatchResult.as_dict() of each patch) must not be applied, or None.

    Names every conflict's file and hunk and every failed check.
    """
    problems = []
    for patch in patches:
        conflict = patch["conflict"]
        if conflict:
            where = conflict["path"]
            if conflict["hunk"]:
                where += f" hunk #{conflict['hunk']} ({conflict['header']})"
            problems.append(f"{patch['name']}: conflict in {where}: {conflict['reason']}")
        elif patch["check"] != "ok":
            problems.append(f"{patch['name']}: patched sources fail their checks: {patch['check']}")
    return "; ".join(problems) or None


def make_record(package: str, version: str, results: list) -> dict:
    """The record of a set as it stands once applied (applicable patches count as applied)."""
    return {
        "package": package,
        "version": version,
        "patches": [
            {
                "name": r.name,
                "sha256": r.sha256,
                "state": APPLIED if r.state == APPLICABLE else r.state,
                "files": [{"path": f.path, **f.hashes()} for f in r.files],
            }
            for r in results
        ],
    }


def record_status(record_path: Path, expected: dict) -> str:
    if not record_path.is_file():
        return "missing"
    try:
        current = json.loads(record_path.read_text())
    except ValueError:
        return "stale"
    return "current" if current == expected else "stale"


def apply_set(site_packages: Path, patches: list, checks: dict | None, package: str, version: str,
              record_path: Path, sums: tuple[str, Path] | None = None) -> list:
    """Apply every applicable patch and write the record, all or nothing; then byte-compile.

    `sums` (the set's digest, the distribution's METADATA) also writes the record's sums file
    (`sums_path`) in the same all-or-nothing replace."""
    results = evaluate_set(site_packages, patches, checks)
    problem = refusal([r.as_dict() for r in results])
    if problem:
        raise PatchError(f"{package} {version}: set refused, no file changed: {problem}")
    contents: dict[str, str] = {}  # path -> final text; later patches of the set override earlier ones
    for r in results:
        if r.state == APPLICABLE:
            contents.update((f.path, f.after) for f in r.files)
    writes = {site_packages / path: text.encode() for path, text in contents.items()}
    writes[record_path] = record_bytes(make_record(package, version, results))
    if sums:
        text = sums_text(sums[0], sums[1], record_path, writes[record_path], results)
        if text:
            writes[Path(sums_path(str(record_path)))] = text.encode()
    replace_all(writes)
    import py_compile  # here, not at the top: only applying needs it (the check runs every converge)

    for path in contents:
        py_compile.compile(str(site_packages / path), doraise=True)
    return results


def record_bytes(record: dict) -> bytes:
    return (json.dumps(record, indent=2) + "\n").encode()


# --- the sums of a set in place ------------------------------------------------------------
# Beside the record, `<record>.sha256` lists (in `sha256sum -c` format) the sha256 of every file the
# check of a set in place read: each patched file, the record, the distribution's METADATA (its
# version chose the set). Its first line names the digest of the engine and the set that judged
# them. While `sha256sum -c` confirms every file and the digest is the controller's, the check's
# answer is the record's (facts/patches.py): the files are the ones this engine and set found in
# place. Anything else runs the full check.


def sums_path(record_path: str) -> str:
    return f"{record_path}.sha256"


def sums_text(digest: str, metadata: Path, record_path: Path, record: bytes, results: list) -> str | None:
    """The sums of a set in place (None when a path cannot be written in sha256sum's format).

    Paths are the ones the check reaches, through the sys.path entry holding the distribution
    (`metadata`'s), links not resolved: a later check through a re-pointed link reads other files."""
    entry = metadata.parent.parent
    entries = {str(record_path): record, str(metadata): metadata.read_bytes()}
    for result in results:  # in order: a file two patches touch gets its final text
        for f in result.files:
            entries[str(entry / f.path)] = f.after.encode()
    if any("\n" in path or "\\" in path for path in entries):
        return None
    lines = [f"{SUMS_HEADER} {digest}"]
    lines += [f"{hashlib.sha256(data).hexdigest()}  {path}" for path, data in entries.items()]
    return "\n".join(lines) + "\n"


def in_place(results: list, record: str) -> bool:
    """Whether the set is in place: nothing to apply, no conflict, every check ok, record current."""
    return record == "current" and all(r.state in (APPLIED, UPSTREAM) and r.check == "ok" for r in results)


def replace_all(writes: dict) -> None:
    """The engine's one atomic write: every file gets its bytes, or all of them stay as they were.
    Each is written to a new file beside it first (with its mode and owner), then renamed over it
    (servestack/hostcode.py: readers see the old file or the new one); a failure puts back the files
    already replaced."""
    originals = {path: path.read_bytes() if path.exists() else None for path in writes}
    temps = {}
    try:
        for path, data in writes.items():
            temps[path] = new_file_beside(str(path), data)
        done = []
        try:
            for path, temp in temps.items():
                move_into_place(temp, str(path))
                done.append(path)
        except BaseException:
            for path in done:
                _restore(path, originals[path])
            raise
    finally:
        for temp in temps.values():
            remove_if_there(temp)


def _restore(path: Path, original: bytes | None) -> None:
    if original is None:
        path.unlink()
    else:
        replace_all({path: original})


# --- remote entry point --------------------------------------------------------------


def load_checks(source: str | None, name: str) -> dict:
    """The CHECKS mapping (patch name -> check(sources)) of a set's checks.py source."""
    if not source:
        return {}
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module.CHECKS


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(metadata: Path) -> str | None:
    """The `Version:` header of a .dist-info's METADATA (headers end at the first blank line)."""
    try:
        with open(metadata, encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break
                if line.startswith("Version:"):
                    return line[len("Version:"):].strip()
    except OSError:
        return None
    return None


def find_distribution(package: str) -> tuple[str, Path, Path | None] | None:
    """(version, the directory holding it, its METADATA file) of the installed distribution, the
    first on sys.path, as importlib.metadata finds it; read from its .dist-info directly because
    importing importlib.metadata (email, zipfile...) would cost more than the rest of the check.
    Distributions without a .dist-info (old .egg-info) are left to importlib.metadata, and have no
    METADATA path here (the sums need one)."""
    found = _dist_info(package)
    if found:
        version, entry, metadata = found
        return version, entry.resolve(), metadata
    import importlib.metadata
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, Path(str(dist.locate_file(""))).resolve(), None


def _dist_info(package: str) -> tuple[str, Path, Path] | None:
    """(version, sys.path entry, METADATA path) of the package's first .dist-info on sys.path."""
    wanted = _normalized(package)
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and _normalized(name[:-len(".dist-info")].partition("-")[0]) == wanted:
                metadata = Path(entry or ".") / name / "METADATA"
                version = _metadata_version(metadata)
                if version:
                    return version, Path(entry or "."), metadata
    return None


def remote_main(payload: dict) -> int:
    """Run on the host by the environment's python; prints one JSON object as the section RESULT.

    payload: {"mode": "check"|"apply", "package", "record_path" (or None: sys.prefix),
              "sets": {version: {"patches": [[name, text], ...], "checks": source|None}},
              "digests": {version: sha256 of the engine and that set (facts/patches.py)}}

    A check that finds the set in place at a given record path also prints the sums that let
    the next check confirm it with `sha256sum -c` (`sums`: facts/patches.py keeps them).
    """
    package = payload["package"]
    out = {"python": sys.executable, "package": package, "installed": False}
    found = find_distribution(package)
    if found is None:
        section(RESULT, json.dumps(out))
        return 0
    version, site_packages, metadata = found
    patch_set = payload["sets"].get(version)
    out.update(
        installed=True,
        version=version,
        site_packages=str(site_packages),
        patch_set=version if patch_set else None,
        patches=[],
        record_path=None,
        record=None,
    )
    if patch_set:
        record_path = Path(payload["record_path"] or Path(sys.prefix) / RECORD_NAME)
        patches = [tuple(p) for p in patch_set["patches"]]
        checks = load_checks(patch_set["checks"], f"servestack_patch_checks_{package}")
        digest = payload.get("digests", {}).get(version)
        sums = (digest, metadata) if digest and metadata and payload["record_path"] else None
        try:
            if payload["mode"] == "apply":
                results = apply_set(site_packages, patches, checks, package, version, record_path, sums)
            else:
                results = evaluate_set(site_packages, patches, checks)
        except PatchError as exc:
            print(f"servestack patches: {exc}", file=sys.stderr)
            return 1
        expected = make_record(package, version, results)
        out.update(
            patches=[r.as_dict() for r in results],
            record_path=str(record_path),
            record=record_status(record_path, expected),
            record_sha256=hashlib.sha256(record_bytes(expected)).hexdigest(),
        )
        if payload["mode"] == "check" and sums and in_place(results, out["record"]):
            out["sums"] = sums_text(*sums, record_path, record_path.read_bytes(), results)
    section(RESULT, json.dumps(out))
    return 0


def main(argv: list) -> int:
    """The host's entry point: `python -I -c THIS_FILE SETS REQUEST` (files/scripts/patch-check.sh).

    SETS: base64 of zlib-compressed JSON {"sets", "digests"} (the same for every host of a run);
    REQUEST: base64 of JSON {"mode", "package", "record_path"}. See `remote_main`.
    """
    if len(argv) != 3:
        print("servestack patches: usage: patchlib.py SETS REQUEST (base64 JSON)", file=sys.stderr)
        return 2
    payload = json.loads(zlib.decompress(base64.b64decode(argv[1])))
    payload.update(json.loads(base64.b64decode(argv[2])))
    return remote_main(payload)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
