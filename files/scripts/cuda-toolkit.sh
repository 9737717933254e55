# cuda-toolkit.sh install FLAG... | restore-link | point-link LINK TARGET | move-aside PATH MARKER
#
# The CUDA toolkit tree and the /usr/local/cuda link on a host (run by operations/toolkit.py, as
# root, after cuda-runfile.sh verified the runfile).
#
#   install FLAG...    runs the verified runfile toolkit-only, with LANG=C (and LC_ALL=C) and no DISPLAY:
#                        TMPDIR=$SS_TMP_DIR sh $SS_RUNFILE FLAG... --installpath=$SS_INSTALL_PATH --tmpdir=$SS_TMP_DIR
#                      holding `flock` on SS_BUSY_FILE (another install or download holding it: exit 1),
#                      with SS_MARKER (a JSON line) in SS_MARKER_FILE while it runs, so that a run that dies
#                      meanwhile is finished by the next. The installer writes SS_INSTALLER_TMP_LOG
#                      (/tmp/cuda-installer.log) whatever --tmpdir says and crashes on one it cannot
#                      replace: an earlier one is first moved aside to SS_INSTALLER_TMP_LOG.stale-<UTC>
#                      (older such copies removed; said on stderr), so after the run that file is this
#                      run's log. Success is the installer's exit 0 AND SS_INSTALL_PATH/bin/nvcc reporting
#                      "release $SS_NVCC_RELEASE, V$SS_NVCC_VERSION".
#                      On failure: the link is restored (as `restore-link`, when SS_LINK_PATH is set),
#                      the tree at SS_INSTALL_PATH is moved aside to SS_INSTALL_PATH.failed-<UTC>, the
#                      marker removed, and stderr shows why, the installer's last output lines and the
#                      last SS_LOG_TAIL_LINES lines of this run's log (SS_INSTALLER_TMP_LOG, else what this
#                      run added to SS_INSTALLER_LOG). When that log (or the installer's output) shows its
#                      compiler check refused the host's gcc ("unsupported compiler"), the first line says
#                      so, followed by SS_COMPILER_HINT (what to do about it: the host-data key that passes --override).
#                      Environment: SS_RUNFILE SS_INSTALL_PATH SS_TMP_DIR SS_STATE_DIR SS_MARKER_FILE SS_MARKER
#                      SS_CUDA_VERSION SS_NVCC_RELEASE SS_NVCC_VERSION SS_INSTALLER_LOG SS_INSTALLER_TMP_LOG
#                      SS_LOG_TAIL_LINES [SS_BUSY_FILE SS_COMPILER_HINT SS_LINK_PATH SS_LINK_KIND SS_LINK_HOPS].
#                      Exit 0 installed (prints "installed CUDA ... into ..."); 1 with the reason on stderr.
#   restore-link       puts the recorded link chain back: SS_LINK_PATH, SS_LINK_KIND ("absent" removes a
#                      symlink SS_LINK_PATH that an installer created) and SS_LINK_HOPS (one "LINK<tab>TARGET"
#                      line per hop; only hops that changed are re-pointed, each saying so on stderr).
#                      Exit 0; 1 when a hop is no longer a symlink and so cannot be restored.
#   point-link LINK TARGET
#                      points the symlink LINK at TARGET atomically (a new link renamed over it).
#   move-aside PATH MARKER
#                      moves an interrupted install's tree to PATH.failed-<UTC> and removes its MARKER file.
set -u

source "${BASH_SOURCE[0]%/*}/helpers.sh"
utc_stamp
ts=$stamp

restore_link() {
    local hop target now status=0
    if [ "$SS_LINK_KIND" = absent ]; then
        if [ -L "$SS_LINK_PATH" ]; then
            message "the installer created $SS_LINK_PATH -> $(readlink -- "$SS_LINK_PATH"); removed (it did not exist before)"
            rm -f -- "$SS_LINK_PATH"
        fi
        return 0
    fi
    while IFS=$'\t' read -r hop target; do
        [ -n "$hop" ] || continue
        now=$(readlink -- "$hop" 2>/dev/null || true)
        [ "$now" != "$target" ] || continue
        if [ -L "$hop" ] || [ ! -e "$hop" ]; then
            point_link "$hop" "$target" &&
                message "$hop was re-pointed to '$now' (by the installer?): restored -> $target"
        else
            message "$hop is no longer a symlink: cannot restore -> $target"
            status=1
        fi
    done <<< "${SS_LINK_HOPS:-}"
    return $status
}

set_aside_stale_log() {   # move an earlier SS_INSTALLER_TMP_LOG aside (the installer crashes on one it cannot replace)
    local log=$SS_INSTALLER_TMP_LOG owner why="the installer writes that file and crashes on one it cannot replace"
    [ -e "$log" ] || [ -L "$log" ] || return 0
    owner=$(stat -c %U -- "$log" 2>/dev/null || echo unknown)
    rm -f -- "$log".stale-*
    if mv -f -- "$log" "$log.stale-$ts" 2>/dev/null; then
        message "moved the earlier $log (owner $owner) aside to $log.stale-$ts: $why"
    elif rm -f -- "$log" 2>/dev/null && [ ! -e "$log" ]; then
        message "removed the earlier $log (owner $owner): $why"
    else
        message "cannot move the earlier $log (owner $owner) aside: remove it ($why)"
        return 1
    fi
}

