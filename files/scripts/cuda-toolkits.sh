# cuda-toolkits.sh state INSTALL_PATH LINK_PATH STATE_DIR [KEEP_PATH...] -- [FILE...] | fingerprint PATH
#
# What facts/toolkit.py reads of a host's CUDA toolkits. Reads only. `state` runs on every
# converge, twice (CudaToolkits, at prepare and at execute) and `fingerprint` once per kept
# toolkit (ToolkitFingerprint, in the verify step): both use builtins where a program would do the
# same, since every program started is host CPU on every converge.
#
# state: the lines `parse_toolkits` reads:
#   arch X                      uname -m
#   tree_*                      the tree at INSTALL_PATH (see tree below)
#   keep 0|1 PATH               per KEEP_PATH: 1 when it is a directory
#   hop LINK -> TARGET          per symlink hop from LINK_PATH (at most 16), then
#   link_kind K                 dangling | link | directory | file | absent, and unless absent
#   link_resolved PATH          LINK_PATH resolved (readlink -f)
#   record JSON / marker JSON   STATE_DIR/toolkits.json / toolkit-install.json on one line, when
#                               they are files
#   file SIZE MTIME INODE PATH  per FILE that is a file, else `nofile PATH`
#
# fingerprint: `fp_absent` when PATH is not a directory; otherwise `fp_present`, the nvcc lines
# (`fp_nvcc_exit N`, `fp_nvcc LINE`...), `fp_version_json JSON` when there is one,
# `fp_files N SHA256`: the number of entries under PATH and the sha256 of their sorted list
# (`f<TAB>path<TAB>size`, `l<TAB>path<TAB>target`, `<type><TAB>path`, one a line, then a newline),
# and `fp_mtimes SHA256`: the sha256 of the sorted list of the files' modification times
# (`t<TAB>path<TAB>seconds.fraction`, find's %T@, one a line, then a newline), which sees a file
# rewritten with its size unchanged.
#
# Exit: 0 (what is absent is reported as absent); 2 for an unknown action.
set -u

source "${BASH_SOURCE[0]%/*}/helpers.sh"

# `KEY TEXT`: the file $2's text on one line
one_line() { join_lines "$2"; printf '%s %s\n' "$1" "$joined"; }

# PREFIX_nvcc_exit and PREFIX_nvcc lines of `DIR/bin/nvcc --version`, when there is one
nvcc_lines() {
    local prefix=$1 nvcc=$2/bin/nvcc out rc line
    [ -e "$nvcc" ] || return 0
    out=$("$nvcc" --version 2>&1)
    rc=$?
    echo "${prefix}_nvcc_exit $rc"
    while IFS= read -r line; do echo "${prefix}_nvcc $line"; done <<<"$out"
}

