"""Step `toolkit`: the manifest's CUDA toolkit from NVIDIA's runfile, beside the toolkits it keeps.

Decided from one fact (facts.toolkit.CudaToolkits: stats and small files only):

- The install path already holds the wanted toolkit (its `bin/nvcc --version` and `version.json`
  say so) -> nothing else is read: not the runfile, not the kept toolkits.
- Otherwise, in one operation and in this order: record the kept toolkits' fingerprints and the
  `/usr/local/cuda` chain in `toolkits.json` (once); get the runfile (cached and verified /
  resumed download / upload from the control machine / pre-staged); verify it (size, md5,
  sha256; fail closed) and run it toolkit-only; decide success from the exit code AND the new
  `nvcc`; put `/usr/local/cuda` back where it pointed; then check that nvcc reports the manifest's
  version, the kept toolkits' fingerprints are unchanged and the link chain is as recorded.
- A failed install moves the tree aside to `<install_path>.failed-<UTC>` and shows the tail of the
  installer log; the next run installs again. An install interrupted before its checks (the
  control machine died) is finished, or moved aside, by the next run, which finds
  `toolkit-install.json`.

A tree at the install path that servestack cannot confirm as the manifest's toolkit (another
version, no `version.json`, files owned by dpkg — e.g. NVIDIA's Ubuntu packages, whose nvcc
reports the same V13.0.88 for 13.0.2) is never installed over: the host is refused, unless host
data sets `cuda_existing_toolkit = "accept"` and its nvcc reports the manifest's nvcc version.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version
from pyinfra import host, logger
from pyinfra.api import FunctionCommand, deploy, operation

from facts.host import busy_path
from facts.preflight import HostPreflight
from facts.probe import FactRequest
from facts.toolkit import (
    CudaToolkits,
    Digest,
    Fingerprint,
    LinkChain,
    RunfileDigest,
    ToolkitFingerprint,
    ToolkitState,
    Tree,
    marker_path,
    record_path,
)
from servestack import probe
from servestack.hostrun import (
    host_refused,
    is_executing,
    noop,
    plan,
    refusal,
    refuse_now,
    run_id,
    run_remote,
    utc_stamp,
)
from servestack.manifest import Runfile
from servestack.settings import Settings, host_settings

RECORD_SCHEMA = 1
LOG_TAIL_LINES = 25


def human_bytes(size: int) -> str:
    """4302469087 -> '4.3 GB' (decimal units, as download pages print them)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _q(value: str) -> str:
    return shlex.quote(value)


# Where things are

def kept_paths(settings: Settings) -> tuple[str, ...]:
    """The kept toolkits' roots: `cuda-<version>` beside the link (/usr/local/cuda-12.8)."""
    parent = posixpath.dirname(settings.manifest.cuda["link_path"])
    return tuple(posixpath.join(parent, f"cuda-{version}") for version in settings.manifest.cuda["keep"])


@dataclass(frozen=True)
class RunfileSource:
    """Where the runfile for one architecture comes from and where its verified copy lives."""

    runfile: Runfile
    mode: str               # "prestaged", "host" (the host downloads) or "controller" (uploaded)
    cached: str             # the verified file: <cuda_cache_dir>/<file>, or the pre-staged path
    part: str | None        # download/upload target (<cached>.part); None when pre-staged


def runfile_source(settings: Settings, arch: str | None) -> RunfileSource | None:
    """The runfile source for `arch`, or None when the manifest has no runfile for it."""
    if arch not in settings.manifest.runfiles:
        return None
    runfile = settings.runfile(arch)
    if settings.cuda_runfile_path:
        return RunfileSource(runfile, "prestaged", settings.cuda_runfile_path, None)
    cached = posixpath.join(settings.cuda_cache_dir, runfile.file)
    return RunfileSource(runfile, settings.cuda_runfile_from, cached, cached + ".part")


def runfile_candidates(settings: Settings) -> tuple[str, ...]:
    """Every runfile path worth a stat, for every architecture of the manifest."""
    paths = []
    for arch in settings.manifest.runfiles:
        source = runfile_source(settings, arch)
        paths += [source.cached] + ([source.part] if source.part else [])
    return tuple(dict.fromkeys(paths))


