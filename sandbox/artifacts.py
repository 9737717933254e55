"""The sandbox's artifact server: serves a directory over HTTP like the mirrors hosts download from.

A threaded stdlib HTTP/1.1 server with what downloads of multi-GB files rely on and what tests
need to break them on purpose:

- `Range: bytes=...` requests answered with 206 and Content-Range (one range; others: 200 full),
  416 past the end; `Accept-Ranges: bytes` on every file;
- faults set at run time, per URL path glob, optionally for a limited number of requests:
  "cut" (send the headers and only `after` bytes of the body, then close the connection),
  "corrupt" (flip `length` bytes from absolute offset `at`, default the middle, same length),
  "status" (answer `status`, e.g. 500, instead of the file). A fault applies to GET and HEAD
  requests alike, and `times` counts both;
- a record of every request to a file (method, path, client, status, range, bytes sent), kept
  up to date while it is answered, to assert for example that no host downloaded a file twice.
  Note that uv reads a wheel's metadata with a Range request before downloading it whole: count
  whole downloads with `counts(status=200)`.

Faults and records are reachable in-process (`ArtifactServer.faults`: add, counts, requests,
reset) and over HTTP on the same port, for tests in another process:
  GET  /__control/requests           -> JSON list of request records
  GET  /__control/counts[?status=N]  -> JSON {path: number of GET requests [answered N]}
  GET  /__control/bytes              -> JSON {path: bytes of the file sent in GET bodies} (a
                                        directory's page counts 0)
  POST /__control/faults  {fault}    -> add a fault, e.g. {"path": GLOB, "kind": "cut",
                                        "after": 1000, "times": 1} (fields of `Fault`; kinds: cut
                                        after N bytes, corrupt, status, slow: `after` bytes/s)
  POST /__control/reset              -> drop all faults and records
  POST /__control/hub  {"gated": [REPO, ...]}  -> the stand-in Hub's gated repositories
Under /hub/ it is the STAND-IN Hugging Face Hub (sandbox/standins/hub.py): the Hub's API for the
generated model repositories, their files with the headers huggingface_hub reads.
(`ArtifactControl` is a client for these.) Run: `python -m sandbox.artifacts --root DIR
--bind 0.0.0.0 --port 8080 --log FILE`.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import re
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from sandbox.standins import hub

CONTROL_PREFIX = "/__control/"
FAULT_KINDS = ("cut", "corrupt", "status", "slow")
CHUNK = 64 * 1024


@dataclass
class Fault:
    """One fault for the URL paths matching `path` (an fnmatch glob); `times` None means every request."""

    path: str
    kind: str
    after: int = 0
    at: int | None = None
    length: int = 16
    status: int = 500
    times: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {FAULT_KINDS}")


@dataclass
class RequestRecord:
    """One answered request."""

    method: str
    path: str
    client: str
    status: int
    range: str | None
    bytes_sent: int
    time: float


class FaultTable:
    """Thread-safe faults and request records shared by the handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._records: list[RequestRecord] = []

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def take(self, path: str) -> Fault | None:
        """The first fault matching `path`, used up by one if it is limited."""
        with self._lock:
            for fault in self._faults:
                if fnmatch.fnmatchcase(path, fault.path):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._faults.remove(fault)
                    return fault
        return None

    def record(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def requests(self) -> list[RequestRecord]:
        """Copies of the records so far (a request being answered shows what was sent so far)."""
        with self._lock:
            return [replace(record) for record in self._records]

    def counts(self, status: int | None = None) -> dict[str, int]:
        """Number of GET requests per path, only those answered `status` if given."""
        counts: dict[str, int] = {}
        for record in self.requests():
            if record.method == "GET" and status in (None, record.status):
                counts[record.path] = counts.get(record.path, 0) + 1
        return counts

    def served_bytes(self) -> dict[str, int]:
        """Bytes of files sent in the bodies of GET requests, per path asked for (a directory's page: 0)."""
        sent: dict[str, int] = {}
        for record in self.requests():
            if record.method == "GET":
                sent[record.path] = sent.get(record.path, 0) + record.bytes_sent
        return sent

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self._records.clear()


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(first, last) byte of a single `bytes=` range; None to serve everything; "unsatisfiable"."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "")
    if not match or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:
        length = int(last)
        return (max(size - length, 0), size - 1) if length and size else "unsatisfiable"
    start = int(first)
    if start >= size:
        return "unsatisfiable"
    end = min(int(last), size - 1) if last else size - 1
    return None if end < start else (start, end)


class ArtifactHandler(SimpleHTTPRequestHandler):
    """Serves files under the server's root with Range support, faults and request records."""

    protocol_version = "HTTP/1.1"
    server: ArtifactHTTPServer
    _record: RequestRecord | None = None

    def parse_request(self) -> bool:
        self._record = None
        return super().parse_request()

    # --- request entry points -------------------------------------------------------------
    def do_GET(self) -> None:
        if self.path.startswith(CONTROL_PREFIX):
            self._control_get()
        else:
            self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_POST(self) -> None:
        if not self.path.startswith(CONTROL_PREFIX):
            self.send_error(HTTPStatus.METHOD_NOT_ALLOWED)
            return
        length = int(self.headers.get("Content-Length") or 0)
        action = self.path[len(CONTROL_PREFIX):]
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if action == "faults":
                self.server.faults.add(Fault(**body))
            elif action == "reset":
                self.server.faults.reset()
            elif action == "hub":
                self.server.hub.gated = set(body.get("gated", ()))
            else:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
        except (TypeError, ValueError) as error:
            self._json({"error": str(error)}, HTTPStatus.BAD_REQUEST)
            return
        self._json({"ok": True})

    # --- serving files --------------------------------------------------------------------
    def _serve(self, head: bool) -> None:
        url_path = unquote(urlsplit(self.path).path)
        record = self._record = RequestRecord(self.command, url_path, self.client_address[0], 0,
                                              self.headers.get("Range"), 0, time.time())
        self.server.faults.record(record)
        fault = self.server.faults.take(url_path)
        if fault and fault.kind == "status":
            self.send_error(fault.status)
            return
        if url_path.startswith(hub.PREFIX + "/"):
            self._serve_hub(url_path[len(hub.PREFIX):], head, fault, record)
            return
        local = Path(self.translate_path(self.path))
        if local.is_file():
            self._serve_file(local, head, fault, record)
        else:
            self._serve_other(head)

    def _serve_hub(self, path: str, head: bool, fault: Fault | None, record: RequestRecord) -> None:
        """The stand-in Hub: its JSON answers, or a repository's file with the Hub's headers."""
        answer = self.server.hub.answer(path, urlsplit(self.path).query, "Authorization" in self.headers)
        if answer.file is not None:
            self._serve_file(answer.file, head, fault, record, answer.headers)
            return
        body = json.dumps(answer.json_body).encode()
        self.send_response(answer.status)
        for name, value in answer.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _serve_other(self, head: bool) -> None:
        """Directories (index.html, redirects, listings) and 404s, as SimpleHTTPRequestHandler does."""
        body = self.send_head()
        if body:
            try:
                if not head:
                    self.copyfile(body, self.wfile)
            finally:
                body.close()

    def _serve_file(self, local: Path, head: bool, fault: Fault | None, record: RequestRecord,
                    headers: dict[str, str] | None = None) -> None:
        size = local.stat().st_size
        wanted = parse_range(self.headers.get("Range"), size)
        if isinstance(wanted, str):  # "unsatisfiable"
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        first, last = wanted or (0, size - 1)
        if wanted:
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        else:
            self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", self.guess_type(str(local)))
        self.send_header("Content-Length", str(last - first + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", self.date_time_string(int(local.stat().st_mtime)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            try:
                self._send_body(local, first, last, size, fault, record)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    def _send_body(self, local: Path, first: int, last: int, size: int, fault: Fault | None,
                   record: RequestRecord) -> None:
        limit = fault.after if fault and fault.kind == "cut" else None
        with open(local, "rb") as stream:
            stream.seek(first)
            offset = first
            while offset <= last:
                chunk = stream.read(min(CHUNK, last - offset + 1))
                if not chunk:  # the file shrank while being sent
                    self.close_connection = True
                    return
                if fault and fault.kind == "corrupt":
                    chunk = _corrupt(chunk, offset, fault, size)
                if limit is not None:
                    chunk = chunk[: max(limit - record.bytes_sent, 0)]
                record.bytes_sent += len(chunk)
                self.wfile.write(chunk)
                offset += len(chunk)
                if fault and fault.kind == "slow":  # `after` bytes per second: a slow mirror
                    time.sleep(len(chunk) / max(fault.after, 1))
                if limit is not None and record.bytes_sent >= limit:
                    self.close_connection = True
                    return

    # --- control endpoint -----------------------------------------------------------------
    def _control_get(self) -> None:
        url = urlsplit(self.path)
        action = url.path[len(CONTROL_PREFIX):]
        if action == "requests":
            self._json([asdict(record) for record in self.server.faults.requests()])
        elif action == "counts":
            status = parse_qs(url.query).get("status")
            self._json(self.server.faults.counts(int(status[0]) if status else None))
        elif action == "bytes":
            self._json(self.server.faults.served_bytes())
        else:
            self.send_error(HTTPStatus.NOT_FOUND)

    def _json(self, value, status: HTTPStatus = HTTPStatus.OK) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # --- bookkeeping ----------------------------------------------------------------------
    def send_response(self, code, message=None) -> None:
        if self._record:
            self._record.status = int(code)
        super().send_response(code, message)

    def log_message(self, format: str, *args) -> None:
        self.server.log(f"{self.client_address[0]} - [{self.log_date_time_string()}] {format % args}")


def _corrupt(chunk: bytes, offset: int, fault: Fault, size: int) -> bytes:
    """`chunk` (starting at absolute `offset`) with the fault's byte span inverted."""
    start = size // 2 if fault.at is None else fault.at
    low, high = max(start, offset), min(start + fault.length, offset + len(chunk))
    if low >= high:
        return chunk
    data = bytearray(chunk)
    for position in range(low - offset, high - offset):
        data[position] ^= 0xFF
    return bytes(data)


class ArtifactHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the root, the fault table and the log file."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], root: Path, log_path: Path | None = None):
        self.root = Path(root)
        self.faults = FaultTable()
        self._hub_dir = tempfile.mkdtemp(prefix="standin-hub-")
        self.hub = hub.HubStandin(Path(self._hub_dir))
        self._log_path = log_path
        self._log_lock = threading.Lock()
        super().__init__(address, functools.partial(ArtifactHandler, directory=str(self.root)))

    def server_close(self) -> None:
        super().server_close()
        shutil.rmtree(self._hub_dir, ignore_errors=True)

    def log(self, line: str) -> None:
        if self._log_path is None:
            return
        with self._log_lock, open(self._log_path, "a") as log:
            log.write(line + "\n")


class ArtifactServer:
    """An artifact server on a background thread: `with ArtifactServer(root) as server: server.url`."""

    def __init__(self, root: Path, bind: str = "127.0.0.1", port: int = 0, log_path: Path | None = None):
        self.httpd = ArtifactHTTPServer((bind, port), root, log_path)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="artifact-server",
                                        daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = str(self.httpd.server_address[0])  # an IPv4 server: a str (typeshed allows bytes)
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    @property
    def faults(self) -> FaultTable:
        return self.httpd.faults

    def start(self) -> ArtifactServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()

    def __enter__(self) -> ArtifactServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ArtifactControl:
    """Client of a running server's /__control/ endpoint (for tests in another process)."""

    def __init__(self, base_url: str, timeout: float = 10.0):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def _call(self, action: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}{CONTROL_PREFIX}{action}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def add_fault(self, path: str, kind: str, **params) -> None:
        self._call("faults", {"path": path, "kind": kind, **params})

    def reset(self) -> None:
        self._call("reset", {})

    def gate(self, repos: list[str]) -> None:
        """Make the stand-in Hub's `repos` gated (401 GatedRepo without a token)."""
        self._call("hub", {"gated": list(repos)})

    def counts(self, status: int | None = None) -> dict[str, int]:
        return self._call("counts" if status is None else f"counts?status={status}")

    def requests(self) -> list[dict]:
        return self._call("requests")

    def served_bytes(self) -> dict[str, int]:
        return self._call("bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a directory for sandbox hosts (Range, faults, records).")
    parser.add_argument("--root", required=True, type=Path, help="directory to serve")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", default=8080, type=int, help="port to listen on (0: any free port)")
    parser.add_argument("--log", type=Path, help="append one line per request to this file")
    args = parser.parse_args(argv)
    httpd = ArtifactHTTPServer((args.bind, args.port), args.root, args.log)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown).start())
    print(f"serving {args.root} on http://{args.bind}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    main()
