"""servestack's host-side tool for the ML environment (runs on the target host, stdlib only).

The control machine (operations/venv.py) sends this file over SSH as
`python3 -I -S -c THIS_FILE <command> <params>` (params: base64 of a JSON object; facts/venv.py
`tool_command`, servestack/scripts.py) and decides *whether* to run it from facts; this file does
the mechanical part on the host, where renames are atomic and JSON records are written safely
(servestack/hostcode.py `write_atomically` and `point_link`, sent in place of the line that imports them):

    packages  print the active environment's packages (the ActivePackages fact; changes nothing)
    backup    snapshot the environment at venv_path into <state_dir>/backups/<UTC ts>.json, prune
    build     build one release beside the active one: venv, lock, ordered install, checks; where the
              stack's hashes are fixed (params "fixed"), a resolution that differs from them is refused
    lock      print a built release's lock as {name: {"version", "hashes"}} and how it differs from the
              fixed hashes given (changes nothing)
    activate  adopt a hand-made venv if needed, then point venv_path at a release (rename(2))
    record    add one switch made elsewhere to the activation history (the service's health gate
              rolling back: files/scripts/sglang-health-gate.sh)
    prune     delete releases the control machine chose (never the active one)
    backups   print a summary of each kept snapshot (the listing command's fact; changes nothing)

Every failure prints one line starting with "servestack:" to stderr and exits non-zero. Each
command prints its result as one JSON line in the section `result` (facts/framing.py), last on
stdout; `build` prints a progress line before and after each of its steps first ("servestack:
install step 2 (...): done after 3.1 s").
"""

# Other imports are local to the functions that need them.
import binascii  # a builtin module; base64 would import re and struct on top of it
import json
import os
import re  # free once json is imported
import sys
from servestack.hostcode import point_link, section_text, write_atomically

RECORD = "release.json"
CHECK_RECORD = "check.json"  # the release check's result (files/scripts/check_release.py)
HISTORY = "releases.json"
BACKUP_NAME = re.compile(r"^\d{8}T\d{6}Z(-\d+)?\.json$")
RELEASE_NAME = re.compile(r"^(r-[0-9a-f]{12}|adopted-\d{8}T\d{6}Z)$")

LIST_PACKAGES = (
    "import importlib.metadata as m, json, platform, sys\n"
    "seen = {}\n"
    "for d in m.distributions():\n"
    "    name = d.metadata['Name']\n"
    "    if name and name.lower() not in seen: seen[name.lower()] = (name, d.version)\n"
    "print(json.dumps({'python': platform.python_version(), 'prefix': sys.prefix,\n"
    "                  'packages': {n: v for n, v in sorted(seen.values(), key=lambda i: i[0].lower())}}))\n"
)


def text_beside(name):
    """The text of files/scripts/NAME, read beside this file where it lies (the tests run it there). Sent to
    a host, it has no file: servestack/scripts.py puts NAME's text in place of the line that calls this."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)) as handle:
        return handle.read()


# the release's checks, run in its own python (check_release)
CHECK_SCRIPT = text_beside("check_release.py")


class Failure(Exception):
    """A clear, one-line reason the command did not do its job."""


def utc_stamp():
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def read_json(path, default=None):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return default


def write_json(path, data):
    """Write JSON atomically: a reader sees the old file or the new one, never half of one."""
    write_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


# --- reading the environment -------------------------------------------------------------------

def env_packages(venv):
    """The packages, Python version and prefix of a venv, by running its own python (pip or not)."""
    import subprocess
    python = os.path.join(venv, "bin", "python")
    try:
        result = subprocess.run([python, "-c", LIST_PACKAGES], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": "cannot run %s: %s" % (python, error)}
    if result.returncode != 0:
        lines = (result.stderr.strip() or "exit %d" % result.returncode).splitlines()
        return {"error": "%s failed: %s" % (python, lines[-1])}
    return json.loads(result.stdout)


def venv_path_state(venv_path, releases_dir):
    """What sits at venv_path: missing, a link (to a release or elsewhere), a venv, or something else."""
    state = {"path": venv_path, "kind": "missing", "target": None, "realpath": None, "release": None}
    if os.path.islink(venv_path):
        state["kind"] = "link"
        state["target"] = os.readlink(venv_path)
    elif os.path.isdir(venv_path):
        state["kind"] = "venv" if os.path.isfile(os.path.join(venv_path, "pyvenv.cfg")) else "other"
    elif os.path.lexists(venv_path):
        state["kind"] = "other"
    if state["kind"] == "missing":
        return state
    state["realpath"] = os.path.realpath(venv_path)
    if state["kind"] == "link":
        state["release"] = release_of(state["target"], releases_dir)
        if not os.path.isfile(os.path.join(state["realpath"], "pyvenv.cfg")):
            state["kind"] = "broken-link"
    return state


def release_of(link_target, releases_dir):
    """The release id a venv_path link names (`<releases_dir>/<id>/venv`), else None."""
    parent, leaf = os.path.split(os.path.normpath(link_target))
    if leaf == "venv" and os.path.dirname(parent) == os.path.normpath(releases_dir):
        name = os.path.basename(parent)
        if RELEASE_NAME.match(name):
            return name
    return None


def backups(state_dir):
    directory = os.path.join(state_dir, "backups")
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if BACKUP_NAME.match(name))


def uv_version(uv, timeout=30):
    """`uv --version`'s second word, or None when uv cannot run, fails or outlives `timeout` s."""
    import subprocess
    try:
        result = subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = result.stdout.split() if result.returncode == 0 else []
    return parts[1] if len(parts) >= 2 else None