def toolkit_fact_arguments(settings: Settings) -> dict:
    return {
        "install_path": settings.cuda_install_path,
        "keep_paths": kept_paths(settings),
        "link_path": settings.manifest.cuda["link_path"],
        "state_dir": settings.servestack_state_dir,
        "files": runfile_candidates(settings),
    }


@probe.expects
def _expected_facts(host_) -> list[FactRequest]:
    return [FactRequest.of(CudaToolkits, **toolkit_fact_arguments(host_settings(host_)))]


# Is the wanted toolkit there?

@dataclass(frozen=True)
class Verdict:
    """What the install path holds, and so what to do with it."""

    kind: str     # installed | accepted | absent | empty | interrupted | foreign
    detail: str

    @property
    def install_needed(self) -> bool:
        return self.kind in ("absent", "empty", "interrupted")

    @property
    def refused(self) -> bool:
        return self.kind == "foreign"


def _is_date_stamp(version: str) -> bool:
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return len(release) >= 3 and release[2] >= 10000


def version_json_problem(settings: Settings, version_json: dict) -> str | None:
    """Why a version.json is not the manifest's toolkit, or None.

    `cuda_nvcc.version` must be the manifest's nvcc version; `cuda.version` must be the
    manifest's version, except that a date stamp (12.6.20241114, seen in runfile installs) only
    has to share its major.minor.
    """
    cuda = settings.manifest.cuda
    nvcc = (version_json.get("cuda_nvcc") or {}).get("version")
    if nvcc != cuda["nvcc_version"]:
        return f"version.json says cuda_nvcc {nvcc}, expected {cuda['nvcc_version']}"
    sdk = (version_json.get("cuda") or {}).get("version")
    if sdk is None:
        return "version.json has no cuda.version"
    wanted = settings.cuda_version
    if _is_date_stamp(sdk):
        release = Version(wanted).release
        if not sdk.startswith(f"{release[0]}.{release[1]}."):
            return f"version.json says CUDA {sdk}, expected {wanted}"
    elif sdk != wanted:
        return f"version.json says CUDA {sdk}, expected {wanted}"
    return None


def _ours_interrupted(tree: Tree, marker: dict | None) -> bool:
    return bool(marker) and marker.get("path") == tree.path


def assess_install(settings: Settings, tree: Tree, marker: dict | None = None) -> Verdict:
    """Decide from nvcc and version.json (never from a marker or /usr/local/cuda) what the install path holds."""
    want, want_nvcc = settings.cuda_version, settings.manifest.cuda["nvcc_version"]
    path = tree.path
    if tree.symlink_to is not None and not tree.exists:
        return Verdict("foreign", f"{path} is a dangling symlink (-> {tree.symlink_to}): remove it or "
                                  "choose another cuda_install_path")
    if not tree.exists:
        return Verdict("absent", f"{path} does not exist")
    if tree.empty:
        return Verdict("empty", f"{path} is an empty directory")
    nvcc_ok = tree.nvcc is not None and tree.nvcc.version == want_nvcc
    if nvcc_ok and tree.version_json is not None and not tree.dpkg_owner:
        problem = version_json_problem(settings, tree.version_json)
        if problem is None:
            return Verdict("installed", f"CUDA {want} is installed at {path} (nvcc V{want_nvcc}, version.json)")
    else:
        problem = None
    if _ours_interrupted(tree, marker):
        return Verdict("interrupted", f"an earlier servestack install into {path} did not finish "
                                      f"(run {marker.get('run_id', '?')})")
    accept = settings.cuda_existing_toolkit == "accept"
    if nvcc_ok and (tree.dpkg_owner or tree.version_json is None):
        what = (f"files owned by the package {tree.dpkg_owner}" if tree.dpkg_owner else "no version.json")
        if accept:
            return Verdict("accepted", f"accepting the toolkit at {path} (nvcc V{want_nvcc}, {what}) as CUDA "
                                       f"{want}: cuda_existing_toolkit = 'accept'")
        return Verdict("foreign", f"{path} holds a toolkit whose nvcc reports V{want_nvcc} but with {what}: "
                                  f"servestack cannot confirm it is CUDA {want} (13.0.1 and 13.0.2 share that nvcc) "
                                  "and will not install over it; set cuda_existing_toolkit = 'accept' to use it "
                                  "as is, or choose another cuda_install_path")
    if problem:
        return Verdict("foreign", f"{path} holds another toolkit ({problem}): servestack will not install over "
                                  "it; move it aside or choose another cuda_install_path")
    if tree.nvcc is not None:
        return Verdict("foreign", f"{path} holds CUDA {tree.nvcc.release} (nvcc V{tree.nvcc.version}), not {want}: "
                                  "servestack will not install over it; move it aside or choose another "
                                  "cuda_install_path")
    return Verdict("foreign", f"{path} exists but holds no working toolkit ({tree.nvcc_error or 'no bin/nvcc'}) "
                              "and no interrupted servestack install is recorded: move it aside")


