"""STAND-IN for `python -m sglang.launch_server`, for sandbox hosts only; never shipped by the deploy.

Sandbox hosts have no GPU and cannot run SGLang. The lab (servestack.sandbox.lab) puts this file
in /opt/servestack-sandbox-standins on each host, and its host data sets
`service_launch_module = "fake_sglang_server"` and PYTHONPATH, so the unit servestack renders
starts this instead of SGLang (tests may also copy it into a release venv's site-packages). It parses the same arguments the unit
passes (unknown or inconsistent ones make it exit 2, as SGLang's argument parser would) and
serves what the health gate uses: GET /health, GET /health_generate, POST /generate, and
GET /server_info: what it was started with, for tests to check what the unit passed (the parsed
arguments, the command line as given and the SGLANG_* environment).

Behaviour knobs, read from the environment first, then from files in the venv (`sys.prefix`), so
a test can make one release broken without touching the unit:
  FAKE_SGLANG_MODE / <venv>/fake-sglang-mode
      ok (default) | never-healthy (GET /health answers 503 forever) |
      fail-requests (healthy, but POST /generate answers 500) | crash (exits 1 at start)
  FAKE_SGLANG_STARTUP_S / <venv>/fake-sglang-startup-s
      seconds before /health answers 200 (default 0.5), like a model load
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODES = ("ok", "never-healthy", "fail-requests", "crash")
SPECULATIVE_ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN", "STANDALONE")
OWN_DRAFT_ALGORITHMS = ("EAGLE", "NEXTN")  # may draft with the model's own MTP layers: no draft path
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")  # as sglang 0.5.9


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake_sglang_server", description="stand-in for sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    parser.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS)
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int)
    parser.add_argument("--speculative-eagle-topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument("--attention-backend")
    parser.add_argument("--quantization")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    parser.add_argument("--enable-torch-symm-mem", action="store_true")
    parser.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true")
    parser.add_argument("--disable-custom-all-reduce", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    # A few of SGLang's optional flags, so tests can pass service_extra_args.
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--served-model-name")
    parser.add_argument("--log-level")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.speculative_algorithm:
        if not args.speculative_draft_model_path and args.speculative_algorithm not in OWN_DRAFT_ALGORITHMS:
            parser.error(f"--speculative-algorithm {args.speculative_algorithm} needs --speculative-draft-model-path")
        if args.speculative_eagle_topk == 1 and args.speculative_num_draft_tokens != (args.speculative_num_steps or 0) + 1:
            parser.error("--speculative-eagle-topk 1 needs --speculative-num-draft-tokens = --speculative-num-steps + 1")
    return args


def knob(name: str, filename: str, default: str) -> str:
    if name in os.environ:
        return os.environ[name].strip()
    path = Path(sys.prefix) / filename
    return path.read_text().strip() if path.is_file() else default


class Handler(BaseHTTPRequestHandler):
    server: "FakeServer"

    def do_GET(self):
        if self.path in ("/health", "/health_generate"):
            if self.server.healthy():
                self.reply(200, {"status": "ok"})
            else:
                self.reply(503, {"status": "starting" if self.server.mode == "ok" else self.server.mode})
        elif self.path in ("/server_info", "/get_server_info"):
            self.reply(200, {"version": "stand-in", "pid": os.getpid(), "mode": self.server.mode,
                             "server_args": vars(self.server.args), "argv": self.server.argv,
                             "environment": {name: value for name, value in sorted(os.environ.items())
                                             if name.startswith("SGLANG_")}})
        else:
            self.reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if self.path != "/generate":
            self.reply(404, {"error": f"no route {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self.reply(400, {"error": "body is not JSON"})
            return
        if not self.server.healthy():
            self.reply(503, {"error": "server is not ready"})
        elif self.server.mode == "fail-requests":
            self.reply(500, {"error": "stand-in told to fail requests"})
        else:
            tokens = int(request.get("sampling_params", {}).get("max_new_tokens", 8))
            self.reply(200, {"text": " Paris (stand-in)", "meta_info": {"completion_tokens": min(tokens, 3)}})

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # keep the journal to start-up lines
        pass


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, args: argparse.Namespace, mode: str, startup_s: float, argv: list[str] = ()):
        self.args, self.mode, self.argv = args, mode, list(argv)
        self.ready_at = time.monotonic() + startup_s
        super().__init__((args.host, args.port), Handler)

    def healthy(self) -> bool:
        return self.mode not in ("never-healthy",) and time.monotonic() >= self.ready_at


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    mode = knob("FAKE_SGLANG_MODE", "fake-sglang-mode", "ok")
    if mode not in MODES:
        print(f"fake_sglang_server: unknown mode {mode!r}; expected one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if mode == "crash":
        print("fake_sglang_server: told to crash at start", file=sys.stderr, flush=True)
        return 1
    startup_s = float(knob("FAKE_SGLANG_STARTUP_S", "fake-sglang-startup-s", "0.5"))
    server = FakeServer(args, mode, startup_s, argv)
    print(f"fake sglang (stand-in) listening on {args.host}:{args.port}, pid {os.getpid()}, mode {mode}, "
          f"python {sys.executable}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