def command_packages(params):
    """The active environment's packages (None unless venv_path is a venv or a link to one)."""
    where = venv_path_state(params["venv_path"], params["releases_dir"])
    return env_packages(params["venv_path"]) if where["kind"] in ("venv", "link") else None


# --- backup ------------------------------------------------------------------------------------

def snapshot(venv_path, releases_dir):
    where = venv_path_state(venv_path, releases_dir)
    if where["kind"] not in ("venv", "link"):
        return None
    listed = env_packages(venv_path)
    if "error" in listed:
        raise Failure("cannot list the packages of %s before changing it: %s" % (venv_path, listed["error"]))
    return {"venv_path": venv_path, "realpath": where["realpath"], "release": where["release"],
            "python": listed["python"], "packages": listed["packages"]}


def same_environment(a, b):
    keys = ("realpath", "python", "packages")
    return bool(a and b) and all(a.get(key) == b.get(key) for key in keys)


def command_backup(params):
    state_dir, keep = params["state_dir"], params["keep"]
    current = snapshot(params["venv_path"], params["releases_dir"])
    if current is None:
        return {"written": None, "reason": "no environment at %s" % params["venv_path"]}
    directory = os.path.join(state_dir, "backups")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    names = backups(state_dir)
    latest = read_json(os.path.join(directory, names[-1])) if names else None
    written = None
    if not same_environment(current, latest):
        stamp = utc_stamp()
        name, number = stamp + ".json", 1
        while os.path.exists(os.path.join(directory, name)):
            name, number = "%s-%d.json" % (stamp, number), number + 1
        current.update({"timestamp": stamp, "reason": params.get("reason", "")})
        write_json(os.path.join(directory, name), current)
        written = name
    names = backups(state_dir)
    pruned = names[:-keep] if len(names) > keep else []
    for name in pruned:
        os.remove(os.path.join(directory, name))
    return {"written": written, "pruned": pruned}


def command_backups(params):
    directory = os.path.join(params["state_dir"], "backups")
    summaries = []
    for name in backups(params["state_dir"]):
        snapshot = read_json(os.path.join(directory, name), {}) or {}
        packages = snapshot.get("packages") or {}
        torch = next((version for package, version in packages.items() if canonical(package) == "torch"), None)
        summaries.append({"file": os.path.join(directory, name), "timestamp": snapshot.get("timestamp"),
                          "venv_path": snapshot.get("venv_path"), "realpath": snapshot.get("realpath"),
                          "release": snapshot.get("release"), "python": snapshot.get("python"),
                          "packages": len(packages), "torch": torch, "reason": snapshot.get("reason")})
    return {"backups": summaries}


# --- build -------------------------------------------------------------------------------------

