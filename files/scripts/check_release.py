"""Checks a freshly built release must pass before it may become active (runs inside its python, with the
environment the service's unit gives it: files/scripts/ml_env.py `check_release`).

argv[1] is a JSON object: {"packages": {name: version}, "lock": {name: version},
"wheels": {name: file name}, "torch_cuda": "13.0", "imports": [module, ...]}; argv[2] is the file the
result is written to, a record an operator can read later: what was checked ("expected", the environment it
ran with), what was found (torch's version and CUDA build, the seconds each import took) and every
problem. Exits 1 if there is any problem, 0 otherwise.
"""

import importlib
import importlib.metadata
import json
import os
import sys
import time
from urllib.parse import unquote


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problems(expected, what):
    problems = []
    for name, version in sorted(expected.items()):
        found = installed(name)
        if found is None:
            problems.append("%s is not installed (%s %s)" % (name, what, version))
        elif found != version:
            problems.append("%s is %s, %s %s" % (name, found, what, version))
    return problems


def wheel_problems(wheels):
    """Each package installed from a direct wheel URL came from that file (direct_url.json names it):
    a file named +cu130 whose METADATA has no label is told apart from PyPI's build this way."""
    problems = []
    for name, file_name in sorted(wheels.items()):
        try:
            recorded = json.loads(importlib.metadata.distribution(name).read_text("direct_url.json") or "{}")
        except (importlib.metadata.PackageNotFoundError, ValueError):
            recorded = {}
        url = recorded.get("url", "")
        if unquote(url.rsplit("/", 1)[-1]) != file_name:
            problems.append("%s was not installed from %s (direct_url.json: %s)" % (name, file_name, url or "none"))
    return problems


def torch_version_matches(found, expected):
    """torch.__version__ against the pin. A pin with a local label ('2.9.1+cu130') must be met exactly; one
    without ('2.11.0', PyPI's build) by the public part only, since real torch reports its build's label
    anyway (PyPI's 2.11.0: torch/version.py says '2.11.0+cu130', shared/notes/real-stack.md) and the
    CUDA build is judged by torch.version.cuda."""
    if "+" in expected:
        return found == expected
    return found.partition("+")[0] == expected


def torch_problems(expected_version, expected_cuda, found):
    started = time.monotonic()
    try:
        import torch
    except Exception as error:  # any import failure is a failed check, reported by name
        return ["import torch failed: %s: %s" % (type(error).__name__, error)]
    found["imports"]["torch"] = round(time.monotonic() - started, 2)
    found["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda}
    problems = []
    if expected_version and not torch_version_matches(torch.__version__, expected_version):
        problems.append("torch.__version__ is %s, expected %s" % (torch.__version__, expected_version))
    if torch.version.cuda != expected_cuda:
        problems.append("torch.version.cuda is %r, expected %r" % (torch.version.cuda, expected_cuda))
    return problems


def import_problems(modules, found):
    """Import each module, in order (one process: what an earlier one imported is not paid for twice)."""
    problems = []
    for module in modules:
        started = time.monotonic()
        try:
            importlib.import_module(module)
        except Exception as error:
            problems.append("import %s failed: %s: %s" % (module, type(error).__name__, error))
            continue
        found["imports"][module] = round(time.monotonic() - started, 2)
    return problems


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: check_release.py EXPECT_JSON RESULT_FILE  (run by the release's python)\n")
        return 2
    expect = json.loads(argv[1])
    started = time.monotonic()
    found = {"python": sys.version.split()[0], "imports": {}, "torch": None}
    problems = version_problems(expect["packages"], "expected")
    problems += version_problems(expect.get("lock", {}), "the lock has")
    problems += wheel_problems(expect.get("wheels", {}))
    problems += torch_problems(expect["packages"].get("torch"), expect["torch_cuda"], found)
    problems += import_problems(expect["imports"], found)
    result = {"ok": not problems, "problems": problems, "expected": expect, "found": found,
              "environment": dict(os.environ), "seconds": round(time.monotonic() - started, 2)}
    with open(argv[2], "w") as handle:  # read once this process has exited (a crash leaves no whole JSON)
        json.dump(result, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return 1 if problems else 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Its result is written: tearing down what torch, flashinfer and sglang built at import proves nothing
    # and costs ~1.8 s of a ~9 s check (real 0.5.14 release with its bytecode, bench/results/*real-release*)
    os._exit(code)
