"""Step `toolkit`: the manifest's CUDA toolkit from NVIDIA's runfile, beside the toolkits it keeps.

Decided from one fact (facts.toolkit.CudaToolkits: stats and small files only; `host_reads` lists
it for deploy.py's batched read):

- The install path already holds the wanted toolkit (its `bin/nvcc --version` and `version.json`
  say so) -> nothing else is read: not the runfile, not the kept toolkits.
- Otherwise, in one operation and in this order: record the kept toolkits' fingerprints and the
  `/usr/local/cuda` chain in `toolkits.json` (once); get the runfile (cached and verified /
  resumed download / upload from the control machine / pre-staged); verify it (size, md5,
  sha256; fail closed) and run it toolkit-only; decide success from the exit code AND the new
  `nvcc`; put `/usr/local/cuda` back where it pointed; then check that nvcc reports the manifest's
  version, the kept toolkits' fingerprints are unchanged and the link chain is as recorded.
- The installer runs with LANG=C and without DISPLAY. It writes /tmp/cuda-installer.log whatever
  --tmpdir says and crashes on one it cannot replace: an earlier one is moved aside first, and its
  log is read from there after. Its compiler check can refuse the host's gcc: that failure is told
  from the log and names `cuda_installer_override` (True passes --override, which skips the check).
- A kept toolkit's fingerprint recorded before fingerprints had the files' modification times gets
  them, once, on whatever run comes next, where the tree still matches the rest of that fingerprint
  (one that no longer does keeps its record: the verify step fails it).
- A failed install moves the tree aside to `<install_path>.failed-<UTC>` and shows the tail of the
  installer log; the next run installs again. An install interrupted before its checks (the
  control machine died) is finished, or moved aside, by the next run, which finds
  `toolkit-install.json`.

The runfile's digest (a read of 4 GB) is read only when an install is due and a file is there to
check (a full-size cached copy, or the pre-staged file), through `reads.fact(RunfileDigest, ...)`:
preflight reads it first (a bad pre-staged runfile refuses the host before any step changes
anything), this step reuses that read in the same stage. A runfile that fails verification is moved
aside to `*.rejected-<UTC>`; only the newest rejected copy is kept, and the run says which older one
it removed.

A tree at the install path that servestack cannot confirm as the manifest's toolkit (another
version, no `version.json`, files owned by dpkg — e.g. NVIDIA's Ubuntu packages, whose nvcc
reports the same V13.0.88 for 13.0.2) is never installed over: the host is refused, unless host
data sets `cuda_existing_toolkit = "accept"` and its nvcc reports the manifest's nvcc version.

The host-side shell is in files/scripts: cuda-runfile.sh (download, verify, reject the runfile)
and cuda-toolkit.sh (install, restore or point the link, move an interrupted install aside); the
`*_command` functions here render their inputs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from packaging.version import Version
from pyinfra import host
from pyinfra.api import FunctionCommand, deploy, operation

from facts.batch import FactRequest
from facts.toolkit import (
    CudaToolkits,
    Digest,
    Fingerprint,
    LinkChain,
    RunfileDigest,
    ToolkitFingerprint,
    ToolkitState,
    Tree,
    toolkit_fact_arguments,
)
from servestack import download, reads
from servestack.checks.toolkit import version_json_problem
from servestack.hostrun import (
    FAILED,
    fail_host,
    host_refused,
    noop,
    plan,
    refuse,
    run_id,
    run_remote,
    utc_stamp,
    while_busy,
)
from servestack.manifest import Runfile
from servestack.paths import RunfileSource, kept_paths, runfile_source, toolkit_marker_path, toolkits_record_path
from servestack.scripts import atomic_write_command, script_command
from servestack.settings import Settings, host_settings

RECORD_SCHEMA = 1
LOG_TAIL_LINES = 25
#: The installer's own log, built into it (nixpkgs' cudatoolkit recipe patches this string out of the
#: binary): written whatever --tmpdir or TMPDIR say, as well as the manifest's `log_path` when root.
INSTALLER_TMP_LOG = "/tmp/cuda-installer.log"
OVERRIDE_KEY = "cuda_installer_override"


def human_bytes(size: int) -> str:
    """4302469087 -> '4.3 GB' (decimal units, as download pages print them)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def host_reads(settings: Settings, release=None) -> list[FactRequest]:
    """What this step reads of a host before it decides: the one CudaToolkits read of `runfile_toolkit`
    (the runfile's digest and the kept toolkits' fingerprints are read only when an install is due)."""
    return [FactRequest.of(CudaToolkits, **toolkit_fact_arguments(settings))]


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


