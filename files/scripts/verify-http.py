"""verify-http.py BASE REQUEST  (run by the venv's python, else python3: `python -I -c TEXT ...`)

Asks the service at BASE (http://ADDRESS:PORT) for GET /health and, unless REQUEST is `null`, a
real POST /generate with REQUEST (JSON), from the host itself.

Output: the JSON object below as the section `report` (facts/framing.py):
  {"base", "health": status | "health_error",
   "generate_status", "generate_text" | "generate_body" (not JSON) | "generate_error"}
Exit: 0; what failed is in the report.
"""
import json
import sys
import urllib.error
import urllib.request
from servestack.hostcode import section


if len(sys.argv) != 3:
    sys.stderr.write("usage: verify-http.py BASE REQUEST\n")
    sys.exit(2)
BASE, REQUEST = sys.argv[1], json.loads(sys.argv[2])
out = {"base": BASE}


def call(path, body=None, timeout=30):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(BASE + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def generate():
    status, text = call("/generate", REQUEST, timeout=300)
    out["generate_status"] = status
    try:
        reply = json.loads(text)
        reply = reply[0] if isinstance(reply, list) and reply else reply
        out["generate_text"] = reply.get("text") if isinstance(reply, dict) else None
    except ValueError:
        out["generate_body"] = text[:300]


try:
    out["health"], _ = call("/health")
except Exception as exc:
    out["health_error"] = f"{type(exc).__name__}: {exc}"
if REQUEST is not None:
    try:
        generate()
    except Exception as exc:
        out["generate_error"] = f"{type(exc).__name__}: {exc}"
section("report", json.dumps(out))
