"""Stage model weights from the Hugging Face Hub into one directory per repository and revision.

Usage (operations/weights.py sends it: servestack/scripts.py):
    python3 -I -S -c THIS_FILE plan PARAMS        the host's python, standard library only
    <release>/venv/bin/python -I -c THIS_FILE fetch PARAMS    the release's python: its huggingface_hub
PARAMS, a JSON object:
    endpoint    the Hub (HF_ENDPOINT-style: a mirror's base URL)
    models_dir  service_models_dir: the filesystem whose free space `plan` reports
    models      [{"repo": "org/name", "revision": "<40 hex>", "dir": DIR, "record": FILE, "prestaged": bool}, ...]
                (prestaged: DIR is a copy made by someone else, checked and never written into)
No token travels in PARAMS or on the command line: `fetch` runs with HF_TOKEN_PATH naming a root-only
file (operations/weights.py uploads it), which the Hub client reads itself; `plan` sends no token.

plan: asks the Hub for each revision's file list (GET /api/models/REPO/revision/REV?blobs=true, as
  huggingface_hub's `model_info(files_metadata=True)` does) and compares it with DIR (sizes only: no
  file is read). Prints one JSON line: {"models": [{"repo", "revision", "dir", "prestaged", "files",
  "bytes", "missing_files", "missing_bytes", "differs", "problem", "needs_token"}], "free_bytes": N};
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
  Progress: `servestack: ...` lines on stdout. Failure: `servestack: <reason>` on stderr, exit 1.
Exit 2: bad usage.
"""

import hashlib
import json
import os
import sys
import time

SCHEMA = 1
CHUNK = 8 * 1024 * 1024


def say(text):
    sys.stdout.write("servestack: %s\n" % text)
    sys.stdout.flush()


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
    print(json.dumps({"models": models, "free_bytes": free_bytes(params["models_dir"])}))


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


def download(hub, endpoint, model, listed, total):
    """snapshot_download into DIR, then every file checked; one that differs is fetched once more."""
    repo, revision, directory = model["repo"], model["revision"], model["dir"]
    say("model weights %s@%s: %d files, %s, into %s" % (repo, revision[:12], len(listed), human(total), directory))
    os.makedirs(directory, exist_ok=True)
    started = time.time()
    hub.snapshot_download(repo, revision=revision, local_dir=directory, endpoint=endpoint)
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


def main(argv):
    if len(argv) != 2 or argv[0] not in ("plan", "fetch"):
        sys.stderr.write("usage: stage-weights.py plan|fetch PARAMS\n")
        return 2
    params = json.loads(argv[1])
    (plan if argv[0] == "plan" else fetch)(params)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