# The runfile

def digest_problem(runfile: Runfile, digest: Digest | None) -> str | None:
    """Why a digest is not the runfile's, or None when size, md5 and sha256 all match."""
    from servestack import download  # requests and rich.progress: imported only when a runfile is checked

    if digest is None or not digest.present:
        return "the file is missing"
    return download.mismatch(runfile, download.Sums(digest.stat.size, digest.md5, digest.sha256))


@dataclass(frozen=True)
class RunfilePlan:
    """How this host gets a verified runfile for the install."""

    use: str | None = None                          # the file the install verifies and runs
    rejects: tuple[tuple[str, str], ...] = ()       # (path, why) moved aside first
    fetch: str | None = None                        # "download", "upload" or None
    resume_from: int = 0
    lines: tuple[str, ...] = ()
    problem: str | None = None                      # refuse: the runfile cannot be had


def file_to_hash(source: RunfileSource, stats: dict) -> str | None:
    """The file whose digest the plan needs: a full-size cached copy, or the pre-staged file."""
    stat = stats.get(source.cached)
    if stat is None:
        return None
    if source.mode == "prestaged" or stat.size == source.runfile.size:
        return source.cached
    return None


def plan_runfile(source: RunfileSource, stats: dict, digest: Digest | None) -> RunfilePlan:
    """Decide from stats (and the digest of `file_to_hash`) how to get a verified runfile."""
    runfile = source.runfile
    cached = stats.get(source.cached)
    if source.mode == "prestaged":
        if cached is None:
            return RunfilePlan(problem=f"cuda_runfile_path {source.cached}: no such file on the host")
        problem = digest_problem(runfile, digest)
        if problem:
            return RunfilePlan(problem=f"pre-staged runfile {source.cached} fails verification ({problem}): "
                                       "not used")
        return RunfilePlan(use=source.cached, lines=(f"pre-staged runfile {source.cached}: verified",))
    rejects, lines = [], []
    if cached is not None:
        problem = (f"size {cached.size} bytes, expected {runfile.size}" if cached.size != runfile.size
                   else digest_problem(runfile, digest))
        if problem is None:
            return RunfilePlan(use=source.cached, lines=(f"runfile {source.cached}: cached and verified",))
        rejects.append((source.cached, problem))
        lines.append(f"cached runfile {source.cached} fails verification ({problem}): "
                     "move it aside to *.rejected-<UTC>, never use it")
    part = stats.get(source.part)
    have = part.size if part else 0
    if have > runfile.size:
        rejects.append((source.part, f"{have} bytes, larger than the runfile"))
        lines.append(f"partial file {source.part} is larger than the runfile: move it aside")
        have = 0
    if source.mode == "controller":
        resume = f", resuming at {human_bytes(have)}" if have else ""
        lines.append(f"upload {human_bytes(runfile.size - have)} from the control machine{resume} "
                     f"(downloaded once there from {runfile.url}, verified)")
        return RunfilePlan(use=source.part, rejects=tuple(rejects), fetch="upload", resume_from=have,
                           lines=tuple(lines))
    if have == runfile.size:
        lines.append(f"download of {runfile.file} complete in {source.part}: verify before use")
        return RunfilePlan(use=source.part, rejects=tuple(rejects), lines=tuple(lines))
    if have:
        lines.append(f"resume download from {runfile.url} at {human_bytes(have)} of {human_bytes(runfile.size)}")
    else:
        lines.append(f"download {human_bytes(runfile.size)} from {runfile.url}")
    return RunfilePlan(use=source.part, rejects=tuple(rejects), fetch="download", resume_from=have,
                       lines=tuple(lines))