this_run_log() {   # OFFSET: this run's installer log (the fresh tmp log, else what it added to SS_INSTALLER_LOG)
    if [ -f "$SS_INSTALLER_TMP_LOG" ]; then
        cat -- "$SS_INSTALLER_TMP_LOG"
    elif [ -f "$SS_INSTALLER_LOG" ]; then
        tail -c +"$(($1 + 1))" -- "$SS_INSTALLER_LOG"
    else
        return 1
    fi
}

install_toolkit() {
    local out="$SS_TMP_DIR/servestack-cuda-installer.out" rc v why="" moved log_start=0 log log_found refused
    mkdir -p -- "$SS_TMP_DIR" "$SS_STATE_DIR" || exit 1
    if [ -n "${SS_BUSY_FILE:-}" ]; then   # the deploy runs it under busy.sh instead, which holds it
        hold_busy_file "$SS_BUSY_FILE" "another CUDA install is still running on this host"
    fi
    set_aside_stale_log || exit 1
    if [ -f "$SS_INSTALLER_LOG" ]; then log_start=$(stat -c %s -- "$SS_INSTALLER_LOG"); fi
    write_atomically "$SS_MARKER_FILE" "$SS_MARKER" || exit 1
    # --installpath: the flag of the reference hosts' command (../shared/notes/stack-facts.md, "The command
    # used on the reference hosts"); NVIDIA's table documents --toolkitpath. The 13.0.1 runfile's own
    # --help was not checked here (the real runfile could not be fetched).
    env -u DISPLAY LANG=C LC_ALL=C TMPDIR="$SS_TMP_DIR" \
        sh "$SS_RUNFILE" "$@" --installpath="$SS_INSTALL_PATH" --tmpdir="$SS_TMP_DIR" > "$out" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
        why="installer exit $rc"
    elif ! v=$("$SS_INSTALL_PATH/bin/nvcc" --version 2>&1); then
        why="installer exit 0, but $SS_INSTALL_PATH/bin/nvcc does not run: $(printf '%s' "$v" | tail -n 1)"
    else
        case "$v" in
            *"release $SS_NVCC_RELEASE, V$SS_NVCC_VERSION"*) ;;
            *) why="installer exit 0, but $SS_INSTALL_PATH/bin/nvcc reports: $(printf '%s\n' "$v" | grep -i release | head -n 1)" ;;
        esac
    fi
    if [ -n "$why" ]; then
        if [ -n "${SS_LINK_PATH:-}" ]; then restore_link; fi
        moved="nothing was left at $SS_INSTALL_PATH"
        if [ -e "$SS_INSTALL_PATH" ] || [ -L "$SS_INSTALL_PATH" ]; then
            mv -- "$SS_INSTALL_PATH" "$SS_INSTALL_PATH.failed-$ts" &&
                moved="the partial tree was moved aside to $SS_INSTALL_PATH.failed-$ts"
        fi
        rm -f -- "$SS_MARKER_FILE"
        log=$(this_run_log "$log_start"); log_found=$?
        refused=$( { printf '%s\n' "$log"; cat -- "$out"; } 2>/dev/null | grep -i -m 1 'unsupported compiler')  # grep may leave early
        if [ -n "$refused" ]; then
            message "CUDA $SS_CUDA_VERSION install refused by the installer's compiler check: $refused"
            if [ -n "${SS_COMPILER_HINT:-}" ]; then message "$SS_COMPILER_HINT"; fi
        fi
        message "CUDA $SS_CUDA_VERSION install failed ($why); $moved"
        if [ -s "$out" ]; then message "installer output (last lines):"; tail -n 10 -- "$out" >&2; fi
        if [ $log_found -ne 0 ]; then
            message "no $SS_INSTALLER_TMP_LOG or $SS_INSTALLER_LOG"
        else
            if [ -f "$SS_INSTALLER_TMP_LOG" ]; then message "last lines of $SS_INSTALLER_TMP_LOG:"
            else message "last lines of $SS_INSTALLER_LOG:"; fi
            printf '%s\n' "$log" | tail -n "$SS_LOG_TAIL_LINES" >&2
        fi
        rm -f -- "$out"
        exit 1
    fi
    rm -f -- "$out"
    echo "installed CUDA $SS_CUDA_VERSION into $SS_INSTALL_PATH"
}

move_aside() {   # PATH MARKER
    mv -- "$1" "$1.failed-$ts" && rm -f -- "$2" &&
        message "moved the interrupted install aside to $1.failed-$ts"
}

USAGE='cuda-toolkit.sh install FLAG... | restore-link | point-link LINK TARGET | move-aside PATH MARKER'
command=${1:-}
shift || true
case $command in
    install) need_env SS_RUNFILE SS_INSTALL_PATH SS_TMP_DIR SS_STATE_DIR SS_MARKER_FILE SS_MARKER \
                 SS_CUDA_VERSION SS_NVCC_RELEASE SS_NVCC_VERSION SS_INSTALLER_LOG SS_INSTALLER_TMP_LOG SS_LOG_TAIL_LINES
             install_toolkit "$@" ;;
    restore-link) need_env SS_LINK_PATH SS_LINK_KIND; restore_link ;;
    point-link) need_arguments 2 "$@"; point_link "$1" "$2" ;;
    move-aside) need_arguments 2 "$@"; move_aside "$1" "$2" ;;
    *) usage "unknown command '$command'" ;;
esac
