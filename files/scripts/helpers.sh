# helpers.sh  (not a script of its own: the shell functions the scripts here share)
#
# A script that uses them has this line, alone, before its first use of one:
#     source "${BASH_SOURCE[0]%/*}/helpers.sh"
# servestack/scripts.py replaces that line by this file's code (its comment lines left out) when it
# sends the script to a host (`bash -c TEXT`: nothing is uploaded); run from files/scripts (tests),
# the line sources this file.
#
# The helpers set a variable where their caller needs a value: `$(...)` of a function is a fork,
# and every process a read starts is host CPU on every converge.

# `servestack: WORDS` for the operator: progress on stdout, message on stderr
progress() { echo "servestack: $*"; }
message() { echo "servestack: $*" >&2; }

# Exit 2 with `usage: $USAGE` on stderr, and what was wrong ($1): the script was called without its inputs.
# Every script sets USAGE (its first comment line) right after it sources this file.
usage() { echo "usage: $USAGE${1:+ ($1)}" >&2; exit 2; }

# usage unless at least MIN arguments follow: `need_arguments MIN "$@"`
need_arguments() { (( $# > $1 )) || usage "missing arguments"; }

# usage unless every variable named is set in the environment: `need_env NAME...`
need_env() { local name; for name; do [[ -v $name ]] || usage "$name is not set in the environment"; done; }

# Exit 1, saying so, unless the program $1 (from the package $2) is on PATH
require() {
    command -v "$1" >/dev/null 2>&1 || { message "'$1' ($2) is needed on the host"; exit 1; }
}

# Hold `flock` on the file $1 (descriptor 8) for the rest of the script, or exit 1 saying $2 when
# another process holds it. Without flock it goes on: the deploy runs its long steps under
# busy.sh, which requires flock and holds the same file.
hold_busy_file() {
    exec 8>>"$1"
    if command -v flock >/dev/null 2>&1 && ! flock -n 8; then message "$2"; exit 1; fi
}

# $stamp: the time now in UTC, 20261201T170311Z (no program started)
utc_stamp() { TZ=UTC0 printf -v stamp '%(%Y%m%dT%H%M%SZ)T' -1; }

# `section NAME COMMAND...`: COMMAND's output framed as facts/framing.py reads it. COMMAND runs in
# this shell (no subshell): it must not exit or change directory.
section() {
    local name=$1
    shift
    echo "@@servestack begin $name"
    { "$@"; } </dev/null
    printf '\n@@servestack end %s %s\n' "$name" "$?"
}

# $line: the first line of the file $1 (empty when it cannot be read)
first_line() { line=; { IFS= read -r line < "$1"; } 2>/dev/null; }

# $joined: the text of the file $1 on one line, its line breaks dropped (as `tr -d '\n'` does)
join_lines() {
    local text_line
    joined=
    while IFS= read -r text_line || [ -n "$text_line" ]; do joined+=$text_line; done < "$1"
}

# $resolved: readlink -f of $1; a directory by the shell's own cd -P (and back)
resolve() {
    local back=$PWD
    if cd -P -- "$1" 2>/dev/null; then
        resolved=$PWD
        cd -- "$back" || exit 1
    else
        resolved=$(readlink -f -- "$1")
    fi
}

# $owner: the first line of `dpkg -S $1` (`PACKAGE: PATH`), empty when dpkg owns nothing there.
# One grep over dpkg's package lists (DPKG_ADMINDIR, default /var/lib/dpkg) answers "nothing"
# without loading dpkg's database.
dpkg_owner() {
    local admin=${DPKG_ADMINDIR:-/var/lib/dpkg}
    owner=
    if command -v dpkg >/dev/null 2>&1 && grep -qsFx -- "$1" "$admin"/info/*.list "$admin"/diversions; then
        owner=$(dpkg -S "$1" 2>/dev/null)
        owner=${owner%%$'\n'*}
    fi
}

# Rename the file (or link) $1 over $2 with rename(2): readers see the old one or the new one, never
# a part. The last step of every atomic write here; on its own, it places a file staged by other
# means (the secrets file, which pyinfra uploads: files/scripts/secrets-file.sh).
move_into_place() { mv -fT -- "$1" "$2"; }

# Write the text $2 (and a final newline unless it ends with one) to the file $1 atomically: into
# $1.new.PID beside it, chmod $3 when given, then rename(2) over $1. Readers see the old file or
# the new one, never a part. Status 1 when a step fails: $1 untouched, nothing left behind. For
# directories that only root writes (the name is not unpredictable, as mktemp's would be).
write_atomically() {
    local tmp=$1.new.$$
    case $2 in
        *$'\n') printf '%s' "$2" ;;
        *) printf '%s\n' "$2" ;;
    esac > "$tmp" && { [ -z "${3:-}" ] || chmod "$3" -- "$tmp"; } && move_into_place "$tmp" "$1" && return 0
    rm -f -- "$tmp"
    return 1
}

# Copy the file $1 to $2 atomically, mode $3: into $2.new.PID beside it, then rename(2) over $2.
# Status 1 when a step fails: $2 untouched, nothing left behind. (`command install`: the program,
# even in a script that defines a function of that name.)
copy_atomically() {
    command install -m "$3" -- "$1" "$2.new.$$" && move_into_place "$2.new.$$" "$2" && return 0
    rm -f -- "$2.new.$$"
    return 1
}

# Point the symlink $1 at $2 atomically: a new link beside it, then rename(2) over it
point_link() {
    ln -sfn -- "$2" "$1.servestack-new" && move_into_place "$1.servestack-new" "$1"
}