# Commands

def reject_command(path: str, reason: str) -> str:
    """Move a runfile that failed verification aside (only the newest rejected copy is kept)."""
    return (f"ts=$(date -u +%Y%m%dT%H%M%SZ); rm -f -- {_q(path)}.rejected-*; "
            f"mv -f {_q(path)} {_q(path)}.rejected-$ts && "
            f"echo \"servestack: {path} failed verification ({reason}): moved aside to {path}.rejected-$ts, "
            "never used\" >&2")


def download_command(source: RunfileSource, attempts: int = 5, busy: str | None = None) -> str:
    """curl into `<file>.part`, resuming (-C -) what is there; retries resume too.

    With `busy` (the lock's busy file) it holds that flock while it runs, so a run that dies
    meanwhile leaves a lock that is not taken for stale until the download is over.
    """
    runfile = source.runfile
    part = _q(source.part)
    hold = (f"exec 8>>{_q(busy)}\nif command -v flock >/dev/null 2>&1 && ! flock -n 8; then "
            "echo 'servestack: another download or install is still running on this host' >&2; exit 1; fi\n"
            if busy else "")
    return f"""set -u
mkdir -p {_q(posixpath.dirname(source.part))} || exit 1
{hold}n=0; rc=0
while :; do
    have=$(stat -c %s {part} 2>/dev/null || echo 0)
    [ "$have" -ge {runfile.size} ] && break
    if [ $n -ge {attempts} ]; then
        echo "servestack: download of {runfile.url} failed (curl exit $rc) after $n attempts; $have bytes kept in {source.part}, resumed by the next run" >&2
        exit 1
    fi
    n=$((n+1))
    curl -fsSL --connect-timeout 30 -C - -o {part} {_q(runfile.url)}; rc=$?
    [ $rc -eq 33 ] && rm -f {part}
    [ $rc -eq 0 ] || sleep 2
done
"""


def verify_script(runfile: Runfile, path: str, ours: bool) -> str:
    """Shell lines verifying `path` (size, md5, sha256 read concurrently); exit 1 if it fails."""
    p = _q(path)
    on_bad = (f"rm -f -- {p}.rejected-*; mv -f {p} {p}.rejected-$ts; "
              f"say \"runfile {path} fails verification ($bad): moved aside to {path}.rejected-$ts, never used\"; "
              if ours else f"say \"pre-staged runfile {path} fails verification ($bad): not used\"; ")
    return f"""[ -f {p} ] || {{ say "runfile {path} is missing"; exit 1; }}
size=$(stat -c %s {p})
sums=$( {{ md5sum {p} & sha256sum {p}; wait; }} )
md5=$(printf '%s\\n' "$sums" | awk '{{sub(/^\\\\/, "", $1)}} length($1) == 32 {{print $1}}')
sha=$(printf '%s\\n' "$sums" | awk '{{sub(/^\\\\/, "", $1)}} length($1) == 64 {{print $1}}')
bad=""
[ "$size" = {runfile.size} ] || bad="size $size bytes, expected {runfile.size}"
[ -n "$bad" ] || [ "$md5" = {runfile.md5} ] || bad="md5 $md5, expected {runfile.md5}"
[ -n "$bad" ] || [ "$sha" = {runfile.sha256} ] || bad="sha256 $sha, expected {runfile.sha256}"
if [ -n "$bad" ]; then {on_bad}exit 1; fi
"""


