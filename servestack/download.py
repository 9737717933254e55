"""The control machine's copy of the CUDA runfile, for air-gapped fleets (`cuda_runfile_from = "controller"`).

`fetch_runfile(runfile)` downloads the runfile once into a local cache
(`$SERVESTACK_CACHE_DIR`, default `~/.cache/servestack`): HTTP Range resumes a partial download
(`<file>.part`), a rich progress bar shows it, and the file is verified (size, md5 and sha256 in
one pass) before it is used; a file that fails is renamed `*.rejected-<UTC>` and never used.
`upload_to_host(host, local, remote)` sends it to a host over the SSH connection's SFTP channel,
resuming a partial upload; operations/toolkit.py calls it only for hosts lacking a verified copy.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from pyinfra.api.exceptions import PyinfraError
from servestack.hostcode import move_into_place
from servestack.hostrun import utc_stamp
from servestack.manifest import Runfile
from servestack.scripts import script_command

# requests and rich.progress are imported where a runfile is transferred, not with this module: the
# toolkit step imports it to compare a runfile's sums, and a deploy that transfers nothing does not
# load them.
if TYPE_CHECKING:
    from rich.progress import Progress

CHUNK = 1 << 20
ATTEMPTS = 5
TIMEOUT_S = 60


class DownloadError(PyinfraError):
    """The runfile could not be fetched, or what was fetched is not the manifest's file."""


def cache_dir() -> Path:
    """The control machine's download cache (env SERVESTACK_CACHE_DIR, default ~/.cache/servestack)."""
    return Path(os.environ.get("SERVESTACK_CACHE_DIR") or Path.home() / ".cache" / "servestack")


@dataclass(frozen=True)
class Sums:
    size: int
    md5: str
    sha256: str


def file_sums(path: Path, progress: Progress | None = None, label: str = "verify") -> Sums:
    """Size, md5 and sha256 of a file, reading it once."""
    md5, sha256, size = hashlib.md5(), hashlib.sha256(), 0
    task = progress.add_task(label, total=path.stat().st_size) if progress else None
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(CHUNK), b""):
            md5.update(block)
            sha256.update(block)
            size += len(block)
            if progress and task is not None:
                progress.update(task, advance=len(block))
    return Sums(size, md5.hexdigest(), sha256.hexdigest())


def mismatch(runfile: Runfile, sums: Sums) -> str | None:
    """Why these sums are not the runfile's (size first, then md5, then sha256), or None."""
    if sums.size != runfile.size:
        return f"size {sums.size} bytes, expected {runfile.size}"
    if sums.md5 != runfile.md5:
        return f"md5 {sums.md5}, expected {runfile.md5}"
    if sums.sha256 != runfile.sha256:
        return f"sha256 {sums.sha256}, expected {runfile.sha256}"
    return None


def reject(path: Path, reason: str) -> Path:
    """Move a file that failed verification aside (keeping only the newest rejected copy)."""
    for old in path.parent.glob(path.name + ".rejected-*"):
        old.unlink()
    target = path.with_name(f"{path.name}.rejected-{utc_stamp()}")
    path.rename(target)
    return target


def _progress(enabled: bool) -> Progress:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), transient=True, disable=not enabled)


