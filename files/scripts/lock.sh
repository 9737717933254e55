# lock.sh read|take|release STATE_DIR [RUN_ID CONTROLLER STARTED]
#
# servestack's run lock, STATE_DIR/lock: one JSON line
#   {"run_id", "controller", "started", "pid", "owner_start", "boot_id"}
# naming a process ON THE HOST that lives exactly as long as the run's connection: the sshd
# session process this command runs under (found by walking up from this shell). When the control
# machine goes, its connection closes, that process exits and the lock is stale. A run's long
# remote commands (the CUDA installer) also hold `flock` on STATE_DIR/lock.busy while they run: a
# lock whose connection is gone while such a command still runs is not stale.
#
#   read                         prints the lock as facts/framing.py sections (helpers.sh `section`):
#                                `lock` (its JSON line), `lock_alive` (`1 <why>`, why: connection, busy,
#                                no-owner; or `0 [rebooted]`, rebooted: the host booted since), then
#                                `activity` (its JSON line) when lock.activity names what a long
#                                command of a run is doing (or was doing when its run was interrupted:
#                                files/scripts/busy.sh); nothing when there is no lock. Exit 0.
#   take RUN_ID CONTROLLER STARTED
#                                creates STATE_DIR (mode 755) if missing and takes the lock under
#                                `flock` on STATE_DIR/lock.guard. Prints `taken`, `ours` (RUN_ID holds
#                                it already) or the sections `stale` (the old JSON line) [`activity`
#                                (its activity)] then `taken` (the stale lock and activity are kept as
#                                *.stale-<UTC>). Exit 3 printing the section `held` (the JSON line)
#                                when a live run holds it; 1 with the reason on stderr when it cannot
#                                take it.
#   release RUN_ID               removes the lock if RUN_ID holds it: prints `released` or `not-ours`.
#
# Shell builtins only, but for flock and mv: this runs on every converge of every host.
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='lock.sh read|take|release STATE_DIR [RUN_ID CONTROLLER STARTED]'
case ${1:-} in
    read) need_arguments 2 "$@" ;;
    take) need_arguments 5 "$@" ;;
    release) need_arguments 3 "$@" ;;
    *) usage "unknown action '${1:-}'" ;;
esac
state=${2%/}
lock=$state/lock

# The helpers set variables instead of printing: `$(...)` of a function is a fork, and this runs on
# every converge of every host.
field() {   # field KEY FILE: $value, one value of the lock's JSON line ('' when absent)
    value=
    { while IFS= read -r l || [ -n "$l" ]; do
        case "$l" in *"\"$1\":"*) ;; *) continue ;; esac
        v=${l##*"\"$1\":"}; while [ "${v# }" != "$v" ]; do v=${v# }; done
        v=${v#\"}; value=${v%%[\",\}]*}; return 0
    done < "$2"; } 2>/dev/null
}
proc_start() {   # $start: the process's start time in clock ticks (field 22 of /proc/PID/stat)
    start=
    first_line "/proc/$1/stat"; [ -n "$line" ] || return 0
    set -- ${line##*) }; [ $# -ge 20 ] && eval 'start=${20}'
}
boot_id() { first_line /proc/sys/kernel/random/boot_id; boot=$line; }   # $boot
busy() { [ -e "$lock.busy" ] && command -v flock >/dev/null 2>&1 && ! flock -n "$lock.busy" true; }
lock_alive() {   # the one definition of "not stale"; sets $why (why alive; why stale: rebooted or '')
    boot_id; field boot_id "$lock"
    [ "$value" = "$boot" ] || { why=rebooted; return 1; }
    field pid "$lock"; pid=$value
    case "$pid" in ''|null) why=no-owner; return 0 ;; esac
    why=connection
    proc_start "$pid"; field owner_start "$lock"
    [ -n "$start" ] && [ "$start" = "$value" ] && return 0
    why=busy
    busy && return 0
    why=; return 1
}
guard() {
    require flock util-linux
    exec 9>>"$state/lock.guard"
    flock -w 60 9 || { message "timed out waiting for $state/lock.guard"; exit 1; }
}
session_process() {   # $owner: the sshd process this shell runs under, or null
    p=$$ owner=null
    while [ "$p" -gt 1 ] 2>/dev/null; do
        first_line "/proc/$p/comm"
        case "$line" in sshd|sshd-session) owner=$p; return ;; esac
        first_line "/proc/$p/stat"; set -- ${line##*) }; p=${2:-0}
    done
}

case $1 in
read)
    [ -f "$lock" ] || exit 0
    first_line "$lock"; section lock printf '%s\n' "$line"
    if lock_alive; then section lock_alive echo 1 "$why"; else section lock_alive echo "0${why:+ $why}"; fi
    if [ -f "$lock.activity" ]; then first_line "$lock.activity"; section activity printf '%s\n' "$line"; fi
    ;;
take)
    run=$3 controller=$4 started=$5
    [ -d "$state" ] || mkdir -p -m 755 "$state" || exit 1
    guard
    if [ -f "$lock" ]; then
        field run_id "$lock"
        [ "$value" = "$run" ] && { echo ours; exit 0; }
        lock_alive && { first_line "$lock"; section held printf '%s\n' "$line"; exit 3; }
        first_line "$lock"; section stale printf '%s\n' "$line"
        utc_stamp
        mv "$lock" "$lock.stale-$stamp"
        if [ -f "$lock.activity" ]; then
            first_line "$lock.activity"; section activity printf '%s\n' "$line"
            mv "$lock.activity" "$lock.activity.stale-$stamp"
        fi
    fi
    session_process; start=
    [ "$owner" = null ] || proc_start "$owner"
    boot_id
    printf -v text '{"run_id": "%s", "controller": "%s", "started": "%s", "pid": %s, "owner_start": "%s", "boot_id": "%s"}' \
        "$run" "$controller" "$started" "$owner" "$start" "$boot"
    write_atomically "$lock" "$text" || exit 1
    echo taken
    ;;
release)
    run=$3
    [ -d "$state" ] || { echo not-ours; exit 0; }
    exec 9>>"$state/lock.guard"
    command -v flock >/dev/null 2>&1 && flock -w 60 9
    field run_id "$lock"
    if [ -f "$lock" ] && [ "$value" = "$run" ]; then rm -f "$lock" && echo released; else echo not-ours; fi
    ;;
esac
