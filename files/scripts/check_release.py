"""Checks a freshly built release must pass before it may become active (runs inside its python).

argv[1] is a JSON object: {"packages": {name: version}, "lock": {name: version},
"wheels": {name: file name}, "torch_cuda": "13.0", "imports": [module, ...]}. Prints one
"PROBLEM <text>" line per failed check and exits 1 if there is any; prints "OK" and exits 0 otherwise.
"""

import importlib
import importlib.metadata
import json
import sys
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


def torch_problems(expected_version, expected_cuda):
    try:
        import torch
    except Exception as error:  # any import failure is a failed check, reported by name
        return ["import torch failed: %s: %s" % (type(error).__name__, error)]
    problems = []
    if expected_version and not torch_version_matches(torch.__version__, expected_version):
        problems.append("torch.__version__ is %s, expected %s" % (torch.__version__, expected_version))
    if torch.version.cuda != expected_cuda:
        problems.append("torch.version.cuda is %r, expected %r" % (torch.version.cuda, expected_cuda))
    return problems


def import_problems(modules):
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:
            problems.append("import %s failed: %s: %s" % (module, type(error).__name__, error))
    return problems


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: check_release.py EXPECT_JSON  (run by the release's python)\n")
        return 2
    expect = json.loads(argv[1])
    problems = version_problems(expect["packages"], "expected")
    problems += version_problems(expect.get("lock", {}), "the lock has")
    problems += wheel_problems(expect.get("wheels", {}))
    problems += torch_problems(expect["packages"].get("torch"), expect["torch_cuda"])
    problems += import_problems(expect["imports"])
    for problem in problems:
        print("PROBLEM " + problem)
    if not problems:
        print("OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