def parse_lock(text):
    """Entries of a `uv pip compile --generate-hashes --emit-index-annotation` lock, in file order."""
    entries, current, in_via = [], None, False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and current is None):
            continue
        if not line.startswith((" ", "\t", "#")):
            spec = stripped.rstrip("\\").strip()
            current = {"spec": spec, "hashes": [], "via": [], "index": None}
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(==\s*(\S+)|@\s*(\S+))", spec)
            if not match:
                raise Failure("cannot read lock line %r" % line)
            current["name"] = canonical(match.group(1))
            current["version"] = match.group(3)
            current["url"] = match.group(4)
            entries.append(current)
            in_via = False
            continue
        if stripped.startswith("--hash="):
            current["hashes"].append(stripped.split("=", 1)[1].rstrip("\\").strip())
        elif stripped.startswith("# via"):
            rest = stripped[len("# via"):].strip()
            in_via = not rest
            if rest:
                current["via"].append(rest)
        elif stripped.startswith("# from "):
            current["index"] = stripped[len("# from "):].strip()
            in_via = False
        elif stripped.startswith("#") and in_via:
            current["via"].append(stripped.lstrip("#").strip())
    return entries


def lock_packages(entries):
    """{name: {"version", "hashes"}} of lock entries: what fixes a stack's hashes (servestack/releases.py)."""
    return {entry["name"]: {"version": entry["version"], "hashes": sorted(entry["hashes"])} for entry in entries}


def fixed_hash_problems(entries, fixed):
    """How a resolution differs from the stack's fixed hashes: another package or version, or a file the fixed
    lock does not have (a mirror may serve fewer of a version's files, never other bytes)."""
    problems, found = [], lock_packages(entries)
    for name, entry in sorted(found.items()):
        known = fixed.get(name)
        if known is None:
            problems.append("%s %s is not in it" % (name, entry["version"] or "(a direct URL)"))
        elif known["version"] != entry["version"]:
            problems.append("%s is %s, it has %s" % (name, entry["version"], known["version"]))
        else:
            other = sorted(set(entry["hashes"]) - set(known["hashes"]))
            if other:
                problems.append("%s %s: the index lists a file it does not have (%s)"
                                % (name, entry["version"] or "(a direct URL)", ", ".join(other)))
    problems += ["%s %s is missing from the resolution" % (name, fixed[name]["version"])
                 for name in sorted(set(fixed) - set(found))]
    return problems


def assign_steps(entries, steps):
    """Give each lock entry the install step it belongs to.

    A stack package keeps its manifest step; any other package lands with the earliest step of a
    package that needs it (from the lock's `# via` annotations), so each step installs a
    self-consistent set in the documented order.
    """
    pinned = {canonical(name): step for name, step in steps.items()}
    last = max(pinned.values())
    step_of = {entry["name"]: pinned.get(entry["name"]) for entry in entries}
    parents = {entry["name"]: [canonical(via.split()[0]) for via in entry["via"]
                               if not via.startswith("-") and "(" not in via]
               for entry in entries}
    changed = True
    while changed:
        changed = False
        for name, step in step_of.items():
            if name in pinned:
                continue
            known = [step_of[parent] for parent in parents[name] if step_of.get(parent) is not None]
            best = min(known) if known else None
            if best is not None and (step is None or best < step):
                step_of[name], changed = best, True
    return {name: (step if step is not None else last) for name, step in step_of.items()}


def step_files(entries, steps):
    """[(step, index or None, requirements text)] in install order, one per (step, index)."""
    step_of = assign_steps(entries, steps)
    groups = {}
    for entry in entries:
        key = (step_of[entry["name"]], entry["index"] or "")
        lines = [entry["spec"]] + ["--hash=%s" % digest for digest in entry["hashes"]]
        groups.setdefault(key, []).append(" \\\n    ".join(lines))
    return [(step, index or None, "\n".join(lines) + "\n") for (step, index), lines in sorted(groups.items())]


# uv can die from a crash signal after doing its work (SIGSEGV at exit, astral-sh/uv#21428, seen on
# a 2-CPU CI machine); compile and the hash-locked installs are safe to repeat, so they get one retry.
CRASH_SIGNALS = {11: "SIGSEGV", 7: "SIGBUS"}


def run(command, log, env, cwd=None, what=None, retry_crash=False):
    import subprocess
    import time
    for attempt in (1, 2):
        log.write("$ %s\n" % " ".join(command))
        log.flush()
        started = time.monotonic()
        progress("%s: started" % (what or command[0]))
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        log.write("# exit %d after %.2f s\n" % (result.returncode, time.monotonic() - started))
        log.flush()
        progress("%s: %s after %.1f s" % (what or command[0], "done" if result.returncode == 0 else "failed",
                                          time.monotonic() - started))
        crash = CRASH_SIGNALS.get(-result.returncode)
        if not (crash and retry_crash and attempt == 1):
            break
        log.write("# %s died from %s; running it once more\n" % (command[0], crash))
    if result.returncode != 0:
        raise Failure("%s failed (%s): %s; full log: %s" % (what or command[0], exit_text(result.returncode),
                                                            failure_reason(log.name, result.returncode), log.name))


