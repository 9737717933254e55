# verify-http.sh  (inputs in the environment; facts/verify.py ServiceHttp runs it)
#
# Asks the service for GET /health, from the host itself, and with REQUEST a real POST /generate.
#
# Inputs (environment):
#   URL      where the service answers: http://ADDRESS:PORT (an IPv6 ADDRESS in brackets), one of
#            the host's own addresses
#   PYTHON   the venv's python (python3 when it is not executable)
#   REQUEST  the POST /generate request (JSON); empty: GET /health only
#
# /health alone (the deploy asks it on every converge) is asked as cheaply as the host allows:
# bash's /dev/tcp starts no program, curl loads some thirty libraries, python more still. When
# bash cannot connect (refused, or a bash built without /dev/tcp) curl asks, or else python, and
# says why. Loopback needs no connect timeout; another address might sit behind a firewall that
# drops, so coreutils' timeout bounds bash there (or, without timeout, curl's --max-time).
#
# Output: the section `report` (facts/framing.py; helpers.sh `section`), a JSON object:
#   {"base", "health": status | "health_error"}
# (files/scripts/verify-http.py, which the python runs, adds the /generate fields).
# Exit: 0; what failed is in the report (2: an input missing, a usage line on stderr).
set -u
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='verify-http.sh  (inputs in the environment; facts/verify.py ServiceHttp runs it)'
need_env URL PYTHON
probe=$(<"${BASH_SOURCE[0]%/*}/verify-http.py")

BASH_CANNOT_CONNECT=100

report() { section report printf '{"base": "%s", %s}\n' "$URL" "$1"; }

ask_with_python() {
    local python=$PYTHON
    [ -x "$python" ] || python=python3
    "$python" -I -c "$probe" "$URL" "${REQUEST:-null}"
}

# The report, or exit BASH_CANNOT_CONNECT without one. Run in a subshell (it opens fd 3).
ask_with_bash() {
    local proto code rest rc
    trap '' PIPE
    exec 3<>"/dev/tcp/$ADDRESS/$PORT" || exit "$BASH_CANNOT_CONNECT"
    printf 'GET /health HTTP/1.0\r\nHost: %s\r\n\r\n' "$ADDRESS" >&3
    IFS=' ' read -t 30 -r proto code rest <&3
    rc=$?
    if [[ $proto == HTTP/* && $code == [1-9][0-9][0-9] ]]; then report "\"health\": $code"
    elif [ "$rc" -gt 128 ]; then report '"health_error": "no answer within 30 s"'
    else report '"health_error": "no HTTP status line in the answer"'; fi
}

ask_with_curl() {
    local code rc
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$URL/health")
    rc=$?
    case "$rc:$code" in
        0:[1-9][0-9][0-9]) report "\"health\": $code" ;;
        7:*) report '"health_error": "connection refused (curl exit 7)"' ;;
        28:*) report '"health_error": "no answer within 30 s (curl exit 28)"' ;;
        *) report "\"health_error\": \"curl exit $rc, HTTP code $code\"" ;;
    esac
}

if [ -n "${REQUEST:-}" ]; then
    ask_with_python
    exit 0
fi
address_port=${URL#http://}
PORT=${address_port##*:}
ADDRESS=${address_port%:*}
ADDRESS=${ADDRESS#[}
ADDRESS=${ADDRESS%]}
case $ADDRESS in
    127.0.0.1|::1)
        (ask_with_bash) 2>/dev/null
        answered=$? ;;
    *)
        if command -v timeout >/dev/null 2>&1; then
            export -f ask_with_bash report section
            export ADDRESS PORT URL BASH_CANNOT_CONNECT
            timeout 35 bash -c ask_with_bash 2>/dev/null
            answered=$?
            if [ "$answered" = 124 ]; then report '"health_error": "no answer within 35 s"'; fi
        else
            answered=$BASH_CANNOT_CONNECT
        fi ;;
esac
if [ "$answered" != "$BASH_CANNOT_CONNECT" ]; then exit 0; fi
if command -v curl >/dev/null 2>&1; then ask_with_curl; else ask_with_python; fi
exit 0