# The toolkit tree at $1: tree_symlink, tree_empty|tree_exists, the nvcc lines, tree_version_json
# or (no version.json, dpkg owns bin/nvcc) tree_dpkg; tree_exists + tree_nvcc_exit 127 for a path
# that is not a directory; tree_absent.
tree() {
    local path=$1 entry state=tree_empty
    if [ -L "$path" ]; then echo "tree_symlink $(readlink -- "$path")"; fi
    if [ -d "$path" ]; then
        for entry in "$path"/* "$path"/.[!.]* "$path"/..?*; do
            if [ -e "$entry" ] || [ -L "$entry" ]; then state=tree_exists; break; fi
        done
        echo "$state"
        nvcc_lines tree "$path"
        if [ -f "$path/version.json" ]; then
            one_line tree_version_json "$path/version.json"
        else
            dpkg_owner "$path/bin/nvcc"
            if [ -n "$owner" ]; then echo "tree_dpkg $owner"; fi
        fi
    elif [ -e "$path" ]; then
        echo tree_exists
        echo "tree_nvcc_exit 127"
    else
        echo tree_absent
    fi
}

link_chain() {
    local link=$1 path=$1 target hops=0 kind
    while [ -L "$path" ] && [ "$hops" -lt 16 ]; do
        target=$(readlink -- "$path")
        echo "hop $path -> $target"
        case $target in /*) path=$target ;; *) path=${path%/*}/$target ;; esac
        hops=$((hops + 1))
    done
    if [ -L "$link" ] && [ ! -e "$link" ]; then kind=dangling
    elif [ -L "$link" ]; then kind=link
    elif [ -d "$link" ]; then kind=directory
    elif [ -e "$link" ]; then kind=file
    else kind=absent
    fi
    echo "link_kind $kind"
    if [ -e "$link" ]; then resolve "$link"; echo "link_resolved $resolved"; fi
}

# `file SIZE MTIME INODE PATH` or `nofile PATH`, in the order given: one stat for all the files
file_stats() {
    local path present=()
    for path in "$@"; do
        if [ -f "$path" ]; then present+=("$path"); fi
    done
    declare -A stats=()
    if [ ${#present[@]} -gt 0 ]; then
        local size mtime inode name
        while IFS=' ' read -r size mtime inode name; do
            stats[$name]="$size $mtime $inode"
        done < <(stat -c '%s %Y %i %n' -- "${present[@]}")
    fi
    for path in "$@"; do
        if [ -n "${stats[$path]+set}" ]; then echo "file ${stats[$path]} $path"; else echo "nofile $path"; fi
    done
}

state() {
    local install=$1 link=$2 state_dir=${3%/} keep
    shift 3
    echo "arch $(uname -m)"
    tree "$install"
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        if [ -d "$1" ]; then keep=1; else keep=0; fi
        echo "keep $keep $1"
        shift
    done
    [ $# -gt 0 ] && shift
    link_chain "$link"
    if [ -f "$state_dir/toolkits.json" ]; then one_line record "$state_dir/toolkits.json"; fi
    if [ -f "$state_dir/toolkit-install.json" ]; then one_line marker "$state_dir/toolkit-install.json"; fi
    file_stats "$@"
}

fingerprint() {
    local path=$1 found lines entries text digest IFS
    if [ ! -d "$path" ]; then echo fp_absent; return; fi
    echo fp_present
    nvcc_lines fp "$path"
    if [ -f "$path/version.json" ]; then one_line fp_version_json "$path/version.json"; fi
    # one walk for both lists: a file's `t` line sorts after every entry line (find's types: b c d f l p s D)
    found=$(find "$path/" -mindepth 1 \( -type f -printf 'f\t%P\t%s\nt\t%P\t%T@\n' \) \
        -o \( -type l -printf 'l\t%P\t%l\n' \) -o -printf '%y\t%P\n' | LC_ALL=C sort)
    # the lines, split by the shell's own word splitting (no line is empty)
    IFS=$'\n'
    set -f
    lines=($found)
    set +f
    first_time_line
    printf -v text '%s\n' "${lines[@]:0:entries}"
    digest=$(sha256sum <<<"${text%$'\n'}")
    echo "fp_files $entries ${digest%% *}"
    printf -v text '%s\n' "${lines[@]:entries}"
    digest=$(sha256sum <<<"${text%$'\n'}")
    echo "fp_mtimes ${digest%% *}"
}

# entries: the index of the first `t` line of the sorted `lines` (their count when none), by bisection
first_time_line() {
    local low=0 high=${#lines[@]} middle
    while [ "$low" -lt "$high" ]; do
        middle=$(( (low + high) / 2 ))
        if [[ ${lines[middle]} == t$'\t'* ]]; then high=$middle; else low=$((middle + 1)); fi
    done
    entries=$low
}

USAGE='cuda-toolkits.sh state INSTALL_PATH LINK_PATH STATE_DIR [KEEP_PATH...] -- [FILE...] | fingerprint PATH'
case ${1:-} in
state) need_arguments 4 "$@"; shift; state "$@" ;;
fingerprint) need_arguments 2 "$@"; fingerprint "$2" ;;
*) usage "unknown action '${1:-}'" ;;
esac
exit 0