def restore_link_script(chain: LinkChain) -> str:
    """Shell lines putting each recorded hop of the `/usr/local/cuda` chain back (only hops that changed)."""
    link = _q(chain.path)
    if chain.kind == "absent":
        return (f"if [ -L {link} ]; then echo \"servestack: the installer created {chain.path} -> "
                f"$(readlink {link}); removed (it did not exist before)\" >&2; rm -f {link}; fi\n")
    lines = []
    for hop_link, target in chain.hops:
        hl, tq = _q(hop_link), _q(target)
        lines.append(
            f"now=$(readlink {hl} 2>/dev/null || true)\n"
            f"if [ \"$now\" != {tq} ]; then\n"
            f"    if [ -L {hl} ] || [ ! -e {hl} ]; then\n"
            f"        ln -sfn {tq} {hl}.servestack-new && mv -T {hl}.servestack-new {hl} && "
            f"echo \"servestack: {hop_link} was re-pointed to '$now' (by the installer?): restored -> {target}\" >&2\n"
            f"    else echo \"servestack: {hop_link} is no longer a symlink: cannot restore -> {target}\" >&2; fi\n"
            "fi\n")
    return "".join(lines)


def install_script(settings: Settings, source: RunfileSource, use: str, keep_chain: LinkChain | None,
                   run: str) -> str:
    """Verify the runfile, run it toolkit-only, decide success from exit code and nvcc; clean up a failure."""
    cuda = settings.manifest.cuda
    install, tmpdir, log = settings.cuda_install_path, settings.cuda_tmpdir, cuda["log_path"]
    final = source.cached
    flags = " ".join(_q(flag) for flag in cuda["installer_flags"])
    release = ".".join(str(part) for part in Version(settings.cuda_version).release[:2])
    marker = json.dumps({"path": install, "version": settings.cuda_version, "run_id": run, "started": utc_stamp()})
    out = f"{tmpdir}/servestack-cuda-installer.out"
    i, t, o = _q(install), _q(tmpdir), _q(out)
    rename = f"mv -f {_q(use)} {_q(final)}\n" if use != final else ""
    restore = restore_link_script(keep_chain) if keep_chain is not None else ""
    return f"""set -u
say() {{ echo "servestack: $*" >&2; }}
ts=$(date -u +%Y%m%dT%H%M%SZ)
{verify_script(source.runfile, use, ours=source.mode != "prestaged")}{rename}mkdir -p {t} {_q(settings.servestack_state_dir)} || exit 1
exec 8>>{_q(busy_path(settings.servestack_state_dir))}
if command -v flock >/dev/null 2>&1 && ! flock -n 8; then say "another CUDA install is still running on this host"; exit 1; fi
printf '%s\\n' {_q(marker)} > {_q(marker_path(settings.servestack_state_dir))}
TMPDIR={t} sh {_q(final)} {flags} --installpath={i} --tmpdir={t} > {o} 2>&1
rc=$?
why=""
if [ $rc -ne 0 ]; then
    why="installer exit $rc"
elif ! v=$({i}/bin/nvcc --version 2>&1); then
    why="installer exit 0, but {install}/bin/nvcc does not run: $(printf '%s' "$v" | tail -n 1)"
else
    case "$v" in
    *"release {release}, V{cuda['nvcc_version']}"*) ;;
    *) why="installer exit 0, but {install}/bin/nvcc reports: $(printf '%s\\n' "$v" | grep -i release | head -n 1)" ;;
    esac
fi
if [ -n "$why" ]; then
{restore}    moved="nothing was left at {install}"
    if [ -e {i} ] || [ -L {i} ]; then mv {i} {i}.failed-$ts && moved="the partial tree was moved aside to {install}.failed-$ts"; fi
    rm -f {_q(marker_path(settings.servestack_state_dir))}
    say "CUDA {settings.cuda_version} install failed ($why); $moved"
    if [ -s {o} ]; then say "installer output (last lines):"; tail -n 10 {o} >&2; fi
    if [ -f {_q(log)} ]; then say "last lines of {log}:"; tail -n {LOG_TAIL_LINES} {_q(log)} >&2; else say "no {log}"; fi
    rm -f {o}
    exit 1
fi
rm -f {o}
echo "installed CUDA {settings.cuda_version} into {install}"
"""