def _stream_http(url: str, part: Path, expected: int, progress: Progress, session) -> None:
    """Append the rest of `url` to `part` (HTTP Range), starting over if the server cannot resume."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with session.get(url, headers=headers, stream=True, timeout=TIMEOUT_S) as response:
        if response.status_code == 416 and have >= expected:
            return
        if response.status_code == 200 and have:
            have = 0                                     # Range ignored: the body is the whole file
        elif response.status_code not in (200, 206):
            raise DownloadError(f"download of {url} failed: HTTP {response.status_code} {response.reason}")
        task = progress.add_task(f"download {posixpath.basename(urlparse(url).path)}", total=expected,
                                 completed=have)
        with open(part, "r+b" if have else "wb") as stream:
            stream.seek(have)
            stream.truncate()
            for block in _arriving(response):
                stream.write(block)
                progress.update(task, advance=len(block))


def _arriving(response):
    """The body as it arrives (read1): when the connection is cut, every byte received is kept."""
    import requests

    raw = response.raw
    while True:
        try:
            block = raw.read1(CHUNK)
        except Exception as error:          # urllib3's IncompleteRead / ProtocolError
            raise requests.ConnectionError(f"connection cut: {error}") from error
        if not block:
            if raw.length_remaining:
                raise requests.ConnectionError(f"connection cut with {raw.length_remaining} bytes missing")
            return
        yield block


def _copy_local(url: str, part: Path, expected: int, progress: Progress) -> None:
    source = Path(unquote(urlparse(url).path))
    if not source.is_file():
        raise DownloadError(f"download of {url} failed: no such file")
    have = part.stat().st_size if part.exists() else 0
    task = progress.add_task(f"copy {source.name}", total=expected, completed=have)
    with open(source, "rb") as reader, open(part, "ab") as writer:
        reader.seek(have)
        for block in iter(lambda: reader.read(CHUNK), b""):
            writer.write(block)
            progress.update(task, advance=len(block))


def _download(runfile: Runfile, part: Path, progress: Progress, session) -> None:
    import requests

    last_error = None
    for attempt in range(1, ATTEMPTS + 1):
        have = part.stat().st_size if part.exists() else 0
        if have >= runfile.size:
            return
        try:
            if runfile.url.startswith("file://"):
                _copy_local(runfile.url, part, runfile.size, progress)
            else:
                _stream_http(runfile.url, part, runfile.size, progress, session)
            last_error = None
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                OSError) as error:
            last_error = error
            time.sleep(min(2 * attempt, 10))
        if not last_error and part.exists() and part.stat().st_size >= runfile.size:
            return
    have = part.stat().st_size if part.exists() else 0
    raise DownloadError(f"download of {runfile.url} stopped at {have} of {runfile.size} bytes after "
                        f"{ATTEMPTS} attempts ({last_error or 'the server sent less than the whole file'}); "
                        f"the partial file {part} is resumed by the next run")


_VERIFIED: dict[tuple, Path] = {}
_LOCK = threading.Lock()


def _stat_key(path: Path) -> tuple:
    stat = path.stat()
    return (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


def fetch_runfile(runfile: Runfile, directory: Path | None = None, *, show_progress: bool = True,
                  session=None) -> Path:
    """A verified local copy of `runfile` in the cache (downloaded or resumed when needed).

    A cached copy is re-verified before it is returned (once per process while it is unchanged).
    Raises DownloadError, after moving a bad file aside, when verification fails.
    """
    import requests

    directory = Path(directory or cache_dir())
    directory.mkdir(parents=True, exist_ok=True)
    final, part = directory / runfile.file, directory / (runfile.file + ".part")
    with _LOCK, _progress(show_progress) as progress:
        if final.exists():
            if _VERIFIED.get(_stat_key(final)) == final:
                return final
            problem = mismatch(runfile, file_sums(final, progress, f"verify cached {runfile.file}"))
            if problem is None:
                _VERIFIED[_stat_key(final)] = final
                return final
            moved = reject(final, problem)
            progress.console.print(f"cached {final} fails verification ({problem}): moved aside to {moved}")
        if part.exists() and part.stat().st_size > runfile.size:
            moved = reject(part, f"larger than the runfile's {runfile.size} bytes")
            progress.console.print(f"partial download {part} is larger than the runfile: moved aside to {moved}")
        _download(runfile, part, progress, session or requests.Session())
        problem = mismatch(runfile, file_sums(part, progress, f"verify {runfile.file}"))
        if problem is not None:
            moved = reject(part, problem)
            raise DownloadError(f"downloaded {runfile.file} from {runfile.url} fails verification ({problem}): "
                                f"moved aside to {moved}, not used")
        move_into_place(str(part), str(final))   # verified: readers see no file or the whole runfile
        _VERIFIED[_stat_key(final)] = final
        return final


def _sftp(host):
    connector = host.connector
    getter = getattr(connector, "get_file_transfer_connection", None)
    if getter is None or getattr(connector, "client", None) is None:
        return None
    client = getter()
    return client if hasattr(client, "open") and hasattr(client, "stat") else None


def upload_to_host(host, local: Path, remote: str, run_remote) -> None:
    """Send `local` to `remote` on the host, resuming a partial `remote`; root-owned at the end.

    Over SSH the bytes go through SFTP as the login user into a staging directory beside
    `remote` (same filesystem), then `run_remote` (with the operation's sudo) renames them into
    place. Other connectors use pyinfra's put_file (no resume).
    """
    sftp = _sftp(host)
    size = local.stat().st_size
    if sftp is None:
        if not host.put_file(str(local), remote):
            raise DownloadError(f"upload of {local} to {host.name}:{remote} failed")
        return
    ok, user, _ = run_remote(host, "id -un", _sudo=False, _su_user=None, _doas=False)
    user = user[0].strip() if ok and user else "root"
    ok, out, err = run_remote(host, script_command("upload-staging.sh", "prepare", remote, user))
    if not ok or not out:
        raise DownloadError(f"cannot prepare the upload of {remote} on {host.name}: {' '.join(err)}")
    staged = out[-1]
    try:
        have = sftp.stat(staged).st_size
    except OSError:
        have = 0
    if have > size:
        have = 0
    with open(local, "rb") as reader, sftp.open(staged, "ab" if have else "wb") as writer:
        writer.set_pipelined(True)
        reader.seek(have)
        for block in iter(lambda: reader.read(CHUNK), b""):
            writer.write(block)
    ok, _, err = run_remote(host, script_command("upload-staging.sh", "place", remote, user, "root:root"))
    if not ok:
        raise DownloadError(f"cannot move the upload into {remote} on {host.name}: {' '.join(err)}")
