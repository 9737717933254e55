# sglang-health-gate.sh  (inputs in the environment; run as root by operations/service.py `restart`)
#
# The health gate for one SGLang unit. Install the unit it starts (SS_UNIT_SOURCE: systemd never
# holds a unit as the service's that no gate started) as a runtime unit only (SS_UNIT_CANDIDATE: it
# overrides SS_UNIT_PATH and is gone at the next boot, so a host that reboots before the gate verified
# it boots the last verified unit), (re)start it, wait until
# GET /health answers 200, send one real POST /generate and require a non-empty "text". On success
# make it the service's unit in SS_UNIT_PATH, enabled, remember it as
# the last known-good one (SS_GOOD_UNIT) and record its fingerprint (SS_RECORD). On failure
# re-activate the last known-good release and unit, restart that, wait until it is healthy and
# answering. The failed release is never deleted: it stays for inspection.
#
# Inputs (environment; every one is set by operations/service.py `gate_environment`):
#   SS_UNIT              the unit's name (sglang.service)
#   SS_UNIT_PATH         its file in /etc/systemd/system
#   SS_UNIT_CANDIDATE    the runtime unit (/run/systemd/system.control) that overrides SS_UNIT_PATH
#   SS_UNIT_SOURCE       the unit to start: copied to SS_UNIT_CANDIDATE right before the restart,
#                        over SS_UNIT_PATH (atomically) and enabled once verified (the release's
#                        copy, or the benchmark's configuration)
#   SS_URL               where the server answers, from the host itself (http://127.0.0.1:30000)
#   SS_HEALTH_TIMEOUT    seconds to wait for GET /health
#   SS_GENERATE_TIMEOUT  seconds for the POST /generate
#   SS_GENERATE_BODY     the POST /generate request (JSON)
#   SS_RELEASE SS_RELEASE_DIR   the release the unit runs, and its directory
#   SS_FINGERPRINT       what the unit runs with (unit + secrets), recorded once healthy
#   SS_STATE_DIR SS_GOOD_UNIT SS_RECORD   the service's state dir, last good unit, record
#   SS_VENV_PATH         the stable venv path (a link to a release's venv)
#   SS_PREVIOUS_RELEASE SS_PREVIOUS_VENV  the last good release and its venv (empty: none known)
#   SS_PREVIOUS_LABEL    how messages name what a rollback returns to
#   SS_PREVIOUS_FINGERPRINT  the last good unit's fingerprint (its record's; empty: a baseline record)
#   SS_PYTHON            the python that runs the venv step's tool (files/scripts/ml_env.py,
#                        which records a rollback in the venv step's activation history)
#   SS_ROLLBACK_RECORD   its `record` parameters for going back to SS_PREVIOUS_RELEASE (base64 JSON)
#   SS_PROGRESS_EVERY    seconds between "waiting ... (N s of M s)" lines (default 5)
# Output: progress lines on stdout; what failed (with the unit's last journal lines) on stderr.
# Exit: 0 healthy; 1 failed, and rolled back (or stopped: no earlier healthy unit); 3 the
# rollback failed too; 2 an input missing (a usage line on stderr).
set -u

reason=""
invocation=""
restarts_at_start=""   # the unit's NRestarts once our restart returned (earlier auto-restarts count there)

source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='sglang-health-gate.sh  (inputs in the environment; run as root by operations/service.py `restart`)'
need_env SS_UNIT SS_UNIT_PATH SS_UNIT_CANDIDATE SS_UNIT_SOURCE SS_URL SS_HEALTH_TIMEOUT SS_GENERATE_TIMEOUT SS_GENERATE_BODY SS_RELEASE \
    SS_RELEASE_DIR SS_FINGERPRINT SS_STATE_DIR SS_GOOD_UNIT SS_RECORD SS_VENV_PATH SS_PREVIOUS_RELEASE SS_PREVIOUS_VENV \
    SS_PREVIOUS_LABEL SS_PREVIOUS_FINGERPRINT SS_PYTHON SS_ROLLBACK_RECORD
ml_env_tool=$(<"${BASH_SOURCE[0]%/*}/ml_env.py")

