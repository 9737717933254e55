# bench-client.py PARAMS  (`python3 -I -S -c THIS_FILE PARAMS`: operations/speculation.py `client_command`)
#
# The benchmark's client, run ON THE HOST against its own SGLang server over loopback, so the
# network between the controller and the host is not in the numbers. Standard library only.
#
# Input: PARAMS, base64 of a JSON object:
#   url                 the server, from the host itself (http://127.0.0.1:30000)
#   prompt              the fixed prompt
#   max_new_tokens      the fixed output length (sent with temperature 0 and ignore_eos)
#   runs                requests at concurrency 1, one after the other; also rounds per further level
#   warmup              requests sent first and not counted
#   concurrency         levels, e.g. [1, 4, 16]: at level N, `runs` rounds of N requests sent at once
#   request_timeout_s   seconds one request may take
# Each request is POST /generate with "stream": true: the time to its first streamed chunk is the
# time to first token (TTFT). Per request:
#   output_tok_s = completion_tokens / seconds            (the whole request, prefill included:
#                                                          sglang.bench_serving's output throughput)
#   decode_tok_s = completion_tokens / (seconds - ttft)   (sglang.bench_one_batch_server's decode)
# where completion_tokens is the server's own count (meta_info) and seconds the client's wall time.
# A round at level N: the sum of its requests' tokens over the round's wall time.
# After the concurrency-1 runs: GET /server_info, internal_states[0].avg_spec_accept_length (a
# running average since the server started: absent without speculation).
# Output: one JSON object (see `measure`) as the section `result` on stdout (facts/framing.py). Exit: 0;
# 1 with the reason on stderr, and no section, when a request fails or the server answers something unusable.

import base64
import json
import sys
import threading
import time
import urllib.parse
import http.client
from servestack.hostcode import section


class BenchError(Exception):
    pass


def split_url(url):
    parts = urllib.parse.urlsplit(url)
    return parts.hostname, parts.port or 80


def request_body(prompt, max_new_tokens):
    return {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}


def stream_events(response):
    """The JSON objects of a server-sent event stream (`data: {...}` lines), up to `data: [DONE]`."""
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise BenchError(f"the stream sent a line that is not JSON: {data[:200]}")
        if isinstance(event, dict) and event.get("error"):
            raise BenchError(f"the server reported an error: {json.dumps(event['error'])[:300]}")
        yield event


def timed_request(url, body, timeout):
    """One streamed POST /generate: {"seconds", "ttft_s", "completion_tokens", "accept_length"}."""
    host, port = split_url(url)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    payload = json.dumps(body).encode()
    started = time.perf_counter()
    try:
        connection.request("POST", "/generate", body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise BenchError(f"POST /generate answered HTTP {response.status}: "
                             f"{response.read()[:300].decode('utf-8', 'replace')}")
        first = None
        last = None
        for event in stream_events(response):
            if first is None:
                first = time.perf_counter()
            last = event
        finished = time.perf_counter()
    except (OSError, http.client.HTTPException) as error:
        raise BenchError(f"POST /generate to {url} failed: {error}")
    finally:
        connection.close()
    if last is None:
        raise BenchError("POST /generate streamed nothing")
    meta = last.get("meta_info") or {}
    tokens = meta.get("completion_tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        raise BenchError(f"POST /generate finished without a completion_tokens count: {json.dumps(meta)[:300]}")
    return {"seconds": finished - started, "ttft_s": first - started, "completion_tokens": tokens,
            "accept_length": meta.get("spec_accept_length")}


def per_request(sample):
    """A request's rates from its timings (the contract at the top)."""
    seconds, ttft, tokens = sample["seconds"], sample["ttft_s"], sample["completion_tokens"]
    decode = seconds - ttft
    return {"output_tokens": tokens, "seconds": round(seconds, 6), "ttft_s": round(ttft, 6),
            "output_tok_s": tokens / seconds if seconds > 0 else 0.0,
            "decode_tok_s": tokens / decode if decode > 0 else 0.0,
            "accept_length": sample.get("accept_length")}


def stats(values):
    """mean, min and max of a list of numbers (None for an empty list)."""
    values = list(values)
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def round_rate(samples, wall_s):
    """A round's throughput: every request's tokens over the round's wall time."""
    tokens = sum(sample["completion_tokens"] for sample in samples)
    return tokens / wall_s if wall_s > 0 else 0.0


def concurrent_round(url, body, timeout, level):
    """`level` requests sent at once; (their samples, the round's wall time)."""
    samples, errors = [None] * level, []

    def send(index):
        try:
            samples[index] = timed_request(url, body, timeout)
        except BenchError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=send, args=(index,)) for index in range(level)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise BenchError(errors[0])
    return samples, wall


def server_info(url, timeout):
    host, port = split_url(url)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/server_info")
        response = connection.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException) as error:
        raise BenchError(f"GET /server_info from {url} failed: {error}")
    finally:
        connection.close()
    if response.status != 200:
        raise BenchError(f"GET /server_info answered HTTP {response.status}")
    try:
        info = json.loads(data)
    except ValueError:
        raise BenchError("GET /server_info answered something that is not JSON")
    return info if isinstance(info, dict) else {}


def accept_length(info):
    """internal_states[0].avg_spec_accept_length, or None (no speculation, or nothing decoded yet)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        value = states[0].get("avg_spec_accept_length")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def server_facts(info):
    """What the report says about the server: a stand-in's numbers are simulated."""
    args = info.get("server_args") if isinstance(info.get("server_args"), dict) else info
    return {"standin": bool(info.get("servestack_standin")), "version": info.get("version"),
            "speculative_algorithm": args.get("speculative_algorithm"),
            "simulation": info.get("servestack_simulation")}


def measure(params):
    """The whole benchmark of the running server (the contract at the top)."""
    url, timeout = params["url"], params["request_timeout_s"]
    body = request_body(params["prompt"], params["max_new_tokens"])
    for _ in range(params.get("warmup", 0)):
        timed_request(url, body, timeout)
    runs = [per_request(timed_request(url, body, timeout)) for _ in range(params["runs"])]
    info = server_info(url, timeout)
    levels = []
    for level in sorted(set(params.get("concurrency") or [1]) | {1}):
        if level == 1:
            rounds = [run["output_tok_s"] for run in runs]
            per = rounds
        else:
            rounds, per = [], []
            for _ in range(params["runs"]):
                samples, wall = concurrent_round(url, body, timeout, level)
                rounds.append(round_rate(samples, wall))
                per += [per_request(sample)["output_tok_s"] for sample in samples]
        levels.append({"concurrency": level, "rounds": rounds, "tok_s": stats(rounds),
                       "per_request_tok_s": stats(per)["mean"]})
    return {"server": server_facts(info), "accept_length": accept_length(info),
            "runs": runs, "output_tok_s": stats(run["output_tok_s"] for run in runs),
            "decode_tok_s": stats(run["decode_tok_s"] for run in runs),
            "ttft_s": stats(run["ttft_s"] for run in runs), "concurrency": levels}


def main(argv):
    if len(argv) != 2:
        print("usage: bench-client.py PARAMS  (base64 JSON)", file=sys.stderr)
        return 2
    params = json.loads(base64.b64decode(argv[1]))
    try:
        result = measure(params)
    except BenchError as error:
        print(f"servestack: benchmark of {params.get('url')}: {error}", file=sys.stderr)
        return 1
    section("result", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
