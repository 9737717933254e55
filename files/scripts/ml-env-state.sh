# ml-env-state.sh PYTHON VENV_PATH RELEASES_DIR STATE_DIR
#
# What the MlEnvState fact (facts/venv.py) reads of the host's ML environment, as raw records:
# the fact's `process` turns them into its value on the controller. Reads only. It runs on every
# converge, twice: it starts no Python beyond `PYTHON -V` and as few programs as it can (builtins).
#
# Arguments:
#   PYTHON        the interpreter servestack builds with (venv_python), a name on PATH or a path
#   VENV_PATH     the stable venv path (/opt/ml-env): a link to the active release's venv
#   RELEASES_DIR  where releases are kept: <RELEASES_DIR>/<id>/release.json and .../venv
#   STATE_DIR     servestack's state directory: releases.json (the activations), backups/
#
# Output: nothing at all when PYTHON is not on PATH. Otherwise sections (facts/framing.py):
#   python         `Python X.Y.Z` (PYTHON -V), then PYTHON's path (command -v)
#   machine        uname -m
#   venv_path      `kind link|directory|venv|other|missing`; unless missing `realpath PATH`
#                  (readlink -m) and `pyvenv yes|no` (pyvenv.cfg beside the resolved path); a link
#                  also `target TARGET` (readlink)
#   release ID     one per directory of RELEASES_DIR named as a release is (r-<12 hex>,
#                  adopted-<UTC stamp>): `venv yes|no` (its venv has pyvenv.cfg), then its
#                  release.json on one line (nothing when it has none)
#   history        STATE_DIR/releases.json on one line (nothing when absent)
#   backups        the snapshots' file names in STATE_DIR/backups (<UTC stamp>[-N].json), sorted
#   latest_backup  the last of them, on one line (no section when there is none)
# Exit: 0; 2 without its four arguments (a usage line on stderr).
set -u
export LC_ALL=C    # globs sort bytewise, as Python's sorted() does

source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='ml-env-state.sh PYTHON VENV_PATH RELEASES_DIR STATE_DIR'
need_arguments 4 "$@"
PYTHON=$1 VENV_PATH=$2 RELEASES_DIR=$3 STATE_DIR=$4
RELEASE_NAME='^(r-[0-9a-f]{12}|adopted-[0-9]{8}T[0-9]{6}Z)$'
BACKUP_NAME='^[0-9]{8}T[0-9]{6}Z(-[0-9]+)?\.json$'

command -v "$PYTHON" >/dev/null 2>&1 || exit 0

python_identity() { "$PYTHON" -V 2>&1; command -v "$PYTHON"; }

# A JSON file's text on one line (its line breaks are only whitespace between JSON tokens).
# Nothing when it is not a file.
print_json() { if [ -f "$1" ]; then join_lines "$1"; printf '%s\n' "$joined"; fi; }

venv_path() {
    local kind real
    if [ -L "$VENV_PATH" ]; then kind=link
    elif [ -d "$VENV_PATH" ]; then kind=directory
    elif [ -e "$VENV_PATH" ]; then kind=other
    else echo "kind missing"; return; fi
    echo "kind $kind"
    if [ "$kind" = link ]; then printf 'target %s\n' "$(readlink -- "$VENV_PATH")"; fi
    # where it resolves: `cd -P` (a builtin) for a directory, readlink -m otherwise
    if [ -d "$VENV_PATH" ] && cd -P -- "$VENV_PATH" 2>/dev/null; then real=$PWD; cd -- "$OLDPWD" || return
    else real=$(readlink -m -- "$VENV_PATH"); fi
    printf 'realpath %s\n' "$real"
    if [ -f "$real/pyvenv.cfg" ]; then echo "pyvenv yes"; else echo "pyvenv no"; fi
}

release() {
    if [ -f "$1/venv/pyvenv.cfg" ]; then echo "venv yes"; else echo "venv no"; fi
    print_json "$1/release.json"
}

print_lines() { if [ $# -gt 0 ]; then printf '%s\n' "$@"; fi; }

section python python_identity
section machine uname -m
section venv_path venv_path
for directory in "$RELEASES_DIR"/*; do
    name=${directory##*/}
    if [[ $name =~ $RELEASE_NAME ]] && [ -d "$directory" ]; then section "release $name" release "$directory"; fi
done
section history print_json "$STATE_DIR/releases.json"
backups=()
for file in "$STATE_DIR"/backups/*.json; do
    name=${file##*/}
    if [[ $name =~ $BACKUP_NAME ]]; then backups+=("$name"); fi
done
section backups print_lines ${backups[@]+"${backups[@]}"}
if [ ${#backups[@]} -gt 0 ]; then section latest_backup print_json "$STATE_DIR/backups/${backups[-1]}"; fi
exit 0