def progress(text):
    """A line of what a long command is doing, as it happens (the deploy streams it to the operator)."""
    write_out("servestack: %s\n" % text)


def write_out(text):
    """stdout, unless the run that started this command is gone (its connection closed): then the
    command goes on without it (files/scripts/busy.sh), writing to /dev/null from here on."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def write_section(name, text):
    """`text` as the facts/framing.py section `name`, by `write_out`."""
    write_out(section_text(name, text))


def exit_text(returncode):
    if returncode < 0:
        return "killed by %s" % CRASH_SIGNALS.get(-returncode, "signal %d" % -returncode)
    return "exit %d" % returncode


def failure_reason(log_name, returncode):
    """The log's first error-looking line among its last 12, else its last line."""
    with open(log_name) as handle:
        tail = [line.rstrip() for line in handle.readlines()[-12:] if line.strip()]
    for line in tail:
        if line.lstrip().lower().startswith(("error", "caused by", "×", "because")):
            return line.strip()
    return tail[-1] if tail else exit_text(returncode)


def uv_environment(params):
    """A clean environment for uv: the user's UV_* settings must not change what is resolved."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("UV_", "PIP_"))}
    env.update({"UV_CACHE_DIR": params["cache_dir"], "UV_PYTHON_DOWNLOADS": "never",
                "UV_NO_PROGRESS": "1", "UV_LINK_MODE": "hardlink"})
    return env


def check_release(python, params, log):
    """Run the release's checks inside its own python, with the environment the service's unit gives it
    (params "unit_env", servestack/serving.py `service_environment`: flashinfer loads CUDA_LIB_PATH/libcudart.so.12
    at import where it is there); raise Failure listing every problem. Their record stays in the release
    directory (CHECK_RECORD)."""
    import subprocess
    check, record = (os.path.join(params["release_dir"], name) for name in ("check.py", CHECK_RECORD))
    with open(check, "w") as handle:
        handle.write(CHECK_SCRIPT)
    command = [python, check, json.dumps(params["expect"]), record]
    log.write("$ %s %s %s\n" % (python, check, record))
    log.flush()
    result = subprocess.run(command, stdout=log, stderr=subprocess.PIPE, text=True, env=params["unit_env"])
    log.write(result.stderr)
    checked = read_json(record)
    if checked is None or result.returncode not in (0, 1):  # it died (before or after writing its result)
        raise Failure("checks failed: " + (result.stderr.strip() or exit_text(result.returncode)).splitlines()[-1])
    if checked["problems"]:
        raise Failure("checks failed: " + "; ".join(checked["problems"]))
    log.write("# checks passed: %s\n" % record)


def install_uv(params, log):
    """Install the pinned uv into its own venv with the host's python3 and pip (if missing/wrong)."""
    from urllib.parse import urlsplit
    uv = params["uv"]
    if uv_version(uv) == params["uv_version"]:
        return
    home = os.path.dirname(os.path.dirname(uv))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    run([sys.executable, "-m", "venv", home], log, env, what="creating uv's venv %s" % home)
    command = [os.path.join(home, "bin", "pip"), "install", "--quiet", "--disable-pip-version-check",
               "--index-url", params["uv_index_url"], "uv==%s" % params["uv_version"]]
    if params["uv_index_url"].startswith("http://"):  # pip ignores a plain-http index unless trusted
        command += ["--trusted-host", urlsplit(params["uv_index_url"]).hostname]
    run(command, log, env,
        what="installing uv %s from %s" % (params["uv_version"], params["uv_index_url"]))
    if uv_version(uv) != params["uv_version"]:
        raise Failure("%s does not report uv %s after installing it" % (uv, params["uv_version"]))


