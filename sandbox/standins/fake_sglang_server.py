"""STAND-IN for `python -m sglang.launch_server`, for sandbox hosts only; never shipped by the deploy.

Sandbox hosts have no GPU and cannot run SGLang. The lab (sandbox.lab) puts this file
in /opt/servestack-sandbox-standins on each host, and its host data sets
`service_launch_module = "fake_sglang_server"` and PYTHONPATH, so the unit servestack renders
starts this instead of SGLang (tests may also copy it into a release venv's site-packages). It parses
the same arguments the unit passes (unknown or inconsistent ones make it exit 2, as SGLang's argument parser would) and
serves what the health gate uses: GET /health, GET /health_generate, POST /generate, and
GET /server_info: what it was started with, for tests to check what the unit passed (the parsed
arguments, the command line as given and the SGLANG_* environment).

Behaviour knobs, read from the environment first, then from files in the venv (`sys.prefix`), so
a test can make one release broken without touching the unit:
  FAKE_SGLANG_MODE / <venv>/fake-sglang-mode
      ok (default) | never-healthy (GET /health answers 503 forever) |
      fail-requests (healthy, but POST /generate answers 500) | crash (exits 1 at start)
  FAKE_SGLANG_MODE_BASELINE / <venv>/fake-sglang-mode-baseline
      the mode when started WITHOUT speculative flags (default: the mode above), so a test can make
      the baseline configuration of `servestack bench` fail while the profile as written works
  FAKE_SGLANG_STARTUP_S / <venv>/fake-sglang-startup-s
      seconds before /health answers 200 (default 0.5), like a model load
  FAKE_SGLANG_HOLD_FILE / <venv>/fake-sglang-hold-file
      a path: while a file is there, GET /health answers 503 even after the start-up time, so a
      test decides when the load ends (a health gate waits for it meanwhile) instead of racing a clock
  FAKE_SGLANG_THROUGHPUT / <venv>/fake-sglang-throughput
      the simulated decoding speed (`Throughput.parse`): a preset, `win` (default: speculation faster at
      every load), `lose` (speculation slower), `crossover=N` (faster below N concurrent requests,
      as fast at N, slower above) or `reference` (the reference upgrade's 92.6 / 96.1 tok/s), then optional
      `key=value` overrides, comma separated: baseline=TOK_S,speculation=TOK_S,accept=LEN,ttft=S,
      load=F,jitter=F,seed=N (e.g. `lose,baseline=90,speculation=70`)

Throughput simulation. POST /generate takes the time the simulated server would: a time to first
token, then each token (baseline) or each accepted run of tokens (speculation: `accept` tokens per
step on average) at a per-request rate that falls with the number of requests in flight,
rate / (1 + load_factor * (in flight - 1)); speculation's load factor is steeper, so that its
advantage ends at the crossover. Each chunk is due at the request's arrival plus the simulated time so
far, and the server sleeps until then: on a loaded machine a late wake-up delays that chunk, not
every chunk after it, so a request takes its simulated time plus about one wake-up's delay (never
less), whatever the number of chunks. `"stream": true` streams server-sent events as SGLang does
(`data: {...}` with the text and meta_info so far, then `data: [DONE]`); `ignore_eos` decodes
exactly max_new_tokens tokens (otherwise at most 3, the stand-in's short answer). /server_info says
`"servestack_standin": true` and the simulation's numbers, and reports the running average accept
length in internal_states[0].avg_spec_accept_length like SGLang (only with speculation). Every
number it produces is SIMULATED.

Adaptive speculation (`--speculative-adaptive [--speculative-adaptive-config FILE]`, sglang 0.5.14):
the config is read and checked as SGLang reads it at start-up (`load_adaptive_config`: a bad file
or a bad candidate_steps list, or --speculative-num-steps among none of the config's steps, is a
ValueError: exit 1 with its traceback, as an uncaught exception in SGLang's prepare_server_args),
and where SGLang would not run it (not EAGLE/EAGLE3/NEXTN, topk != 1) it warns and runs static
speculation as SGLang does. Simulated: each decoding step speculates unless the slot of the requests
in flight (the largest configured batch size <= in flight; SGLang also pads to its CUDA-graph sizes,
which the stand-in has none of) has candidate steps [0] only; the slots' step choice by acceptance
and the cost of switching are not simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

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
    parser.add_argument("--speculative-adaptive", action="store_true")
    parser.add_argument("--speculative-adaptive-config")
    parser.add_argument("--attention-backend")
    parser.add_argument("--quantization")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    parser.add_argument("--trust-remote-code", action="store_true")
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
            parser.error(f"--speculative-algorithm {args.speculative_algorithm} "
                         "needs --speculative-draft-model-path")
        steps = args.speculative_num_steps or 0
        if args.speculative_eagle_topk == 1 and args.speculative_num_draft_tokens != steps + 1:
            parser.error("--speculative-eagle-topk 1 needs "
                         "--speculative-num-draft-tokens = --speculative-num-steps + 1")
    return args


# sglang 0.5.14 srt/speculative/adaptive_spec_params.py: DEFAULT_ADAPTIVE_CONFIG (L22-47), candidate steps only
SGLANG_DEFAULT_SLOTS = {1: [1, 3, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]}
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")   # NEXTN is renamed EAGLE before the check


def load_adaptive_config(path: str | None) -> dict[int, list[int]]:
    """Each slot's candidate steps by batch size, read and checked as sglang 0.5.14's
    `_load_adaptive_config` (L88-121): keys that are not digits are ignored; ValueError otherwise."""
    if path is None:
        return dict(SGLANG_DEFAULT_SLOTS)
    with open(path) as handle:
        config = json.load(handle)
    slots = {}
    for key, entry in config.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps")
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise ValueError(f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
        slots[int(key)] = sorted(set(steps))
    if not slots:
        raise ValueError("speculative_adaptive_config must contain at least one integer-string BS key, e.g. "
                         f'{{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(config.keys())}')
    return slots


def adaptive_slots(args: argparse.Namespace) -> dict[int, list[int]] | None:
    """The adaptive slots the server runs with (None: static speculation, or none); raises as SGLang does."""
    if not (args.speculative_adaptive and args.speculative_algorithm):
        return None
    if args.speculative_algorithm not in ADAPTIVE_ALGORITHMS or (args.speculative_eagle_topk or 1) != 1:
        print(f"speculative_adaptive disabled: speculative_algorithm={args.speculative_algorithm}, "
              f"speculative_eagle_topk={args.speculative_eagle_topk}. Falling back to static speculative params.",
              file=sys.stderr, flush=True)
        return None
    slots = load_adaptive_config(args.speculative_adaptive_config)
    union = sorted({step for steps in slots.values() for step in steps})
    if args.speculative_num_steps is not None and args.speculative_num_steps not in union:
        raise ValueError(f"--speculative-num-steps={args.speculative_num_steps} is not in the adaptive config "
                         f"candidate_steps {union}. Pass one of those values.")
    return slots


def knob(name: str, filename: str, default: str) -> str:
    if name in os.environ:
        return os.environ[name].strip()
    path = Path(sys.prefix) / filename
    return path.read_text().strip() if path.is_file() else default


@dataclass(frozen=True)
class Throughput:
    """The simulated server's speed: single-request decode rates (tok/s) without and with
    speculation, the mean accept length, the time to first token, how each rate falls with load,
    and the run-to-run jitter (a fraction, from a seeded generator: the same sequence every start of a
    configuration)."""

    baseline: float = 90.0
    speculation: float = 110.0
    accept: float = 2.6
    ttft: float = 0.05
    load: float = 0.04
    crossover: int | None = None
    jitter: float = 0.04
    seed: int = 17

    PRESETS = {"win": {}, "lose": {"speculation": 72.0, "accept": 1.4},
               "reference": {"baseline": 92.6, "speculation": 96.1, "accept": 2.1, "jitter": 0.08}}
    FIELDS = {"baseline": float, "speculation": float, "accept": float, "ttft": float, "load": float,
              "crossover": int, "jitter": float, "seed": int}

    @classmethod
    def parse(cls, text: str) -> "Throughput":
        """`win`, `lose`, `crossover=8`, `reference`, then `key=value` overrides (comma separated)."""
        values: dict = {}
        for index, item in enumerate(part.strip() for part in text.replace(" ", ",").split(",")):
            if not item:
                continue
            name, _, value = item.partition("=")
            if not value and index == 0 and name in cls.PRESETS:
                values.update(cls.PRESETS[name])
            elif value and name in cls.FIELDS:
                values[name] = cls.FIELDS[name](value)
            else:
                raise ValueError(f"unknown throughput setting {item!r}; expected a preset "
                                 f"({', '.join(cls.PRESETS)}) then key=value of {', '.join(cls.FIELDS)}")
        made = cls(**values)
        if made.crossover is not None and made.crossover < 2:
            raise ValueError("crossover must be 2 or more concurrent requests")
        if min(made.baseline, made.speculation, made.accept) <= 0:
            raise ValueError("rates and the accept length must be positive")
        return made

    def load_factor(self, speculative: bool) -> float:
        """How fast the per-request rate falls per extra request in flight. With a crossover at N,
        speculation's factor makes both rates equal at N in flight."""
        if not speculative or self.crossover is None:
            return self.load
        n = self.crossover
        return ((self.speculation / self.baseline) * (1 + self.load * (n - 1)) - 1) / (n - 1)

    def rate(self, speculative: bool, in_flight: int) -> float:
        """A request's decode rate (tok/s) with `in_flight` requests decoding at once."""
        single = self.speculation if speculative else self.baseline
        return single / (1 + self.load_factor(speculative) * (max(1, in_flight) - 1))

    def describe(self, speculative: bool) -> dict:
        return {"preset_rates_tok_s": {"baseline": self.baseline, "speculation": self.speculation},
                "this_server": "speculation" if speculative else "baseline", "accept_length": self.accept,
                "ttft_s": self.ttft, "load_factor": self.load_factor(speculative), "crossover": self.crossover,
                "jitter": self.jitter}