# The unit's state, in one `systemctl show`: sets $active $sub $restarts $result $exit_status.
read_unit_state() {
  local key value
  active= sub= restarts= result= exit_status=
  while IFS='=' read -r key value; do
    case $key in
      ActiveState) active=$value ;;
      SubState) sub=$value ;;
      NRestarts) restarts=$value ;;
      Result) result=$value ;;
      ExecMainStatus) exit_status=$value ;;
    esac
  done < <(systemctl show --property=ActiveState,SubState,NRestarts,Result,ExecMainStatus -- "$SS_UNIT" 2>/dev/null)
}

# Whether the server exited since our restart: systemd gave up on it, is about to restart it, or
# restarted it (NRestarts is not reset by `systemctl restart`: a unit that crash-looped before
# still carries its count, so only a rise counts).
exited_since_restart() {
  [ "$active" = failed ] || [ "$sub" = auto-restart ] ||
    { [ -n "$restarts" ] && [ -n "$restarts_at_start" ] && [ "$restarts" -gt "$restarts_at_start" ]; }
}

# Wait up to $1 s for GET /health to answer 200; stop early when systemd gave up on the unit.
wait_ready() {
  local started=$SECONDS deadline=$((SECONDS + $1)) next_note=$((SECONDS + ${SS_PROGRESS_EVERY:-5}))
  while :; do
    if curl -fsS -o /dev/null --max-time 10 "$SS_URL/health" 2>/dev/null; then
      return 0
    fi
    read_unit_state
    # A server that exits while starting is broken: do not wait out the timeout for Restart= to loop.
    if exited_since_restart; then
      reason="the server exited before /health answered ($result, exit status $exit_status)"
      return 1
    fi
    if (( SECONDS >= deadline )); then
      reason="no HTTP 200 from GET /health within $1 s (unit $active)"
      return 1
    fi
    if (( SECONDS >= next_note )); then  # output keeps long waits visible and the SSH session alive
      progress "waiting for $SS_UNIT to become ready ($((SECONDS - started)) s of $1 s)"
      next_note=$((SECONDS + ${SS_PROGRESS_EVERY:-5}))
    fi
    sleep 1
  done
}

# One real generation request; the answer must carry a non-empty "text".
answers() {
  local body
  if ! body=$(curl -fsS --max-time "$SS_GENERATE_TIMEOUT" -H 'Content-Type: application/json' \
                   -d "$SS_GENERATE_BODY" "$SS_URL/generate" 2>&1); then
    reason="POST /generate failed: $(printf '%s' "$body" | head -c 300)"
    return 1
  fi
  if ! printf '%s' "$body" | grep -Eq '"text"[[:space:]]*:[[:space:]]*"([^"\\]|\\.)'; then
    reason="POST /generate answered without text: $(printf '%s' "$body" | head -c 300)"
    return 1
  fi
}

restart_and_check() {
  # reset-failed: this restart is a deliberate new start, not one of the automatic restarts the
  # unit's StartLimitBurst counts (a unit that gave up would otherwise refuse it); it flushes the
  # start rate counter (systemd.unit(5), StartLimitIntervalSec=).
  systemctl reset-failed -- "$SS_UNIT" 2>/dev/null || true
  if ! systemctl daemon-reload || ! systemctl restart -- "$SS_UNIT"; then
    reason="systemctl restart $SS_UNIT failed"
    return 1
  fi
  invocation=$(systemctl show --property=InvocationID --value -- "$SS_UNIT" 2>/dev/null)
  read_unit_state
  restarts_at_start=$restarts
  wait_ready "$SS_HEALTH_TIMEOUT" && answers
}

# The record of a start this gate verified: what the unit runs with ($1, a fingerprint), on which
# release ($2), when, and the start itself (its InvocationID: a later start was not verified).
record_verified_start() {
  local record
  printf -v record '{"fingerprint": "%s", "release": "%s", "unit": "%s", "healthy_at": "%s", "invocation": "%s"}' \
    "$1" "$2" "$SS_UNIT_PATH" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$invocation"
  write_atomically "$SS_RECORD" "$record"
}

remember_good_unit() {
  install -d -m 755 -- "$SS_STATE_DIR" && copy_atomically "$SS_UNIT_PATH" "$SS_GOOD_UNIT" 644 &&
    record_verified_start "$SS_FINGERPRINT" "$SS_RELEASE"
}

