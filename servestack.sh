#!/usr/bin/env bash
# servestack's entry point on a control machine (Debian/Ubuntu, as root for the sandbox):
# installs what is missing (Debian packages, uv, the locked .venv), then runs a command.
#
#   ./servestack.sh rehearse          # boot sandbox hosts, dry-run, converge twice, verify
#   ./servestack.sh sandbox ACTION    # the sandbox hosts: up --hosts 3, run, exec, down, status
#   ./servestack.sh test [PYTEST ARGS] # the test suite (unit + integration on sandbox hosts)
#   ./servestack.sh lint              # ruff and mypy (pyproject.toml configures both)
#   ./servestack.sh <any servestack subcommand>   # e.g. doctor inventory.py
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

DEBIAN_PACKAGES=(python3 python3-venv python3-pip debootstrap systemd-container makeself zstd iproute2
                 openssh-client patch curl ca-certificates)

missing_debian_packages() {
    for package in "${DEBIAN_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' || echo "$package"
    done
}

ensure_debian_packages() {
    local missing
    missing=$(missing_debian_packages)
    [ -z "$missing" ] && return
    echo "servestack: installing Debian packages: $(echo $missing)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: recommends pull libnss-mymachines, which edits /etc/nsswitch.conf
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

uv_version() {   # the manifest's uv.version, or a message naming the file and key (exit 2)
    python3 - <<'PY'
import sys, tomllib
path = "files/stack.toml"
try:
    version = tomllib.load(open(path, "rb"))["uv"]["version"]
except (OSError, tomllib.TOMLDecodeError) as error:
    sys.exit(f"servestack: {path}: cannot read the manifest: {error}")
except (KeyError, TypeError):
    sys.exit(f"servestack: {path}: key 'uv.version': expected a version string like '0.13.9' (missing)")
print(version)
PY
}

ensure_venv() {
    local uv=.tools/bin/uv version
    version=$(uv_version) || exit 2
    if ! [ -x "$uv" ] || [ "$("$uv" --version | cut -d' ' -f2)" != "$version" ]; then
        echo "servestack: installing uv $version into .tools/" >&2
        python3 -m venv .tools
        .tools/bin/pip install -q "uv==$version"
    fi
    # the plot extra (matplotlib): `servestack bench --plot`, which the tests draw
    # the interpreter itself, not a launcher on PATH (a pyenv shim would make uv rebuild .venv every call)
    UV_PYTHON_DOWNLOADS=never "$uv" sync -q --locked --extra plot \
        --python "$(python3 -c 'import sys; print(sys.executable)')"
}

# The test suite runs the sandbox hosts' Python here: the stand-in wheels are CPython 3.11 builds (Debian 12's
# python3, which the hosts run) and tests install them, and the real sglang wheels, into venvs made from it.
HOST_PYTHON_VERSION=3.11
test_python_problem() {   # why this machine cannot run the test suite, or nothing
    local python=${SERVESTACK_TEST_HOST_PYTHON:-/usr/bin/python3} found
    found=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || found=none
    [ "$found" = "$HOST_PYTHON_VERSION" ] && return
    echo "servestack: the test suite needs $python to be Python $HOST_PYTHON_VERSION, the sandbox hosts' (Debian 12);" \
         "it is $found here (the stand-in wheels are CPython $HOST_PYTHON_VERSION builds, installed into venvs made from it)"
}

ensure_debian_packages
ensure_venv
case "${1:-}" in
    test) shift
          problem=$(test_python_problem)
          if [ -n "$problem" ]; then echo "$problem" >&2; exit 2; fi
          PATH="$here/.tools/bin:$PATH" exec .venv/bin/python -m pytest "$@" ;;
    lint) status=0
          .venv/bin/ruff check || status=1
          .venv/bin/mypy || status=1
          exit $status ;;
    # the test harness runs from this checkout: it is not in the installed package
    rehearse) exec .venv/bin/python -m sandbox "$@" ;;
    sandbox) shift
             exec .venv/bin/python -m sandbox "$@" ;;
    *) exec .venv/bin/servestack "$@" ;;
esac
