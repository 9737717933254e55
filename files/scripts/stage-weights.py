"""Stage model weights from the Hugging Face Hub into one directory per repository and revision.

Usage (operations/weights.py sends it: servestack/scripts.py):
    python3 -I -S -c THIS_FILE plan PARAMS        the host's python, standard library only
    <release>/venv/bin/python -I -c THIS_FILE fetch PARAMS    the release's python: its huggingface_hub
    python3 -I -S -c THIS_FILE prune PRUNE_PARAMS  the host's python, standard library only
PARAMS, a JSON object:
    endpoint    the Hub (HF_ENDPOINT-style: a mirror's base URL)
    models_dir  service_models_dir: the filesystem whose free space `plan` reports
    models      [{"repo": "org/name", "revision": "<40 hex>", "dir": DIR, "record": FILE, "prestaged": bool}, ...]
                (prestaged: DIR is a copy made by someone else, checked and never written into)
No token travels in PARAMS or on the command line: `fetch` runs with HF_TOKEN_PATH naming a root-only
file (operations/weights.py uploads it), which the Hub client reads itself; `plan` sends no token.

plan: asks the Hub for each revision's file list (GET /api/models/REPO/revision/REV?blobs=true, as
  huggingface_hub's `model_info(files_metadata=True)` does) and compares it with DIR (sizes only: no
  file is read). Prints one JSON object as the section `plan` (facts/framing.py): {"models": [{"repo",
  "revision", "dir", "prestaged", "files", "bytes", "missing_files", "missing_bytes", "differs", "problem",
  "needs_token"}], "free_bytes": N};
  `differs` says for each missing file why ("absent", "N bytes, the Hub's file has M"). `problem` is the
  Hub's answer when it has no such revision or repository, or will not list it without a token
  (then `needs_token` is true). Exit 0.
fetch: for each model, `snapshot_download(repo_id, revision=REV, local_dir=DIR, endpoint=...)`, the
  client SGLang itself uses: a cut download resumes from its `.incomplete` file on the next call.
  Then every file is checked against the Hub's list: its size, and its content hash (LFS files: the
  Hub's sha256; other files: their git blob id). A file that differs is removed and fetched once
  more; one that still differs fails the step. A pre-staged DIR is not downloaded into: every file
  is checked, and any that differs fails the step naming it (nothing is changed in DIR). Last, the
  record of what was verified is written to FILE.staged: {"schema": 1, "repo", "revision", "dir",
  "prestaged", "files": {name: size}, "bytes", "verified_at"}, never the token. The command that
  runs this (operations/weights.py `fetch_command`) then puts each FILE.staged in place with
  atomic-write.sh, whatever this exits with.
  Progress: `servestack: ...` lines on stdout: what it does, and while a download runs, every
  SS_PROGRESS_EVERY seconds (default 5), a line per file whose bytes moved and one for the revision, each
  with bytes, rate and ETA as the runfile download says them ("downloaded 10.5 MB of 12.6 MB (83%),
  1.0 MB/s, ETA 2 s"); a resumed download says where it resumes.
  Failure: `servestack: <reason>` on stderr, exit 1.
prune: PRUNE_PARAMS {"remove": [DIR, ...], "units": [UNIT FILE, ...]}: removes each revision directory
  of `remove` (the weights step chose them: operations/weights.py `prune_models`), its record first, but
  one that a unit file of `units` serves as it is now (--model-path, --speculative-draft-model-path: the
  service step ran before). Says on stdout what it removed or kept. Exit 0; 1 when a removal fails.
Exit 2: bad usage.
"""

import hashlib
import json
import os
import shlex
import shutil
import sys
import threading
import time
from servestack.hostcode import section

SCHEMA = 1
CHUNK = 8 * 1024 * 1024
_SAYING = threading.Lock()   # the progress thread and the download both say things


def say(text):
    """A line for the operator on stdout, unless the run that started this is gone (its connection closed):
    then the download goes on without it (files/scripts/busy.sh), writing to /dev/null from here on."""
    with _SAYING:
        try:
            sys.stdout.write("servestack: %s\n" % text)
            sys.stdout.flush()
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def fail(text):
    sys.stderr.write("servestack: %s\n" % text)
    sys.exit(1)