def _ours_interrupted(tree: Tree, marker: dict | None) -> bool:
    if not marker:
        return False
    return marker.get("path") == tree.path


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
    if marker is not None and _ours_interrupted(tree, marker):
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
    if digest is None or not digest.present or digest.stat is None:
        return "the file is missing"
    if digest.md5 is None or digest.sha256 is None:
        return "md5sum or sha256sum gave no answer for it"
    return download.mismatch(runfile, download.Sums(digest.stat.size, digest.md5, digest.sha256))


def prestaged_problem(source: RunfileSource, stats: dict, digest: Digest | None) -> str | None:
    """Why the pre-staged runfile cannot be used, naming the file and its key, or None."""
    if stats.get(source.cached) is None:
        return f"cuda_runfile_path {source.cached}: no such file on the host"
    problem = digest_problem(source.runfile, digest)
    if problem:
        return f"cuda_runfile_path {source.cached} fails verification ({problem}): not used"
    return None


@dataclass(frozen=True)
class RunfilePlan:
    """How this host gets a verified runfile for the install."""

    use: str | None = None                          # the file the install verifies and runs
    rejects: tuple[tuple[str, str], ...] = ()       # (path, why) moved aside first
    fetch: str | None = None                        # "download", "upload" or None
    resume_from: int = 0
    lines: tuple[str, ...] = ()
    problem: str | None = None                      # refuse: the runfile cannot be had


def runfile_to_verify(settings: Settings, state: ToolkitState) -> str | None:
    """The runfile whose digest this host's install needs: none when no install is due."""
    source = runfile_source(settings, state.arch)
    if source is None or not assess_install(settings, state.install, state.marker).install_needed:
        return None
    return file_to_hash(source, state.files)


def read_runfile_digest(host_, settings: Settings, state: ToolkitState) -> Digest | None:
    """The digest `runfile_to_verify` names, read once per stage (preflight's read is this step's)."""
    path = runfile_to_verify(settings, state)
    return reads.fact(host_, RunfileDigest, path=path) if path else None


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
        problem = prestaged_problem(source, stats, digest)
        if problem:
            return RunfilePlan(problem=problem)
        return RunfilePlan(use=source.cached, lines=(f"pre-staged runfile {source.cached}: verified",))
    assert source.part is not None  # only a pre-staged source has no partial file (servestack/paths.py)
    rejects, lines = [], []
    if cached is not None:
        problem = (f"size {cached.size} bytes, expected {runfile.size}" if cached.size != runfile.size
                   else digest_problem(runfile, digest))
        if problem is None:
            return RunfilePlan(use=source.cached, lines=(f"runfile {source.cached}: cached and verified",))
        rejects.append((source.cached, problem))
        lines.append(f"cached runfile {source.cached} fails verification ({problem}): "
                     "move it aside to *.rejected-<UTC> (the only rejected copy kept), never use it")
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


# Commands: the host-side shell is in files/scripts (cuda-runfile.sh, cuda-toolkit.sh); these render its inputs

def _runfile_env(runfile: Runfile) -> dict:
    return {"SS_RUNFILE_URL": runfile.url, "SS_RUNFILE_SIZE": runfile.size, "SS_RUNFILE_MD5": runfile.md5,
            "SS_RUNFILE_SHA256": runfile.sha256}


def _link_env(chain: LinkChain) -> dict:
    return {"SS_LINK_PATH": chain.path, "SS_LINK_KIND": chain.kind,
            "SS_LINK_HOPS": "\n".join(f"{link}\t{target}" for link, target in chain.hops)}


def reject_command(path: str, reason: str) -> str:
    """Move a runfile that failed verification aside (only the newest rejected copy is kept)."""
    return script_command("cuda-runfile.sh", "reject", path, reason)


def _reject_runfile(state, host, path: str, reason: str) -> bool:
    """Move a runfile that failed verification aside now, saying which older rejected copy went."""
    ok, stdout, stderr = run_remote(host, reject_command(path, reason))
    messages = [line.removeprefix("servestack: ") for line in stdout + stderr]
    if not ok:
        return fail_host(host, FAILED, messages)
    for message in messages:
        host.log(message)
    return True


