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
#   read                         prints `lock <json line>` and `lock_alive 1 <why>` (why: connection,
#                                busy, no-owner) or `lock_alive 0`, then `activity <json line>` when
#                                lock.activity names what a long command of a run is doing (or was
#                                doing when its run was interrupted: files/scripts/busy.sh); nothing
#                                when there is no lock. Exit 0.
#   take RUN_ID CONTROLLER STARTED
#                                creates STATE_DIR (mode 755) if missing and takes the lock under
#                                `flock` on STATE_DIR/lock.guard. Prints `taken`, `ours` (RUN_ID holds
#                                it already) or `stale <old json line>` [`activity <its activity>`] then
#                                `taken` (the stale lock and activity are kept as *.stale-<UTC>). Exit 3 printing `held <json line>` when a
#                                live run holds it; 1 with the reason on stderr when it cannot take it.
#   release RUN_ID               removes the lock if RUN_ID holds it: prints `released` or `not-ours`.
#
# Shell builtins only, but for flock and mv: this runs on every converge of every host.
state=${2%/}
lock=$state/lock

first_line() { l=; { IFS= read -r l < "$1"; } 2>/dev/null; printf '%s\n' "$l"; }
field() {   # field KEY FILE: one value of the lock's JSON line
    { while IFS= read -r l || [ -n "$l" ]; do
        case "$l" in *"\"$1\":"*) ;; *) continue ;; esac
        v=${l##*"\"$1\":"}; while [ "${v# }" != "$v" ]; do v=${v# }; done
        v=${v#\"}; printf '%s\n' "${v%%[\",\}]*}"; return 0
    done < "$2"; } 2>/dev/null
}
proc_start() {   # the process's start time in clock ticks (field 22 of /proc/PID/stat)
    l=$(first_line "/proc/$1/stat"); [ -n "$l" ] || return 0
    set -- ${l##*) }; [ $# -ge 20 ] && eval 'printf "%s\n" "${20}"'
}
boot_id() { first_line /proc/sys/kernel/random/boot_id; }
busy() { [ -e "$lock.busy" ] && command -v flock >/dev/null 2>&1 && ! flock -n "$lock.busy" true; }
lock_alive() {   # the one definition of "not stale"; sets $why
    [ "$(field boot_id "$lock")" = "$(boot_id)" ] || return 1
    pid=$(field pid "$lock")
    case "$pid" in ''|null) why=no-owner; return 0 ;; esac
    why=connection
    [ -n "$(proc_start "$pid")" ] && [ "$(proc_start "$pid")" = "$(field owner_start "$lock")" ] && return 0
    why=busy
    busy
}
guard() {
    command -v flock >/dev/null 2>&1 || { echo "servestack: 'flock' (util-linux) is needed on the host" >&2; exit 1; }
    exec 9>>"$state/lock.guard"
    flock -w 60 9 || { echo "servestack: timed out waiting for $state/lock.guard" >&2; exit 1; }
}
session_process() {   # the sshd process this shell runs under, or null
    p=$$
    while [ "$p" -gt 1 ] 2>/dev/null; do
        case "$(first_line /proc/$p/comm)" in sshd|sshd-session) echo "$p"; return ;; esac
        l=$(first_line /proc/$p/stat); set -- ${l##*) }; p=${2:-0}
    done
    echo null
}

case $1 in
read)
    [ -f "$lock" ] || exit 0
    printf 'lock %s\n' "$(first_line "$lock")"
    if lock_alive; then echo "lock_alive 1 $why"; else echo lock_alive 0; fi
    if [ -f "$lock.activity" ]; then printf 'activity %s\n' "$(first_line "$lock.activity")"; fi
    ;;
take)
    run=$3 controller=$4 started=$5
    [ -d "$state" ] || mkdir -p -m 755 "$state" || exit 1
    guard
    if [ -f "$lock" ]; then
        [ "$(field run_id "$lock")" = "$run" ] && { echo ours; exit 0; }
        lock_alive && { printf 'held %s\n' "$(first_line "$lock")"; exit 3; }
        printf 'stale %s\n' "$(first_line "$lock")"
        stamp=$(date -u +%Y%m%dT%H%M%SZ)
        mv "$lock" "$lock.stale-$stamp"
        if [ -f "$lock.activity" ]; then
            printf 'activity %s\n' "$(first_line "$lock.activity")"
            mv "$lock.activity" "$lock.activity.stale-$stamp"
        fi
    fi
    owner=$(session_process) start=
    [ "$owner" = null ] || start=$(proc_start "$owner")
    printf '{"run_id": "%s", "controller": "%s", "started": "%s", "pid": %s, "owner_start": "%s", "boot_id": "%s"}\n' \
        "$run" "$controller" "$started" "$owner" "$start" "$(boot_id)" > "$lock.new.$$" && mv "$lock.new.$$" "$lock" || exit 1
    echo taken
    ;;
release)
    run=$3
    [ -d "$state" ] || { echo not-ours; exit 0; }
    exec 9>>"$state/lock.guard"
    command -v flock >/dev/null 2>&1 && flock -w 60 9
    if [ -f "$lock" ] && [ "$(field run_id "$lock")" = "$run" ]; then rm -f "$lock" && echo released; else echo not-ours; fi
    ;;
*)
    echo "lock.sh: unknown action '$1' (read, take, release)" >&2; exit 2 ;;
esac
