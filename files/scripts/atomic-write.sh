# atomic-write.sh PATH MODE  (CONTENT in the environment)
#
# Writes $CONTENT (and a final newline unless it ends with one) to PATH atomically, mode MODE:
# helpers.sh `write_atomically`, in PATH's directory (created if missing, mode 755). Readers see
# the old file or the new one, never a part.
# Exit: 0 written; non-zero with the reason on stderr (PATH untouched).
set -u
source "${BASH_SOURCE[0]%/*}/helpers.sh"
path=$1 mode=$2
mkdir -p -m 755 -- "$(dirname -- "$path")" || exit 1
write_atomically "$path" "$CONTENT" "$mode"