def download_command(source: RunfileSource, attempts: int = 5, busy: str | None = None) -> str:
    """curl into `<file>.part`, resuming what is there; retries resume too.

    With `busy` (the lock's busy file) it holds that flock while it runs, so a run that dies
    meanwhile leaves a lock that is not taken for stale until the download is over.
    """
    env = {**_runfile_env(source.runfile), "SS_ATTEMPTS": attempts, **({"SS_BUSY_FILE": busy} if busy else {})}
    return script_command("cuda-runfile.sh", "download", source.part, env=env)


def verify_command(runfile: Runfile, path: str, ours: bool, dest: str | None = None) -> str:
    """Verify `path` (size, md5, sha256); a failing file of ours is moved aside. Renamed to `dest` once verified."""
    env = {**_runfile_env(runfile), "SS_PRESTAGED": 0 if ours else 1}
    return script_command("cuda-runfile.sh", "verify", path, *([dest] if dest else []), env=env)


def restore_link_command(chain: LinkChain) -> str:
    """Put each recorded hop of the `/usr/local/cuda` chain back (only hops that changed)."""
    return script_command("cuda-toolkit.sh", "restore-link", env=_link_env(chain))


def installer_flags(settings: Settings) -> list[str]:
    """The manifest's installer flags, and --override (skips the compiler check) when host data asks."""
    return [*settings.manifest.cuda["installer_flags"], *(["--override"] if settings.cuda_installer_override else [])]


def compiler_hint(settings: Settings) -> str:
    """What to do when the installer's compiler check refuses the host's gcc."""
    if settings.cuda_installer_override:
        return f"{OVERRIDE_KEY} = True already passes --override"
    return (f"set {OVERRIDE_KEY} = True in this host's data to pass --override (it skips that check), "
            f"or install a gcc that CUDA {settings.cuda_version} supports")


def install_command(settings: Settings, source: RunfileSource, use: str, keep_chain: LinkChain | None,
                    run: str) -> str:
    """Verify the runfile, run it toolkit-only, decide success from exit code and nvcc; clean up a failure."""
    cuda, state_dir = settings.manifest.cuda, settings.servestack_state_dir
    marker = {"path": settings.cuda_install_path, "version": settings.cuda_version, "run_id": run,
              "started": utc_stamp()}
    env = {
        "SS_RUNFILE": source.cached,
        "SS_INSTALL_PATH": settings.cuda_install_path,
        "SS_TMP_DIR": settings.cuda_tmpdir,
        "SS_STATE_DIR": state_dir,
        "SS_MARKER_FILE": toolkit_marker_path(state_dir),
        "SS_MARKER": json.dumps(marker),
        "SS_CUDA_VERSION": settings.cuda_version,
        "SS_NVCC_RELEASE": ".".join(str(part) for part in Version(settings.cuda_version).release[:2]),
        "SS_NVCC_VERSION": cuda["nvcc_version"],
        "SS_INSTALLER_LOG": cuda["log_path"],
        "SS_INSTALLER_TMP_LOG": INSTALLER_TMP_LOG,
        "SS_LOG_TAIL_LINES": LOG_TAIL_LINES,
        "SS_COMPILER_HINT": compiler_hint(settings),
        **(_link_env(keep_chain) if keep_chain is not None else {}),
    }
    verify = verify_command(source.runfile, use, ours=source.mode != "prestaged", dest=source.cached)
    return f"{verify} && {script_command('cuda-toolkit.sh', 'install', *installer_flags(settings), env=env)}"


def move_aside_command(path: str, state_dir: str) -> str:
    """Move an interrupted install's tree aside and forget its marker."""
    return script_command("cuda-toolkit.sh", "move-aside", path, toolkit_marker_path(state_dir))


def write_json_command(path: str, data: dict) -> str:
    return atomic_write_command(path, json.dumps(data, indent=1, sort_keys=True))


def point_link_command(link: str, target: str) -> str:
    return script_command("cuda-toolkit.sh", "point-link", link, target)


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


def paths_to_complete(settings: Settings, state: ToolkitState) -> tuple[str, ...]:
    """Kept toolkits present in a record of this target made before fingerprints had the files'
    modification times (no `mtimes_sha256`): `completed` adds them once."""
    record = state.record
    if record is None or state.record_invalid or record.get("target") != record_target(settings):
        return ()
    recorded = record.get("toolkits", {})
    return tuple(path for path in kept_paths(settings) if isinstance(recorded.get(path), dict)
                 and recorded[path].get("present") and not recorded[path].get("mtimes_sha256"))


