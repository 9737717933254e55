# patch-check.sh SETS REQUEST  (PYTHON, RECORD, SUMS, HEADERS, ABSENT in the environment)
#
# The state of servestack's source patches in the environment of $PYTHON (facts/patches.py), in
# facts/framing.py sections:
# - $PYTHON is not executable: prints $ABSENT (one JSON line) as the section `result`.
# - $SUMS is set, its first line is one of $HEADERS (one a line: the digests of the engine and sets
#   the controller sends) and `sha256sum -c` confirms every other line (each file the check of a set
#   in place read, $RECORD among them): prints the section `sums-hold`: $PYTHON and $RECORD, a line
#   each, then the record $RECORD. No python starts.
# - Otherwise runs servestack/patchlib.py with `$PYTHON -I -c`: its check or apply of SETS (base64
#   of zlib-compressed JSON: the patch sets and their digests) as REQUEST (base64 JSON: mode,
#   package, record path) asks, which prints one JSON object as the section `result`.
# Exit: 0, or the python check's exit status (non-zero with the reason on stderr).
set -u
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='patch-check.sh SETS REQUEST  (PYTHON, RECORD, SUMS, HEADERS, ABSENT in the environment)'
need_arguments 2 "$@"
need_env PYTHON RECORD SUMS HEADERS ABSENT
from_record() { printf '%s\n%s\n' "$PYTHON" "$RECORD"; cat -- "$RECORD"; }
if [ ! -x "$PYTHON" ]; then
    section result printf '%s\n' "$ABSENT"
    exit 0
fi
if [ -n "$SUMS" ] && [ -f "$SUMS" ] && [ -f "$RECORD" ] && IFS= read -r first < "$SUMS" \
        && [[ $'\n'"$HEADERS"$'\n' == *$'\n'"$first"$'\n'* ]] \
        && tail -n +2 -- "$SUMS" | sha256sum --check --status --strict 2>/dev/null; then
    section sums-hold from_record
    exit 0
fi
engine=$(<"${BASH_SOURCE[0]%/*}/../../servestack/patchlib.py")
exec "$PYTHON" -I -c "$engine" "$@"