class Decoder:
    """The simulated decoding of one server: requests in flight, the accept length's running
    average (accepted tokens over verify steps since start, as SGLang counts it)."""

    def __init__(self, throughput: Throughput, speculative: bool, slots: dict[int, list[int]] | None = None):
        self.throughput, self.speculative, self.slots = throughput, speculative, slots
        self.lock = threading.Lock()
        self.in_flight = 0
        self.accepted = 0
        self.steps = 0
        self.random = random.Random(throughput.seed + speculative)   # each configuration its own jitter

    def average_accept_length(self) -> float | None:
        with self.lock:
            return self.accepted / self.steps if self.speculative and self.steps else None

    def speculating(self, in_flight: int) -> bool:
        """Whether a decoding step with `in_flight` requests speculates: always with static speculation;
        adaptive: unless the slot of that batch size (the largest configured <= it) has only step 0."""
        if not self.speculative or self.slots is None:
            return self.speculative
        sizes = sorted(self.slots)
        slot = max([size for size in sizes if size <= in_flight] or sizes[:1])
        return self.slots[slot] != [0]

    def chunks(self, tokens: int):
        """Yield (seconds to wait, tokens in the chunk) for one request of `tokens` output tokens."""
        with self.lock:
            self.in_flight += 1
            factor = 1 + self.throughput.jitter * (2 * self.random.random() - 1)
        try:
            yield self.throughput.ttft, 1
            done, credit = 1, 0.0
            while done < tokens:
                with self.lock:
                    speculating = self.speculating(self.in_flight)
                if speculating:
                    credit += self.throughput.accept
                    step = max(1, min(int(credit), tokens - done))
                    credit -= step
                else:
                    step = 1
                with self.lock:
                    rate = self.throughput.rate(speculating, self.in_flight) * factor
                    if speculating:
                        self.accepted += step
                        self.steps += 1
                done += step
                yield step / rate, step
        finally:
            with self.lock:
                self.in_flight -= 1