def completed(state: ToolkitState, fingerprints: dict) -> dict:
    """The fingerprints (now) of `paths_to_complete` whose record they still match but for the times: a
    tree that changed since it was recorded keeps its record, which the verify step fails."""
    recorded = (state.record or {}).get("toolkits", {})
    return {path: now for path, now in fingerprints.items()
            if not Fingerprint.from_record(path, recorded[path]).differences(now)}


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
        run_remote(host, restore_link_command(expected_chain))
        toolkits = host.get_fact(CudaToolkits, **toolkit_fact_arguments(settings))
        host.log(f"the installer changed the link to {changed}: restored {toolkits.link.describe()}")
    fingerprints = {path: host.get_fact(ToolkitFingerprint, path=path) for path in kept_paths(settings)}
    problems = after_install_problems(settings, toolkits, fingerprints, expected_chain)
    if problems:
        fail_host(host, FAILED, [f"toolkit check failed: {problem}" for problem in problems])
        host.log(f"every run re-checks until this is resolved: repair the host, or accept what it shows by "
                 f"removing {toolkit_marker_path(settings.servestack_state_dir)}")
        return False
    record = json.loads(json.dumps(toolkits.record or {}))
    record["installed"] = {**record_target(settings), "at": utc_stamp(), "run_id": run_id(state),
                           "link_policy": settings.cuda_link_policy, "link": toolkits.link.to_record()}
    ok, _, stderr = run_remote(host, write_json_command(toolkits_record_path(settings.servestack_state_dir), record)
                               + f" && rm -f {shlex.quote(toolkit_marker_path(settings.servestack_state_dir))}")
    if not ok:
        return fail_host(host, FAILED, [f"could not update toolkits.json: {' '.join(stderr)}"])
    host.log(f"checked: nvcc reports {settings.manifest.cuda['nvcc_version']}, kept toolkits unchanged, "
             f"{toolkits.link.describe()}")
    return True


def _upload_from_controller(state, host, runfile: Runfile, part: str) -> bool:
    """Download the runfile once on the control machine (verified), then send it to this host."""
    try:
        local = download.fetch_runfile(runfile)
        host.log(f"uploading {human_bytes(runfile.size)} from {local}")
        download.upload_to_host(host, local, part, run_remote)
    except download.DownloadError as error:
        return fail_host(host, FAILED, [str(error)])
    return True


# The operation

@dataclass
class _Steps:
    lines: list = field(default_factory=list)
    commands: list = field(default_factory=list)


def _record_steps(settings: Settings, state: ToolkitState, steps: _Steps) -> None:
    paths, incomplete = paths_to_record(settings, state), paths_to_complete(settings, state)
    if not paths and not incomplete:
        return
    read = reads.read(host, [FactRequest.of(ToolkitFingerprint, path=path) for path in paths + incomplete])
    fingerprints, more = dict(zip(paths, read)), completed(state, dict(zip(incomplete, read[len(paths):])))
    if not fingerprints and not more:
        return
    target = toolkits_record_path(settings.servestack_state_dir)
    steps.lines += _record_lines(state, fingerprints, more, target)
    steps.commands.append(write_json_command(target, new_record(settings, state, {**fingerprints, **more},
                                                                run_id(host.state))))


def _record_lines(state: ToolkitState, fingerprints: dict, more: dict, target: str) -> list[str]:
    lines = []
    if fingerprints:
        described = ", ".join(f"{path} ({fp.files} files)" if fp.present else f"{path} (absent)"
                              for path, fp in fingerprints.items())
        lines.append(f"record fingerprints of {described} and {state.link.describe()} in {target}")
    if more:
        lines.append(f"add the files' modification times to the fingerprint of {', '.join(more)} in {target} "
                     "(recorded before fingerprints had them)")
    return lines


def _link_steps(settings: Settings, state: ToolkitState, installs: bool, steps: _Steps) -> None:
    chain = state.link
    line, change = link_line(settings, chain)
    recorded = kept_link_to_restore(settings, state) if not installs else None
    if recorded is not None:
        steps.lines.append(restore_line(chain, recorded))
        steps.commands.append(restore_link_command(recorded))
    elif change:
        steps.lines.append(line)
        steps.commands.append(point_link_command(chain.path, settings.cuda_install_path))
    else:
        noop(host, line)