def move_aside_command(path: str, state_dir: str) -> str:
    """Move an interrupted install's tree aside and forget its marker."""
    return (f"ts=$(date -u +%Y%m%dT%H%M%SZ); mv {_q(path)} {_q(path)}.failed-$ts && "
            f"rm -f {_q(marker_path(state_dir))} && "
            f"echo \"servestack: moved the interrupted install aside to {path}.failed-$ts\" >&2")


def write_json_command(path: str, data: dict) -> str:
    text = json.dumps(data, indent=1, sort_keys=True)
    return (f"mkdir -p {_q(posixpath.dirname(path))} && printf '%s\\n' {_q(text)} > {_q(path)}.new "
            f"&& mv -f {_q(path)}.new {_q(path)}")


def point_link_command(link: str, target: str) -> str:
    return f"ln -sfn {_q(target)} {_q(link)}.servestack-new && mv -T {_q(link)}.servestack-new {_q(link)}"


# toolkits.json

def record_target(settings: Settings) -> dict:
    return {"version": settings.cuda_version, "path": settings.cuda_install_path,
            "nvcc_version": settings.manifest.cuda["nvcc_version"]}


def paths_to_record(settings: Settings, state: ToolkitState) -> tuple[str, ...]:
    """Kept toolkits not yet fingerprinted for this target (all of them when there is no record)."""
    record = state.record
    if record is None or state.record_invalid or record.get("target") != record_target(settings):
        return kept_paths(settings)
    return tuple(path for path in kept_paths(settings) if path not in record.get("toolkits", {}))


def new_record(settings: Settings, state: ToolkitState, fingerprints: dict, run: str) -> dict:
    """toolkits.json with `fingerprints` added (a fresh record when there is none for this target)."""
    record = state.record
    if record is None or state.record_invalid or record.get("target") != record_target(settings):
        record = {"schema": RECORD_SCHEMA, "target": record_target(settings), "recorded": utc_stamp(),
                  "run_id": run, "toolkits": {}, "link": state.link.to_record()}
    record = json.loads(json.dumps(record))
    for path, fingerprint in fingerprints.items():
        record["toolkits"][path] = fingerprint.to_record()
    return record


def link_line(settings: Settings, chain: LinkChain) -> tuple[str, bool]:
    """The plan line for `/usr/local/cuda` and whether the link must change (cuda_link_policy = 'new')."""
    install = settings.cuda_install_path
    if settings.cuda_link_policy == "new":
        if chain.hops == ((chain.path, install),):
            return f"{chain.path} -> {install} already (cuda_link_policy = 'new')", False
        return (f"{chain.path} -> {install} (was {chain.describe()}): an explicit change, "
                "cuda_link_policy = 'new'"), True
    if not chain.hops:
        return f"{chain.path} stays {chain.kind}", False
    return f"{chain.path} stays -> {' -> '.join(target for _, target in chain.hops)}", False


def after_install_problems(settings: Settings, state: ToolkitState, fingerprints: dict,
                           expected_chain: LinkChain | None) -> list[str]:
    """Every difference between what the install must leave and what the host shows now."""
    problems = []
    verdict = assess_install(settings, state.install)
    if verdict.kind != "installed":
        problems.append(f"after the install, {verdict.detail}")
    recorded = (state.record or {}).get("toolkits", {})
    for path, now in fingerprints.items():
        if path in recorded:
            for change in Fingerprint.from_record(path, recorded[path]).differences(now):
                problems.append(f"kept toolkit {path} changed during the install: {change}")
    if expected_chain is not None and (state.link.hops, state.link.kind) != (expected_chain.hops, expected_chain.kind):
        problems.append(f"{state.link.path} is {state.link.describe()}, expected {expected_chain.describe()}")
    return problems