def human(size):
    for unit, scale in (("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if size >= scale:
            return "%.1f %s" % (size / scale, unit)
    return "%d B" % size


def quoted(text):
    from urllib.parse import quote
    return quote(text, safe="")


# --- plan: the standard library only ------------------------------------------------------------------

def hub_files(endpoint, repo, revision):
    """{name: (size, sha256 or None, blob id)} of a revision, as the Hub lists it; or a problem."""
    import urllib.error
    import urllib.request
    url = "%s/api/models/%s/revision/%s?blobs=true" % (endpoint.rstrip("/"), repo, quoted(revision))
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            info = json.loads(response.read())
    except urllib.error.HTTPError as error:
        code = error.headers.get("X-Error-Code") or ""
        if code == "RevisionNotFound":
            return None, "the Hub has no revision %s of %s (%d %s)" % (revision, repo, error.code, code)
        if code == "GatedRepo" or error.code in (401, 403):
            return None, ("the Hub will not give %s without a token it accepts: a gated or private repository, "
                          "or none by that name (%d %s)" % (repo, error.code, code or "Unauthorized"))
        if code == "RepoNotFound" or error.code == 404:
            return None, "the Hub has no repository %s (%d)" % (repo, error.code)
        return None, "the Hub answered %d for %s" % (error.code, url)
    except (OSError, ValueError) as error:
        return None, "cannot read %s's file list from %s: %s" % (repo, endpoint, error)
    if info.get("sha") != revision:
        return None, "the Hub answered revision %s of %s with commit %s" % (revision, repo, info.get("sha"))
    files = {}
    for sibling in info.get("siblings") or []:
        lfs = sibling.get("lfs") or {}
        files[sibling["rfilename"]] = (sibling.get("size"), lfs.get("sha256"), sibling.get("blobId"))
    return files, None


def local_size(directory, name):
    try:
        return os.stat(os.path.join(directory, name)).st_size
    except OSError:
        return None


def free_bytes(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path.rstrip("/")) or "/"
    stat = os.statvfs(path or "/")
    return stat.f_bavail * stat.f_frsize


def plan(params):
    models = []
    for model in params["models"]:
        files, problem = hub_files(params["endpoint"], model["repo"], model["revision"])
        entry = {"repo": model["repo"], "revision": model["revision"], "dir": model["dir"],
                 "prestaged": bool(model.get("prestaged")), "problem": problem,
                 "needs_token": bool(problem) and "without a token" in problem}
        if files is not None:
            differs = {}
            for name, (size, _sha, _blob) in sorted(files.items()):
                here = local_size(model["dir"], name)
                if here != size:
                    differs[name] = "absent" if here is None else "%d bytes, the Hub's file has %s" % (here, size)
            entry.update(files=len(files), bytes=sum(size or 0 for size, _s, _b in files.values()),
                         missing_files=sorted(differs), differs=differs,
                         missing_bytes=sum(files[name][0] or 0 for name in differs))
        models.append(entry)
    section("plan", json.dumps({"models": models, "free_bytes": free_bytes(params["models_dir"])}))


# --- fetch: the release's huggingface_hub --------------------------------------------------------------

def content_problem(path, size, sha256, blob_id):
    """What differs between a local file and the Hub's size and hash of it (None: nothing)."""
    try:
        actual = os.stat(path).st_size
    except OSError:
        return "missing"
    if size is not None and actual != size:
        return "%d bytes, the Hub's file has %d" % (actual, size)
    digest = hashlib.sha256() if sha256 else hashlib.sha1(b"blob %d\0" % actual)
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(CHUNK), b""):
            digest.update(chunk)
    expected = sha256 or blob_id
    if expected and digest.hexdigest() != expected:
        return "%s %s, the Hub's is %s" % ("sha256" if sha256 else "git blob id", digest.hexdigest(), expected)
    return None


def forget(directory, name):
    """Remove a local file and huggingface_hub's metadata of it (local_dir/.cache/huggingface/download)."""
    for path in (os.path.join(directory, name),
                 os.path.join(directory, ".cache", "huggingface", "download", name + ".metadata")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def stage_record(path, record):
    """The record, beside its place: atomic-write.sh moves it there (servestack/scripts.py, the one way)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".staged", "w") as stream:
        json.dump(record, stream, sort_keys=True)
        stream.write("\n")


def check_prestaged(repo, revision, directory, listed):
    """A copy made by someone else: every file as the Hub lists it, or the step fails naming what differs."""
    differs = []
    for name, sibling in sorted(listed.items()):
        problem = content_problem(os.path.join(directory, name), sibling.size,
                                  sibling.lfs.sha256 if sibling.lfs else None, sibling.blob_id)
        if problem is not None:
            differs.append("%s (%s)" % (name, problem))
    if differs:
        fail("the pre-staged copy %s of %s@%s differs from the Hub's revision (it is left as it is): %s"
             % (directory, repo, revision[:12], "; ".join(differs)))


def fetch_one(hub, endpoint, model):
    repo, revision, directory = model["repo"], model["revision"], model["dir"]
    api = hub.HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except hub.errors.RevisionNotFoundError:
        fail("the Hub (%s) has no revision %s of %s: pin a commit it has" % (endpoint, revision, repo))
    except (hub.errors.GatedRepoError, hub.errors.RepositoryNotFoundError) as error:
        fail("the Hub (%s) will not give %s: %s" % (endpoint, repo, str(error).splitlines()[0]))
    listed = {sibling.rfilename: sibling for sibling in info.siblings or []}
    total = sum(sibling.size or 0 for sibling in listed.values())
    if model.get("prestaged"):
        say("model weights %s@%s: checking the pre-staged copy %s (%d files, %s)" % (repo, revision[:12], directory,
                                                                                     len(listed), human(total)))
        check_prestaged(repo, revision, directory, listed)
    else:
        download(hub, endpoint, model, listed, total)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stage_record(model["record"], {"schema": SCHEMA, "repo": repo, "revision": revision, "dir": directory,
                                   "prestaged": bool(model.get("prestaged")),
                                   "files": {name: sibling.size for name, sibling in sorted(listed.items())},
                                   "bytes": total, "verified_at": stamp})
    say("model weights %s@%s: verified (%d files, %s)" % (repo, revision[:12], len(listed), human(total)))


# --- progress: bytes, rate and ETA, as the runfile download reports them (files/scripts/cuda-runfile.sh) ---------

def on_disk(directory, listed):
    """{name: bytes of it on disk}: a finished file's size, else what its partial download holds. huggingface_hub
    keeps that in DIR/.cache/huggingface/download/[SUBDIR/]<hash>.<etag>.incomplete (0.36.2 and 1.21.0:
    _local_folder.py `incomplete_path`, L87-89 and L92-94), the etag being the Hub's sha256 of an LFS file,
    else its git blob id."""
    partial = {}
    for folder, _dirs, names in os.walk(os.path.join(directory, ".cache", "huggingface", "download")):
        for name in names:
            if name.endswith(".incomplete"):
                try:
                    partial[name.rsplit(".", 2)[-2]] = os.stat(os.path.join(folder, name)).st_size
                except OSError:   # renamed into place meanwhile
                    pass
    have = {}
    for name, sibling in listed.items():
        etag = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id
        size = local_size(directory, name)
        have[name] = size if size is not None and size == sibling.size else partial.get(etag, 0)
    return have


def rate_text(done, size, rate):
    """'downloaded 10.5 MB of 12.6 MB (83%), 1.0 MB/s, ETA 2 s' (cuda-runfile.sh's words)."""
    rate = max(rate, 0)
    eta = "%d s" % ((size - done) / rate) if rate > 0 else "?"
    return "downloaded %s of %s (%d%%), %s/s, ETA %s" % (human(done), human(size), done * 100 // max(size, 1),
                                                         human(int(rate)), eta)


class Progress(threading.Thread):
    """While the download runs, every SS_PROGRESS_EVERY seconds (default 5): a line for each file whose bytes
    moved, then one for the whole revision (bytes, rate, ETA)."""

    def __init__(self, label, directory, listed):
        super().__init__(daemon=True)
        self.label, self.directory, self.listed = label, directory, listed
        self.every = float(os.environ.get("SS_PROGRESS_EVERY") or 5)
        self.done = threading.Event()
        self.last, self.when = on_disk(directory, listed), time.monotonic()

    def run(self):
        total = sum(sibling.size or 0 for sibling in self.listed.values())
        while not self.done.wait(self.every):
            now, when = on_disk(self.directory, self.listed), time.monotonic()
            elapsed = max(when - self.when, 1e-3)
            for name in sorted(now):
                if now[name] != self.last.get(name):
                    say("%s: %s: %s" % (self.label, name, rate_text(now[name], self.listed[name].size or 0,
                                                                    (now[name] - self.last.get(name, 0)) / elapsed)))
            done = sum(now.values())
            say("%s: %s" % (self.label, rate_text(done, total, (done - sum(self.last.values())) / elapsed)))
            self.last, self.when = now, when

    def stop(self):
        self.done.set()
        self.join()


def download(hub, endpoint, model, listed, total):
    """snapshot_download into DIR, then every file checked; one that differs is fetched once more."""
    repo, revision, directory = model["repo"], model["revision"], model["dir"]
    say("model weights %s@%s: %d files, %s, into %s" % (repo, revision[:12], len(listed), human(total), directory))
    os.makedirs(directory, exist_ok=True)
    progress = Progress("model weights %s@%s" % (repo, revision[:12]), directory, listed)
    here = sum(progress.last.values())
    if here:
        say("model weights %s@%s: resuming the download at %s of %s" % (repo, revision[:12], human(here),
                                                                       human(total)))
    started = time.time()
    progress.start()
    try:
        hub.snapshot_download(repo, revision=revision, local_dir=directory, endpoint=endpoint)
    finally:
        progress.stop()
    elapsed = max(time.time() - started, 1e-3)
    say("model weights %s@%s: downloaded in %.0f s" % (repo, revision[:12], elapsed))
    for name, sibling in sorted(listed.items()):
        sha256 = sibling.lfs.sha256 if sibling.lfs else None
        expected = (os.path.join(directory, name), sibling.size, sha256, sibling.blob_id)
        problem = content_problem(*expected)
        if problem is None:
            continue
        say("model weights %s@%s: %s differs from the Hub's (%s): fetching it again" % (repo, revision[:12], name,
                                                                                        problem))
        forget(directory, name)
        hub.hf_hub_download(repo, name, revision=revision, local_dir=directory, endpoint=endpoint)
        problem = content_problem(*expected)
        if problem is not None:
            fail("model weights %s@%s: %s still differs from the Hub's after a second download (%s)"
                 % (repo, revision[:12], name, problem))


def fetch(params):
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import huggingface_hub as hub
        import huggingface_hub.errors  # noqa: F401
    except ImportError as error:
        fail("the release's python has no huggingface_hub (%s)" % error)
    for model in params["models"]:
        try:
            fetch_one(hub, params["endpoint"], model)
        except SystemExit:
            raise
        except Exception as error:   # the client's own words: a cut connection, a full disk, ...
            fail("model weights %s@%s: %s: %s" % (model["repo"], model["revision"][:12], type(error).__name__,
                                                 str(error).splitlines()[0] if str(error) else ""))


# --- prune: the standard library only ----------------------------------------------------------------

MODEL_FLAGS = ("--model-path", "--speculative-draft-model-path")


def unit_model_dirs(path):
    """The directories a unit file's ExecStart serves (--model-path, --speculative-draft-model-path); none
    when there is no such file."""
    try:
        with open(path) as stream:
            text = stream.read().replace("\\\n", " ")   # systemd's continued lines
    except OSError:
        return set()
    named = set()
    for line in text.splitlines():
        if not line.startswith("ExecStart="):
            continue
        try:
            words = shlex.split(line[len("ExecStart="):])
        except ValueError:
            words = line[len("ExecStart="):].split()
        for flag, value in zip(words, words[1:] + [""]):
            name, _, joined = flag.partition("=")
            if flag in MODEL_FLAGS and value:
                named.add(os.path.normpath(value))
            elif name in MODEL_FLAGS and joined:
                named.add(os.path.normpath(joined))
    return named


def tree_bytes(directory):
    total = 0
    for folder, _dirs, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def prune(params):
    """Remove each revision directory of `remove` (its record first: a directory left without one is checked
    again before it is served), but one a unit file of `units` serves now."""
    served = set()
    for unit in params["units"]:
        served |= unit_model_dirs(unit)
    for directory in params["remove"]:
        if os.path.normpath(directory) in served:
            say("model weights %s: kept, a unit of the service serves it" % directory)
            continue
        size = tree_bytes(directory)
        try:
            os.remove(directory + ".verified.json")
        except FileNotFoundError:
            pass
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        say("model weights %s: pruned (%s)" % (directory, human(size)))


def main(argv):
    modes = {"plan": plan, "fetch": fetch, "prune": prune}
    if len(argv) != 2 or argv[0] not in modes:
        sys.stderr.write("usage: stage-weights.py plan|fetch|prune PARAMS\n")
        return 2
    modes[argv[0]](json.loads(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
