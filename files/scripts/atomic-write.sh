# atomic-write.sh PATH MODE  (CONTENT in the environment)
#
# Writes $CONTENT (and a final newline unless it ends with one) to PATH atomically: into a
# temporary file in PATH's directory (created if missing, mode 755), chmod MODE, then rename(2)
# over PATH. Readers see the old file or the new one, never a part.
# Exit: 0 written; non-zero with the reason on stderr (PATH untouched).
set -eu
path=$1 mode=$2
dir=$(dirname -- "$path")
mkdir -p -m 755 -- "$dir"
tmp=$(mktemp "$path.tmp.XXXXXX")
trap 'rm -f -- "$tmp"' EXIT
case $CONTENT in
    *$'\n') printf '%s' "$CONTENT" > "$tmp" ;;
    *) printf '%s\n' "$CONTENT" > "$tmp" ;;
esac
chmod "$mode" -- "$tmp"
mv -fT -- "$tmp" "$path"
trap - EXIT