def _check_after_install(state, host, settings: Settings, expected_chain: LinkChain | None) -> bool:
    """Post-install check (runs on the control machine between the operation's commands)."""
    toolkits = host.get_fact(CudaToolkits, **toolkit_fact_arguments(settings))
    if expected_chain is not None and (toolkits.link.hops, toolkits.link.kind) != (expected_chain.hops,
                                                                                 expected_chain.kind):
        changed = toolkits.link.describe()
        run_remote(host, restore_link_script(expected_chain))
        toolkits = host.get_fact(CudaToolkits, **toolkit_fact_arguments(settings))
        host.log(f"the installer changed the link to {changed}: restored {toolkits.link.describe()}")
    fingerprints = {path: host.get_fact(ToolkitFingerprint, path=path) for path in kept_paths(settings)}
    problems = after_install_problems(settings, toolkits, fingerprints, expected_chain)
    if problems:
        for problem in problems:
            host.log_styled(f"toolkit check failed: {problem}", fg="red", log_func=logger.error)
        host.log(f"every run re-checks until this is resolved: repair the host, or accept what it shows by "
                 f"removing {marker_path(settings.servestack_state_dir)}")
        return False
    record = json.loads(json.dumps(toolkits.record or {}))
    record["installed"] = {**record_target(settings), "at": utc_stamp(), "run_id": run_id(state),
                           "link_policy": settings.cuda_link_policy, "link": toolkits.link.to_record()}
    ok, _, stderr = run_remote(host, write_json_command(record_path(settings.servestack_state_dir), record)
                               + f" && rm -f {_q(marker_path(settings.servestack_state_dir))}")
    if not ok:
        host.log_styled(f"could not update toolkits.json: {' '.join(stderr)}", fg="red", log_func=logger.error)
        return False
    host.log(f"checked: nvcc reports {settings.manifest.cuda['nvcc_version']}, kept toolkits unchanged, "
             f"{toolkits.link.describe()}")
    return True


def _upload_from_controller(state, host, runfile: Runfile, part: str) -> bool:
    """Download the runfile once on the control machine (verified), then send it to this host."""
    from servestack import download

    try:
        local = download.fetch_runfile(runfile)
        host.log(f"uploading {human_bytes(runfile.size)} from {local}")
        download.upload_to_host(host, local, part, run_remote)
    except download.DownloadError as error:
        host.log_styled(str(error), fg="red", log_func=logger.error)
        return False
    return True


# The operation

_DIGESTS: dict = {}


def _digest(path: str, stat) -> Digest:
    """The file's digest, hashed once per run while its size, mtime and inode stay the same."""
    key = (id(host.state), host.name, path, stat.size, stat.mtime, stat.inode)
    if key not in _DIGESTS:
        _DIGESTS[key] = host.get_fact(RunfileDigest, path=path)
    return _DIGESTS[key]


def _refuse(problems: list[str]):
    if is_executing(host):
        yield refusal(problems)
    else:
        refuse_now(host, problems)


@dataclass
class _Steps:
    lines: list = field(default_factory=list)
    commands: list = field(default_factory=list)


def _record_steps(settings: Settings, state: ToolkitState, steps: _Steps) -> None:
    paths = paths_to_record(settings, state)
    if not paths:
        return
    fingerprints = {path: host.get_fact(ToolkitFingerprint, path=path) for path in paths}
    described = ", ".join(f"{path} ({fp.files} files)" if fp.present else f"{path} (absent)"
                          for path, fp in fingerprints.items())
    target = record_path(settings.servestack_state_dir)
    steps.lines.append(f"record fingerprints of {described} and {state.link.describe()} in {target}")
    steps.commands.append(write_json_command(target, new_record(settings, state, fingerprints, run_id(host.state))))


def _link_steps(settings: Settings, chain: LinkChain, steps: _Steps) -> None:
    line, change = link_line(settings, chain)
    if change:
        steps.lines.append(line)
        steps.commands.append(point_link_command(chain.path, settings.cuda_install_path))
    else:
        noop(host, line)