def build(params, log):
    directory, uv = params["release_dir"], params["uv"]
    venv = os.path.join(directory, "venv")
    python = os.path.join(venv, "bin", "python")
    env = uv_environment(params)
    install_uv(params, log)
    run([uv, "venv", "--quiet", "--python", params["python"], venv], log, env, what="uv venv")
    run([uv, "pip", "compile", "pyproject.toml", "--quiet", "--python", python, "--overrides",
         "overrides.txt", "--generate-hashes", "--emit-index-annotation", "--no-header",
         "--index-strategy", "first-index"] + params["bound"] + ["-o", "lock.txt"], log, env, cwd=directory,
        what="resolving the lock (uv pip compile)", retry_crash=True)
    with open(os.path.join(directory, "lock.txt")) as handle:
        entries = parse_lock(handle.read())
    if params.get("fixed") is not None:
        problems = fixed_hash_problems(entries, params["fixed"])
        if problems:
            raise Failure("the resolution differs from the stack's hashes fixed in %s (a mirror cannot change what "
                          "is installed): %s" % (params["fixed_path"], "; ".join(problems)))
    for number, (step, index, text) in enumerate(step_files(entries, params["steps"]), 1):
        path = os.path.join(directory, "step-%d-%d.txt" % (step, number))
        with open(path, "w") as handle:
            handle.write(text)
        # The overrides shaped the one resolution; installing its result with --no-deps re-resolves
        # nothing (flashinfer stays 0.6.4 despite sglang's pin), and --require-hashes refuses any
        # requirement without a hash, so overrides are not passed again. --no-config: only the
        # index the lock names for these pins is consulted.
        command = [uv, "pip", "install", "--quiet", "--no-config", "--python", python, "--no-deps",
                   "--require-hashes", "-r", path]
        if index:
            command[3:3] = ["--default-index", index]
        else:
            command[3:3] = ["--no-index"]
        run(command, log, env, what="install step %d (%s)" % (step, os.path.basename(path)), retry_crash=True)
    params["expect"]["lock"] = {entry["name"]: entry["version"] for entry in entries if entry["version"]}
    check_release(python, params, log)
    listed = env_packages(venv)
    if "error" in listed:
        raise Failure(listed["error"])
    return listed


def build_guard(directory):
    """Hold `<releases dir>/.build-guard` (flock) for this process: a release directory is written by
    one build at a time (one build at a time on the host). Another build holding it is named in the
    failure (its release, pid, since when)."""
    import fcntl
    path = os.path.join(os.path.dirname(directory.rstrip("/")), ".build-guard")  # one per releases dir
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        raise Failure("release %s cannot be built now: another build holds %s (%s)"
                      % (os.path.basename(directory), path, holder)) from None
    handle.seek(0)
    handle.truncate()
    handle.write("release %s, pid %d, since %s\n" % (os.path.basename(directory), os.getpid(), utc_stamp()))
    handle.flush()
    return handle


