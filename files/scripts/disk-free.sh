# disk-free.sh PATH...
#
# Free space for each PATH, measured on its nearest existing ancestor's filesystem. Prints
# `diskpath PATH` for each PATH, then `dfall`, df's header and one `df -B1 --output=target,avail,size`
# line per PATH, in order; when that one df call fails, `disk PATH<TAB><df line>` (or `diskerr PATH`)
# path by path instead. Exit 0 (facts/host.py DiskSpace parses it); 2 without a PATH (a usage line).
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='disk-free.sh PATH...'
need_arguments 1 "$@"
parents=()
for path in "$@"; do
    printf 'diskpath %s\n' "$path"
    p=$path
    while [ ! -e "$p" ] && [ "$p" != / ]; do p=${p%/*}; p=${p:-/}; done
    parents+=("$p")
done
if out=$(df -B1 --output=target,avail,size "${parents[@]}" 2>/dev/null); then
    printf 'dfall\n%s\n' "$out"
    exit 0
fi
i=0
for path in "$@"; do
    line=$(df -B1 --output=target,avail,size "${parents[$i]}" 2>/dev/null | tail -n 1)
    if [ -n "$line" ]; then printf 'disk %s\t%s\n' "$path" "$line"; else printf 'diskerr %s\n' "$path"; fi
    i=$((i + 1))
done
exit 0
