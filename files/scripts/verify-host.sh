# verify-host.sh  (inputs in the environment; facts/verify.py VerifyHost runs it)
#
# What the verification checks (servestack/checks) read of a host besides the GPUs and the
# toolkits, which they read with the GPU and toolkit steps' own facts. Reads only.
#
# Inputs (environment):
#   CUDA          the toolkit's install path (/usr/local/cuda-13.0)
#   VENV          the stable venv path (/opt/ml-env): a link to the active release's venv
#   RECORDS       the patch records' paths inside a release directory, space-separated
#   UNIT          the service's unit (sglang.service)
#   PROPERTIES    the unit's properties to read, comma-separated (systemctl show --property)
#   ENV_NAMES     the variables of the service's live environment to print, space-separated
#   SECRET_NAMES  the variables the secrets file sets, space-separated (may be empty)
#   SECRETS_FILE  the service's secrets file
#
# Output: one `KEY<TAB>VALUE` line per finding:
#   device              a GPU device node (/dev/nvidiactl, /dev/nvidiaN)
#   package             who packaged CUDA's nvcc, only when CUDA has no version.json: `dpkg NAME
#                       VERSION`, `dpkg-release NAME VERSION` (a meta package: the toolkit's release),
#                       `rpm NAME VERSION`, `wheel NAME VERSION`
#   toolkit_path        CUDA resolved (readlink -f)
#   venv                VENV resolved, when it is a directory
#   venv_link           VENV's link as written (readlink), when it is a link: it names the active
#                       release as the venv step reads it (facts/venv.py release_of)
#   record              a patch record (RECORDS) beside that venv
#   release_state       what the release's checks read beyond its path: site-packages, its mtime (a
#                       package added or removed) and the sha256 of every installed distribution's
#                       METADATA with torch/version.py (a version or local label edited in place),
#                       each record's sha256
#   systemd             running | not running
#   unit                a `Property=value` line of `systemctl show UNIT`; unit_exit: its exit status
#   pid user env        the unit's main process: its pid, its user, and `NAME=value` per ENV_NAMES
#                       variable it has (never one of SECRET_NAMES)
#   unit_files          `unreadable` when the unit's files (fragment and drop-ins) cannot be read
#   unit_secret_names   how many lines of the unit's files set a SECRET_NAMES variable
#   unit_secret_values  how many lines of them hold a value (4+ characters) from SECRETS_FILE
#   secrets_file        `MODE OWNER GROUP` of SECRETS_FILE, or `absent`
# Secrets never leave the host: the unit is compared with the secrets file here, and only counts
# are printed.
# Exit: 0 (what is absent is reported as absent); 2 an input missing (a usage line on stderr).
set -u

source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='verify-host.sh  (inputs in the environment; facts/verify.py VerifyHost runs it)'
need_env CUDA VENV RECORDS UNIT PROPERTIES ENV_NAMES SECRET_NAMES SECRETS_FILE

say() { printf '%s\t%s\n' "$1" "$2"; }

device_nodes() {
    local node
    for node in /dev/nvidiactl /dev/nvidia[0-9]*; do
        if [ -e "$node" ]; then say device "$node"; fi
    done
}

# Only a toolkit without version.json (the runfile writes one) is judged by its package.
toolkit_package() {
    [ -f "$CUDA/version.json" ] && return
    local nvcc=$CUDA/bin/nvcc owner package line status dist
    dpkg_owner "$nvcc"
    package=${owner%%:*}
    if [ -n "$package" ] && line=$(dpkg-query -W -f='dpkg ${Package} ${Version}\n' "$package" 2>/dev/null); then
        say package "$line"
        # the toolkit's release is its meta packages' version (cuda-nvcc is 13.0.88 in 13.0.1 and 13.0.2)
        dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\n' "cuda-toolkit-${package#cuda-nvcc-}" \
                "cuda-compiler-${package#cuda-nvcc-}" 2>/dev/null |
            while read -r status line; do
                if [ "$status" = ii ]; then say package "dpkg-release $line"; fi
            done
    fi
    if command -v rpm >/dev/null 2>&1; then
        rpm -qf --qf 'rpm %{NAME} %{VERSION}-%{RELEASE}\n' "$nvcc" 2>/dev/null |
            while IFS= read -r line; do
                case $line in rpm\ *) say package "$line" ;; esac
            done
    fi
    # a toolkit assembled from NVIDIA's pip wheels keeps their dist-info beside bin/
    for dist in "$CUDA"/dist-info/nvidia_cuda_nvcc-*.dist-info; do
        [ -d "$dist" ] || continue
        line=${dist##*/nvidia_cuda_nvcc-}
        say package "wheel nvidia-cuda-nvcc ${line%.dist-info}"
    done
}