def _finish_steps(settings: Settings, state: ToolkitState, steps: _Steps) -> None:
    """A run died between its installer and its checks: put the link back (as recorded), check."""
    if not (state.marker and state.marker.get("path") == settings.cuda_install_path):
        return
    recorded = state.link
    if state.record and "link" in state.record:
        recorded = LinkChain.from_record(state.record["link"])
    keep = recorded if settings.cuda_link_policy == "keep" else None
    steps.lines.append("finish the interrupted install's checks (link, kept toolkits)")
    steps.commands.append(FunctionCommand(_check_after_install, (settings, keep), {}))


def _install_steps(settings: Settings, state: ToolkitState, source: RunfileSource, verdict: Verdict,
                   steps: _Steps) -> str | None:
    """Get a verified runfile, install, check. Returns a problem instead when the runfile cannot be had."""
    runfile_plan = plan_runfile(source, state.files, _needed_digest(source, state.files))
    if runfile_plan.problem:
        return runfile_plan.problem
    steps.lines += runfile_plan.lines
    steps.commands += [reject_command(path, why) for path, why in runfile_plan.rejects]
    if runfile_plan.fetch == "download":
        steps.commands.append(download_command(source, busy=busy_path(settings.servestack_state_dir)))
    elif runfile_plan.fetch == "upload":
        steps.commands.append(FunctionCommand(_upload_from_controller, (source.runfile, source.part), {}))
    if verdict.kind == "interrupted":
        steps.lines.append(f"{verdict.detail}: move it aside to {settings.cuda_install_path}.failed-<UTC>")
        steps.commands.append(move_aside_command(settings.cuda_install_path, settings.servestack_state_dir))
    keep = state.link if settings.cuda_link_policy == "keep" else None
    steps.lines.append(f"install {settings.cuda_version} into {settings.cuda_install_path}")
    steps.commands.append(install_script(settings, source, runfile_plan.use, keep, run_id(host.state)))
    steps.commands.append(FunctionCommand(_check_after_install, (settings, keep), {}))
    return None


@operation()
def runfile_toolkit():
    """
    Install the manifest's CUDA toolkit with its runfile, side by side with the kept toolkits.

    Reads the host data of servestack.settings (cuda_install_path, cuda_cache_dir, cuda_tmpdir,
    cuda_runfile_url / cuda_mirror / cuda_runfile_path / cuda_runfile_from, cuda_link_policy,
    cuda_existing_toolkit); takes no arguments. See the module docstring for what it does.
    """
    settings = host_settings(host)
    if host_refused(host):
        noop(host, "host refused by preflight")
        return
    state = probe.fact(host, CudaToolkits, **toolkit_fact_arguments(settings))
    source = runfile_source(settings, state.arch)
    verdict = assess_install(settings, state.install, state.marker)
    if source is None or verdict.refused:
        yield from _refuse([verdict.detail] if verdict.refused else
                           [f"no CUDA runfile for architecture {state.arch} in {settings.manifest.path.name}"])
        return
    steps = _Steps()
    _record_steps(settings, state, steps)
    if verdict.install_needed:
        problem = _install_steps(settings, state, source, verdict, steps)
        if problem:
            yield from _refuse([problem])
            return
    else:
        noop(host, f"{verdict.detail}: the runfile is not needed")
        _finish_steps(settings, state, steps)
    _link_steps(settings, state.link, steps)
    for line in steps.lines:
        plan(host, line)
    yield from steps.commands
    if steps.commands:
        probe.changed(host, CudaToolkits, HostPreflight)


def _needed_digest(source: RunfileSource, stats: dict) -> Digest | None:
    path = file_to_hash(source, stats)
    return _digest(path, stats[path]) if path else None


@deploy("CUDA toolkit")
def cuda_toolkit():
    """The manifest's CUDA toolkit beside the kept ones; `/usr/local/cuda` per cuda_link_policy."""
    settings = host_settings(host)
    runfile_toolkit(name=f"CUDA {settings.cuda_version} at {settings.cuda_install_path}")
