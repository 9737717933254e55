"""verify-python.py NAMES  (run by the active venv's python: `python -I -c TEXT NAMES`)

What the release checks (servestack/checks/release.py) judge, as seen from inside the venv:
the installed version of each package NAMES lists (a JSON list), torch's CUDA build and its view
of the GPUs (a small sum and matmul on every device), and SGLang's is_sm120_supported().

Output: the JSON object below as the section `report` (facts/framing.py; anything printed
before it is noise: warnings):
  {"executable", "prefix", "packages": {name: version or null},
   "torch": {"version", "cuda", "available", "unavailable_reason" (when not available), "count", "names",
             "capabilities", "ops"} | "torch_error",
   "sm120": bool | "sm120_error"}
Exit: 0; what failed is in the report.
"""
import importlib.metadata as metadata
import json
import os
import sys
import warnings
from servestack.hostcode import section


if len(sys.argv) != 2:
    sys.stderr.write("usage: verify-python.py NAMES\n")
    sys.exit(2)
NAMES = json.loads(sys.argv[1])
out = {"executable": sys.executable, "prefix": sys.prefix, "packages": {}}
for name in NAMES:
    try:
        out["packages"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["packages"][name] = None


def error(exc):
    return f"{type(exc).__name__}: {exc}"


def device_ops(torch, count):
    ops = []
    for i in range(count):
        try:
            x = torch.arange(1024, device=f"cuda:{i}", dtype=torch.float32)
            a = torch.ones(64, 64, device=f"cuda:{i}")
            ops.append({"device": i, "sum": float((x * 2).sum().item()), "matmul": float((a @ a).sum().item())})
        except Exception as exc:
            ops.append({"device": i, "error": error(exc)})
    return ops


try:
    import torch
    with warnings.catch_warnings(record=True) as caught:   # torch says why it sees no GPU as a warning
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    info = {"version": torch.__version__, "cuda": torch.version.cuda, "available": available}
    if not available:   # torch warns without a driver; a hidden GPU it does not explain (seen on an H200)
        reasons = [str(warning.message) for warning in caught]
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            reasons.append("CUDA_VISIBLE_DEVICES=%r" % os.environ["CUDA_VISIBLE_DEVICES"])
        info["unavailable_reason"] = "; ".join(reasons) or None
    if info["available"]:
        count = torch.cuda.device_count()
        info["count"] = count
        info["names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        info["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(count)]
        info["ops"] = device_ops(torch, count)
    out["torch"] = info
except Exception as exc:
    out["torch_error"] = error(exc)
try:
    try:
        from sglang.srt.utils.common import is_sm120_supported
    except ImportError:
        from sglang.srt.utils import is_sm120_supported
    out["sm120"] = bool(is_sm120_supported())
except Exception as exc:
    out["sm120_error"] = error(exc)
section("report", json.dumps(out))