class Handler(BaseHTTPRequestHandler):
    server: "FakeServer"

    def do_GET(self):
        if self.path in ("/health", "/health_generate"):
            if self.server.healthy():
                self.server.note_ready()
                self.reply(200, {"status": "ok"})
            else:
                self.reply(503, {"status": "starting" if self.server.mode == "ok" else self.server.mode})
        elif self.path in ("/server_info", "/get_server_info"):
            decoder = self.server.decoder
            state = {"avg_spec_accept_length": decoder.average_accept_length()} \
                if decoder.average_accept_length() is not None else {}
            self.reply(200, {"version": "stand-in", "pid": os.getpid(), "mode": self.server.mode,
                             "servestack_standin": True,
                             "servestack_simulation": {**decoder.throughput.describe(decoder.speculative),
                                                       "adaptive_slots": decoder.slots},
                             "server_args": vars(self.server.args), "argv": self.server.argv,
                             "internal_states": [state],
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
            self.generate(request)

    def generate(self, request: dict) -> None:
        sampling = request.get("sampling_params") or {}
        wanted = int(sampling.get("max_new_tokens", 8))
        tokens = max(1, wanted if sampling.get("ignore_eos") else min(wanted, 3))
        prompt_tokens = len(str(request.get("text", "")).split())
        started, done, steps = time.monotonic(), 0, 0
        if request.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
        due = started
        for wait, step in self.server.decoder.chunks(tokens):
            due += wait
            time.sleep(max(0.0, due - time.monotonic()))
            done, steps = done + step, steps + 1
            if request.get("stream"):
                self.event(_output(done, tokens, prompt_tokens, steps, started, self.server.decoder))
        answer = _output(done, tokens, prompt_tokens, steps, started, self.server.decoder)
        if request.get("stream"):
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        else:
            self.reply(200, answer)

    def event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # keep the journal to start-up lines
        pass


def _output(done: int, tokens: int, prompt_tokens: int, steps: int, started: float, decoder: Decoder) -> dict:
    """The answer so far, shaped like SGLang's (text, meta_info with its own token counts)."""
    meta: dict[str, object] = {"prompt_tokens": prompt_tokens, "completion_tokens": done}
    if done >= tokens:
        meta["e2e_latency"] = time.monotonic() - started
        meta["finish_reason"] = {"type": "length", "length": tokens}
    if decoder.speculative and steps:
        meta["spec_accept_length"] = done / steps
    text = " Paris (stand-in)" if tokens <= 3 else " tok" * done
    return {"text": text, "meta_info": meta}


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024   # listen backlog: a benchmark round opens its connections at once (SGLang's: 2048)

    def __init__(self, args: argparse.Namespace, mode: str, startup_s: float, argv: Sequence[str] = (),
                 throughput: Throughput | None = None, hold_file: str = "", slots: dict[int, list[int]] | None = None):
        self.args, self.mode, self.argv, self.hold_file = args, mode, list(argv), hold_file
        self.ready_at = time.monotonic() + startup_s
        self.ready_noted, self.ready_lock = False, threading.Lock()
        self.decoder = Decoder(throughput or Throughput(), bool(args.speculative_algorithm), slots)
        super().__init__((args.host, args.port), Handler)

    def note_ready(self) -> None:
        """Say once, in the journal, when /health first answered 200, on CLOCK_MONOTONIC (systemd's
        *TimestampMonotonic clock): when a test's clients could count on this server again."""
        with self.ready_lock:
            first, self.ready_noted = not self.ready_noted, True
        if first:
            print(f"fake sglang (stand-in) ready: first /health 200 at monotonic {time.monotonic():.6f}", flush=True)

    def healthy(self) -> bool:
        held = bool(self.hold_file) and os.path.lexists(self.hold_file)
        return self.mode not in ("never-healthy",) and time.monotonic() >= self.ready_at and not held


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    slots = adaptive_slots(args)   # a bad config raises, as SGLang's start-up does (exit 1, a traceback)
    mode = knob("FAKE_SGLANG_MODE", "fake-sglang-mode", "ok")
    if not args.speculative_algorithm:
        mode = knob("FAKE_SGLANG_MODE_BASELINE", "fake-sglang-mode-baseline", mode)
    try:
        throughput = Throughput.parse(knob("FAKE_SGLANG_THROUGHPUT", "fake-sglang-throughput", "win"))
    except ValueError as error:
        print(f"fake_sglang_server: {error}", file=sys.stderr)
        return 2
    if mode not in MODES:
        print(f"fake_sglang_server: unknown mode {mode!r}; expected one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if mode == "crash":
        print("fake_sglang_server: told to crash at start", file=sys.stderr, flush=True)
        return 1
    startup_s = float(knob("FAKE_SGLANG_STARTUP_S", "fake-sglang-startup-s", "0.5"))
    hold_file = knob("FAKE_SGLANG_HOLD_FILE", "fake-sglang-hold-file", "")
    server = FakeServer(args, mode, startup_s, argv, throughput, hold_file, slots)
    print(f"fake sglang (stand-in) listening on {args.host}:{args.port}, pid {os.getpid()}, mode {mode}, "
          f"python {sys.executable}, simulated throughput {throughput}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