def kept_link_to_restore(settings: Settings, state: ToolkitState) -> LinkChain | None:
    """Under cuda_link_policy = 'keep', the link chain toolkits.json recorded before the install when
    the host's link no longer resolves where it did (removed or re-pointed by hand since): what
    the verify step's `cuda_link` compares with, so the converge puts it back. None otherwise."""
    record = state.record or {}
    if settings.cuda_link_policy != "keep" or not isinstance(record.get("link"), dict):
        return None
    recorded, now = LinkChain.from_record(record["link"]), state.link
    if recorded.resolved == now.resolved:
        return None
    restorable = recorded.hops or (recorded.kind == "absent" and now.hops)   # links only: never a directory
    return recorded if restorable else None


def restore_line(now: LinkChain, recorded: LinkChain) -> str:
    return (f"restore {recorded.describe()} as toolkits.json recorded it before the install (now "
            f"{now.describe()}; cuda_link_policy = 'keep')")


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
    runfile_plan = plan_runfile(source, state.files, read_runfile_digest(host, settings, state))
    if runfile_plan.problem:
        return runfile_plan.problem
    assert runfile_plan.use is not None  # a plan without a problem names the file it installs from
    steps.lines += runfile_plan.lines
    steps.commands += [FunctionCommand(_reject_runfile, (path, why), {}) for path, why in runfile_plan.rejects]
    if runfile_plan.fetch == "download":
        steps.commands.append(while_busy(host, settings.servestack_state_dir, "cuda runfile download",
                                         download_command(source)))
    elif runfile_plan.fetch == "upload":
        steps.commands.append(FunctionCommand(_upload_from_controller, (source.runfile, source.part), {}))
    if verdict.kind == "interrupted":
        steps.lines.append(f"{verdict.detail}: move it aside to {settings.cuda_install_path}.failed-<UTC>")
        steps.commands.append(move_aside_command(settings.cuda_install_path, settings.servestack_state_dir))
    keep = state.link if settings.cuda_link_policy == "keep" else None
    steps.lines.append(f"install {settings.cuda_version} into {settings.cuda_install_path}")
    steps.commands.append(while_busy(host, settings.servestack_state_dir, f"cuda {settings.cuda_version} install",
                                     install_command(settings, source, runfile_plan.use, keep, run_id(host.state))))
    steps.commands.append(FunctionCommand(_check_after_install, (settings, keep), {}))
    return None


@operation()
def runfile_toolkit():
    """
    Install the manifest's CUDA toolkit with its runfile, side by side with the kept toolkits.

    Reads the host data of servestack.settings (cuda_install_path, cuda_cache_dir, cuda_tmpdir,
    cuda_runfile_url / cuda_mirror / cuda_runfile_path / cuda_runfile_from, cuda_link_policy,
    cuda_existing_toolkit, cuda_installer_override); takes no arguments. See the module docstring for what it does.
    """
    settings = host_settings(host)
    if host_refused(host):
        noop(host, "host refused by preflight")
        return
    state = reads.fact(host, CudaToolkits, **toolkit_fact_arguments(settings))
    source = runfile_source(settings, state.arch)
    verdict = assess_install(settings, state.install, state.marker)
    if source is None or verdict.refused:
        yield from refuse(host, [verdict.detail] if verdict.refused else
                          [f"no CUDA runfile for architecture {state.arch} in {settings.manifest.path.name}"])
        return
    steps = _Steps()
    _record_steps(settings, state, steps)
    if verdict.install_needed:
        problem = _install_steps(settings, state, source, verdict, steps)
        if problem:
            yield from refuse(host, [problem])
            return
    else:
        noop(host, f"{verdict.detail}: the runfile is not needed")
        _finish_steps(settings, state, steps)
    _link_steps(settings, state, verdict.install_needed, steps)
    for line in steps.lines:
        plan(host, line)
    yield from steps.commands


@deploy("CUDA toolkit")
def cuda_toolkit():
    """The manifest's CUDA toolkit beside the kept ones; `/usr/local/cuda` per cuda_link_policy."""
    settings = host_settings(host)
    runfile_toolkit(name=f"CUDA {settings.cuda_version} at {settings.cuda_install_path}")
