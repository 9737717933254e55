# cuda-runfile.sh download PART | verify PATH [DEST] | reject PATH REASON
#
# The CUDA runfile on a host (run by operations/toolkit.py, as root). The manifest's runfile is
# given in the environment: SS_RUNFILE_URL SS_RUNFILE_SIZE SS_RUNFILE_MD5 SS_RUNFILE_SHA256 (download and
# verify read them; reject needs none).
#
#   download PART      curl SS_RUNFILE_URL into PART (its directory created), resuming what is there
#                      (`curl -C -`); each retry resumes too, up to SS_ATTEMPTS tries (default 5). It
#                      prints a progress line every SS_PROGRESS_EVERY seconds (default 5: bytes, rate,
#                      ETA) and one when it resumes. With SS_BUSY_FILE set it holds `flock` on that
#                      file while it runs (the deploy runs it under busy.sh instead, which does).
#                      Exit 0 once PART holds SS_RUNFILE_SIZE bytes; 1 with the reason on stderr (the
#                      partial file is kept: the next run resumes it).
#   verify PATH [DEST] checks PATH's size, md5 and sha256 (both hashes read at once) against the
#                      runfile's. A file that fails is moved aside to PATH.rejected-<UTC> (as `reject`:
#                      older rejected copies removed) and never used; with SS_PRESTAGED=1 (a file the user
#                      put there) it is left where it is. With DEST, a verified PATH is renamed to
#                      DEST (a finished download becomes the cached runfile).
#                      Exit 0 verified; 1 with the reason on stderr.
#   reject PATH REASON moves PATH aside to PATH.rejected-<UTC>, saying so with REASON on stderr. A
#                      rejected runfile is 4 GB: only the newest rejected copy of the runfile is kept
#                      (the older ones of PATH, and of the cached file PATH without ".part" and its
#                      ".part", are removed, each named on stderr: "removed the older rejected copy
#                      FILE"). Exit 0; non-zero if it cannot move it.
set -u

source "${BASH_SOURCE[0]%/*}/helpers.sh"
human() { numfmt --to=iec-i --suffix=B "$1" 2>/dev/null || echo "$1 bytes"; }

watch_download() {   # PART PID: a line every SS_PROGRESS_EVERY s (default 5) while PID runs: bytes, rate, ETA
    local part=$1 pid=$2 every=${SS_PROGRESS_EVERY:-5} last now rate eta
    last=$(stat -c %s -- "$part" 2>/dev/null || echo 0)
    while kill -0 "$pid" 2>/dev/null; do
        sleep "$every"
        kill -0 "$pid" 2>/dev/null || break
        now=$(stat -c %s -- "$part" 2>/dev/null || echo 0)
        rate=$(( (now - last) / every )); last=$now
        eta="?"; [ "$rate" -gt 0 ] && eta="$(( (SS_RUNFILE_SIZE - now) / rate )) s"
        progress "downloaded $(human "$now") of $(human "$SS_RUNFILE_SIZE") ($(( now * 100 / SS_RUNFILE_SIZE ))%), $(human "$rate")/s, ETA $eta"
    done
}
utc_stamp
ts=$stamp

move_to_rejected() {   # PATH: leaves PATH.rejected-$ts, the only rejected copy of the runfile
    local base=${1%.part} old
    for old in "$base".rejected-* "$base".part.rejected-*; do
        [ -e "$old" ] || continue
        rm -f -- "$old" && message "removed the older rejected copy $old (only the newest rejected runfile is kept)"
    done
    mv -f -- "$1" "$1.rejected-$ts"
}

download() {
    local part=$1 attempts=${SS_ATTEMPTS:-5} n=0 rc=0 have
    mkdir -p -- "$(dirname -- "$part")" || exit 1
    if [ -n "${SS_BUSY_FILE:-}" ]; then
        hold_busy_file "$SS_BUSY_FILE" "another download or install is still running on this host"
    fi
    while :; do
        have=$(stat -c %s -- "$part" 2>/dev/null || echo 0)
        [ "$have" -ge "$SS_RUNFILE_SIZE" ] && break
        if [ $n -ge "$attempts" ]; then
            message "download of $SS_RUNFILE_URL failed (curl exit $rc) after $n attempts; $have bytes kept in $part, resumed by the next run"
            exit 1
        fi
        n=$((n + 1))
        [ "$have" -gt 0 ] && progress "resuming the download at $(human "$have") of $(human "$SS_RUNFILE_SIZE")"
        curl -fsSL --connect-timeout 30 -C - -o "$part" "$SS_RUNFILE_URL" &
        watch_download "$part" $!
        wait $!; rc=$?
        [ $rc -eq 33 ] && rm -f -- "$part"          # the server cannot resume: start over
        [ $rc -eq 0 ] || sleep 2
    done
}

verify() {
    local path=$1 dest=${2:-} size sums md5 sha bad=""
    [ -f "$path" ] || { message "runfile $path is missing"; exit 1; }
    size=$(stat -c %s -- "$path")
    sums=$( { md5sum -- "$path" & sha256sum -- "$path"; wait; } )
    # md5sum and sha256sum prefix the line with "\" when the name needs escaping
    md5=$(printf '%s\n' "$sums" | awk '{sub(/^\\/, "", $1)} length($1) == 32 {print $1}')
    sha=$(printf '%s\n' "$sums" | awk '{sub(/^\\/, "", $1)} length($1) == 64 {print $1}')
    [ "$size" = "$SS_RUNFILE_SIZE" ] || bad="size $size bytes, expected $SS_RUNFILE_SIZE"
    [ -n "$bad" ] || [ "$md5" = "$SS_RUNFILE_MD5" ] || bad="md5 $md5, expected $SS_RUNFILE_MD5"
    [ -n "$bad" ] || [ "$sha" = "$SS_RUNFILE_SHA256" ] || bad="sha256 $sha, expected $SS_RUNFILE_SHA256"
    if [ -n "$bad" ]; then
        if [ "${SS_PRESTAGED:-0}" = 1 ]; then
            message "pre-staged runfile $path fails verification ($bad): not used"
        else
            move_to_rejected "$path"
            message "runfile $path fails verification ($bad): moved aside to $path.rejected-$ts, never used"
        fi
        exit 1
    fi
    if [ -n "$dest" ] && [ "$dest" != "$path" ]; then
        move_into_place "$path" "$dest" || exit 1
    fi
}

reject() {
    local path=$1 reason=$2
    move_to_rejected "$path" || exit 1
    message "$path failed verification ($reason): moved aside to $path.rejected-$ts, never used"
}

USAGE='cuda-runfile.sh download PART | verify PATH [DEST] | reject PATH REASON'
case ${1:-} in
    download) need_arguments 2 "$@"; need_env SS_RUNFILE_URL SS_RUNFILE_SIZE; download "$2" ;;
    verify) need_arguments 2 "$@"; need_env SS_RUNFILE_SIZE SS_RUNFILE_MD5 SS_RUNFILE_SHA256; verify "$2" "${3:-}" ;;
    reject) need_arguments 3 "$@"; reject "$2" "$3" ;;
    *) usage "unknown command '${1:-}'" ;;
esac
