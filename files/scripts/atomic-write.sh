# atomic-write.sh PATH MODE [SOURCE]  (CONTENT in the environment, without SOURCE)
#
# Writes $CONTENT (and a final newline unless it ends with one) to PATH atomically, mode MODE:
# helpers.sh `write_atomically`, in PATH's directory (created if missing, mode 755). With SOURCE,
# copies the file SOURCE there instead, byte for byte (`copy_atomically`). Readers see the old file
# or the new one, never a part.
# Exit: 0 written; non-zero with the reason on stderr (PATH untouched).
set -u
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='atomic-write.sh PATH MODE [SOURCE]  (CONTENT in the environment, without SOURCE)'
need_arguments 2 "$@"
(( $# >= 3 )) || need_env CONTENT
path=$1 mode=$2
mkdir -p -m 755 -- "$(dirname -- "$path")" || exit 1
if [ $# -ge 3 ]; then
    copy_atomically "$3" "$path" "$mode"
else
    write_atomically "$path" "$CONTENT" "$mode"
fi