def command_build(params):
    import hashlib
    import shutil
    import time
    directory = params["release_dir"]
    guard = build_guard(directory)  # noqa: F841 (held until this process exits)
    record_path = os.path.join(directory, RECORD)
    record = read_json(record_path, {}) or {}
    if record.get("status") == "ok" and os.path.isfile(os.path.join(directory, "venv", "pyvenv.cfg")):
        return {"built": False, "reason": "already built"}
    if os.path.realpath(params["venv_path"]) == os.path.realpath(os.path.join(directory, "venv")):
        raise Failure("refusing to rebuild %s: it is the active environment" % directory)
    if os.path.lexists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory, mode=0o755)
    for name, text in params["files"].items():
        with open(os.path.join(directory, name), "w") as handle:
            handle.write(text)
    record = {"id": params["id"], "created": utc_stamp(), "status": "building", "adopted": False,
              "inputs": params["inputs"]}
    write_json(record_path, record)
    log_path = os.path.join(directory, "build.log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            listed = build(params, log)
        except Failure as failure:
            record.update({"status": "failed", "error": str(failure), "failed": utc_stamp()})
            write_json(record_path, record)
            raise Failure("release %s was not built and is not active (%s left for inspection): %s"
                          % (params["id"], directory, failure)) from None
    with open(os.path.join(directory, "lock.txt"), "rb") as handle:
        lock_sha256 = hashlib.sha256(handle.read()).hexdigest()
    record.update({"status": "ok", "python": listed["python"], "packages": listed["packages"],
                   "lock_sha256": lock_sha256, "built": utc_stamp(),
                   "build_seconds": round(time.monotonic() - started, 2)})
    write_json(record_path, record)
    return {"built": True}


# --- activate ----------------------------------------------------------------------------------

def adopt(venv_path, releases_dir, kind, name):
    """Move a hand-made venv (or take over a foreign link) as release `name`, keeping it usable.

    A venv's scripts name venv_path in their shebangs, and renaming a venv breaks them; after the
    move venv_path is a link to the moved tree, so those scripts keep working whenever it is active.
    """
    import shutil
    directory = os.path.join(releases_dir, name)
    listed = env_packages(venv_path)
    os.makedirs(directory, mode=0o755)
    venv = os.path.join(directory, "venv")
    if kind == "venv":
        shutil.move(venv_path, venv)  # a rename on one filesystem; a copy keeping links otherwise
        point_link(venv_path, venv)
    else:
        os.symlink(os.path.realpath(venv_path), venv)
        point_link(venv_path, venv)
    write_json(os.path.join(directory, RECORD), {
        "id": name, "created": utc_stamp(), "status": "ok", "adopted": True, "adopted_from": venv_path,
        "python": listed.get("python"), "packages": listed.get("packages"), "lock_sha256": None})
    return name


def record_activation(state_dir, release, previous, by):
    path = os.path.join(state_dir, HISTORY)
    history = read_json(path, {}) or {}
    history.setdefault("activations", []).append(
        {"release": release, "previous": previous, "by": by, "at": utc_stamp()})
    os.makedirs(state_dir, mode=0o755, exist_ok=True)
    write_json(path, history)


def command_activate(params):
    venv_path, releases_dir, state_dir = params["venv_path"], params["releases_dir"], params["state_dir"]
    release = params["release"]
    target = os.path.join(releases_dir, release, "venv")
    record = read_json(os.path.join(releases_dir, release, RECORD), {}) or {}
    if record.get("status") != "ok" or not os.path.isfile(os.path.join(target, "pyvenv.cfg")):
        raise Failure("release %s is not a complete, checked release (status %s); %s was not changed"
                      % (release, record.get("status", "missing"), venv_path))
    where = venv_path_state(venv_path, releases_dir)
    current = where["release"]  # None for a hand-made venv, a foreign or a broken link
    if where["kind"] == "other":
        raise Failure("%s exists but is not a venv (no pyvenv.cfg); move it away and re-run" % venv_path)
    adopted = None
    if where["kind"] == "venv" or (where["kind"] == "link" and current is None):
        current = adopted = adopt(venv_path, releases_dir, where["kind"], params["adopt_as"])
        record_activation(state_dir, adopted, None, "adopt")
    if current == release:
        return {"switched": False, "adopted": adopted}
    os.makedirs(os.path.dirname(venv_path) or "/", exist_ok=True)
    point_link(venv_path, target)
    record_activation(state_dir, release, current, params["by"])
    return {"switched": True, "previous": current, "adopted": adopted}


def command_record(params):
    """A switch made elsewhere (the service's health gate rolling back); with `only_where_kept`,
    only where the history exists (a host whose venv this tool never activated has none)."""
    if params.get("only_where_kept") and not os.path.isfile(os.path.join(params["state_dir"], HISTORY)):
        return {"recorded": None}
    record_activation(params["state_dir"], params["release"], params["previous"], params["by"])
    return {"recorded": params["release"]}


def command_prune(params):
    import shutil
    releases_dir, removed = params["releases_dir"], []
    active = os.path.realpath(params["venv_path"])
    for release in params["remove"]:
        directory = os.path.join(releases_dir, release)
        if not RELEASE_NAME.match(release) or release in params["protect"]:
            continue
        if active == os.path.realpath(os.path.join(directory, "venv")) or active.startswith(directory + "/"):
            continue
        if os.path.isdir(directory):
            shutil.rmtree(directory)
            removed.append(release)
    return {"removed": removed}


def command_lock(params):
    """A built release's lock as {name: {"version", "hashes"}}, and how it differs from `fixed` (when given)."""
    with open(os.path.join(params["release_dir"], "lock.txt")) as handle:
        entries = parse_lock(handle.read())
    fixed = params.get("fixed")
    return {"packages": lock_packages(entries), "problems": fixed_hash_problems(entries, fixed) if fixed else []}


COMMANDS = {"packages": command_packages, "backup": command_backup, "build": command_build, "lock": command_lock,
            "activate": command_activate, "prune": command_prune, "backups": command_backups,
            "record": command_record}


def main(argv):
    if len(argv) != 3 or argv[1] not in COMMANDS:
        sys.stderr.write("usage: ml_env.py {%s} BASE64_JSON\n" % ",".join(COMMANDS))
        return 2
    params = json.loads(binascii.a2b_base64(argv[2]).decode())
    os.umask(0o022)
    try:
        result = COMMANDS[argv[1]](params)
    except Failure as failure:
        sys.stderr.write("servestack: %s\n" % failure)
        return 1
    write_section("result", json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