toolkit_path() {
    resolve "$CUDA"
    if [ -n "$resolved" ]; then say toolkit_path "$resolved"; fi
}

active_release() {
    [ -d "$VENV" ] || return
    local venv dir name site records=() line
    resolve "$VENV"
    venv=$resolved
    [ -n "$venv" ] || return
    say venv "$venv"
    if [ -L "$VENV" ]; then say venv_link "$(readlink -- "$VENV")"; fi
    dir=${venv%/*}
    dir=${dir:-/}
    for name in $RECORDS; do
        if [ -f "$dir/$name" ]; then say record "$dir/$name"; records+=("$name"); fi
    done
    for site in "$venv"/lib/python3*/site-packages; do
        [ -d "$site" ] || continue
        read -r read_digest _ < <(cat -- "$site"/*.dist-info/METADATA "$site"/torch/version.py 2>/dev/null | sha256sum)
        say release_state "$site $(stat -c %Y -- "$site") $read_digest"
    done
    [ ${#records[@]} -gt 0 ] || return 0
    while IFS= read -r line; do
        say release_state "$line"
    done < <(cd -- "$dir" && sha256sum -- "${records[@]}")
}

declare -A property=()
read_unit() {
    local line key
    if [ -d /run/systemd/system ]; then say systemd running; else say systemd "not running"; fi
    unit=$(systemctl show --property="$PROPERTIES" -- "$UNIT" 2>&1 </dev/null)
    unit_rc=$?
    say unit_exit "$unit_rc"
    [ "$unit_rc" = 0 ] || return
    while IFS= read -r line; do
        say unit "$line"
        key=${line%%=*}
        if [ "$key" != "$line" ]; then property[$key]=${line#*=}; fi
    done <<<"$unit"
}

is_secret() {
    local name
    for name in $SECRET_NAMES; do
        if [ "$name" = "$1" ]; then return 0; fi
    done
    return 1
}

service_process() {
    local pid=${property[MainPID]:-} wanted=" $ENV_NAMES " variable name
    pid=${pid%%[!0-9]*}
    [ -n "$pid" ] && [ "$pid" != 0 ] || return
    say pid "$pid"
    say user "$(stat -c %U -- "/proc/$pid")"
    while IFS= read -r -d '' variable; do
        name=${variable%%=*}
        case $wanted in *" $name "*) is_secret "$name" || say env "$variable" ;; esac
    done < "/proc/$pid/environ"
}

# Lines of the unit's text (stdin) holding a value of the secrets file ($1): values of 4+
# characters, quotes stripped. Prints a count, never a value.
secret_values_in() {
    awk -v F="$1" 'BEGIN { while ((getline l < F) > 0) { if (l ~ /^[ \t]*#/) continue; i = index(l, "=");
        if (i == 0) continue; v = substr(l, i + 1); gsub(/^"|"$/, "", v); if (length(v) >= 4) vals[v] = 1 } }
        { for (v in vals) if (index($0, v)) { n++; break } } END { print n + 0 }'
}

# $text: the files' lines, read by the shell; fails when one cannot be read
read_files() {
    local file line
    text=
    for file in "$@"; do
        [ -f "$file" ] && [ -r "$file" ] || return 1
        while IFS= read -r line || [ -n "$line" ]; do text+=$line$'\n'; done < "$file"
    done
}

# The unit as systemd reads it: its fragment and drop-ins (what `systemctl cat` prints).
unit_secrets() {
    local fragment=${property[FragmentPath]:-} pattern line count=0 files
    set -f
    files=(${property[DropInPaths]:-})
    set +f
    if [ -z "$fragment" ] || ! read_files "$fragment" "${files[@]}"; then
        say unit_files unreadable
        return
    fi
    text=${text%$'\n'}
    if [ -n "$SECRET_NAMES" ]; then
        pattern="(^|[ =\"])(${SECRET_NAMES// /|})="
        while IFS= read -r line; do
            if [[ $line =~ $pattern ]]; then count=$((count + 1)); fi
        done <<<"$text"
    fi
    say unit_secret_names "$count"
    if [ -r "$SECRETS_FILE" ]; then
        say unit_secret_values "$(printf '%s\n' "$text" | secret_values_in "$SECRETS_FILE")"
    fi
}

secrets_file() {
    local stat
    if stat=$(stat -c '%a %U %G' -- "$SECRETS_FILE" 2>/dev/null); then
        say secrets_file "$stat"
    else
        say secrets_file absent
    fi
}

device_nodes
toolkit_package
toolkit_path
active_release
read_unit
service_process
unit_secrets
secrets_file
exit 0
