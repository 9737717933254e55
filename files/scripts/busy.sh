# busy.sh STATE_DIR RUN_ID STEP COMMAND...
#
# Runs COMMAND while holding `flock` on STATE_DIR/lock.busy, and records what it is doing in
# STATE_DIR/lock.activity, one JSON line: {"run_id": RUN_ID, "step": STEP, "since": "<UTC>",
# "pid": <this shell's pid>}. A run's lock whose connection is gone is not stale while any process
# of COMMAND still holds lock.busy (files/scripts/lock.sh `lock_alive`): a second run then
# refuses the host naming RUN_ID, STEP and since when, instead of working beside it. The record is
# removed when COMMAND ends; one left behind names the step an interrupted run was in.
# COMMAND runs with SIGHUP and SIGPIPE ignored: when the run's connection goes (its controller was
# killed), the step finishes on the host instead of dying half-way at its next line of output.
# Exit: COMMAND's exit status (killed by a signal, 129-159: first saying so on stderr,
# "servestack: STEP was killed on the host by signal N", since a killed process says nothing); 75
# printing `busy <activity json>` on stderr when another process holds lock.busy; 1 when flock is missing.
trap '' HUP PIPE   # from the start: the run's connection may go any time now
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='busy.sh STATE_DIR RUN_ID STEP COMMAND...'
need_arguments 4 "$@"
state=${1%/}; run=$2; step=$3; shift 3
require flock util-linux
mkdir -p -m 755 "$state" || exit 1
exec 8>>"$state/lock.busy"
if ! flock -n 8; then
    first_line "$state/lock.activity"
    echo "busy ${line:-{\}}" >&2
    exit 75
fi
utc_stamp
printf -v activity '{"run_id": "%s", "step": "%s", "since": "%s", "pid": %s}' "$run" "$step" "$stamp" "$$"
write_atomically "$state/lock.activity" "$activity"
"$@"
status=$?
rm -f "$state/lock.activity"
if [ "$status" -gt 128 ] && [ "$status" -lt 160 ]; then
    message "$step was killed on the host by signal $((status - 128)) before it finished"
fi
exit $status