# After a rollback to the last good unit: that unit's record, with the start just verified (none
# for a unit servestack did not write: its baseline record has no fingerprint).
remember_rollback_start() {
  [ -n "$SS_PREVIOUS_FINGERPRINT" ] || return 0
  record_verified_start "$SS_PREVIOUS_FINGERPRINT" "$SS_PREVIOUS_RELEASE" ||
    message "could not record the rolled-back start in $SS_RECORD"
}

# Point the stable venv path back at the previous release (a rename, as the venv step does).
reactivate_previous_venv() {
  [ -n "$SS_PREVIOUS_VENV" ] || return 0
  [ "$(readlink -- "$SS_VENV_PATH")" != "$SS_PREVIOUS_VENV" ] || return 0  # the link as the venv step writes it
  if [ ! -x "$SS_PREVIOUS_VENV/bin/python" ]; then
    reason="the previous release's venv $SS_PREVIOUS_VENV is gone"
    return 1
  fi
  point_link "$SS_VENV_PATH" "$SS_PREVIOUS_VENV" && record_reactivation
}

# Tell the venv step's activation history about the switch, so that rollback.py and release
# pruning see which release is active. The venv step's own tool (files/scripts/ml_env.py
# `record`) writes it, only where that history exists.
record_reactivation() {
  [ -n "$SS_PREVIOUS_RELEASE" ] || return 0
  "$SS_PYTHON" -I -S -c "$ml_env_tool" record "$SS_ROLLBACK_RECORD" >/dev/null ||
    message "could not record the switch back to $SS_PREVIOUS_RELEASE in the venv step's activation history"
}

restore_good_unit() { copy_atomically "$SS_GOOD_UNIT" "$SS_UNIT_PATH" 644; }

# The unit this gate starts, until it is verified: a runtime unit, which a reboot forgets.
candidate=$SS_UNIT_CANDIDATE
install_candidate() {
  if ! install -d -m 755 -- "${candidate%/*}" || ! copy_atomically "$SS_UNIT_SOURCE" "$candidate" 644 ||
       ! systemctl daemon-reload; then
    reason="could not install $SS_UNIT_SOURCE as $candidate"
    return 1
  fi
}

# Verified: it becomes the service's unit (the same text: the running server is not restarted).
promote_candidate() {
  copy_atomically "$candidate" "$SS_UNIT_PATH" 644 && rm -f -- "$candidate" && systemctl daemon-reload &&
    systemctl enable --quiet -- "$SS_UNIT"
}

drop_candidate() { rm -f -- "$candidate" && systemctl daemon-reload; }

if install_candidate && restart_and_check; then
  if ! promote_candidate; then
    message "$SS_UNIT is healthy on release $SS_RELEASE but could not be installed as $SS_UNIT_PATH (it runs from $candidate until the next boot)"
    exit 1
  fi
  if ! remember_good_unit; then
    message "$SS_UNIT is healthy on release $SS_RELEASE but its record in $SS_STATE_DIR could not be written"
    exit 1
  fi
  progress "$SS_UNIT is healthy on release $SS_RELEASE and answered a generation request"
  exit 0
fi

failure="$SS_UNIT on release $SS_RELEASE failed: $reason"
{
  message "$failure"
  if [ -n "$invocation" ]; then
    message "its last journal lines:"
    journalctl "_SYSTEMD_INVOCATION_ID=$invocation" --lines=15 --no-pager --output=cat 2>/dev/null | sed 's/^/    /'
  fi
} >&2

drop_candidate || message "could not remove the unverified $candidate"
if [ ! -f "$SS_GOOD_UNIT" ]; then
  systemctl stop -- "$SS_UNIT"
  message "$failure; no earlier healthy unit to roll back to, so $SS_UNIT was stopped; release $SS_RELEASE stays in $SS_RELEASE_DIR for inspection"
  exit 1
fi

if reactivate_previous_venv && restore_good_unit && restart_and_check; then
  remember_rollback_start
  message "$failure; rolled back to $SS_PREVIOUS_LABEL, which is healthy and answering again; release $SS_RELEASE stays in $SS_RELEASE_DIR for inspection"
  exit 1
fi
message "$failure; the rollback to $SS_PREVIOUS_LABEL failed too: $reason"
exit 3
