# secrets-file.sh stage PATH | place PATH UPLOAD_DIR | remove PATH  (run as root)
#
# The SGLang service's secrets file (operations/service.py `secrets_file`), written so that its
# content is never on a command line and never readable by anyone but root, not even for a
# moment. The content travels by SFTP (pyinfra's file upload) between `stage` and `place`:
#
#   stage PATH              creates PATH's directory (root, 0700) and an empty staging file
#                           PATH.servestack-new (root, 0600): the upload writes into that file,
#                           which keeps its owner and mode
#   place PATH UPLOAD_DIR   renames the staging file over PATH (helpers.sh `move_into_place`:
#                           readers see the old file or the new one) and removes UPLOAD_DIR,
#                           the private directory the upload went through
#   remove PATH             deletes PATH and any staging file left by an interrupted write
#
# Exit: 0 done; non-zero with the reason on stderr. Nothing of the content is ever printed.
set -eu
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='secrets-file.sh stage PATH | place PATH UPLOAD_DIR | remove PATH  (run as root)'
case ${1:-} in
    stage|remove) need_arguments 2 "$@" ;;
    place) need_arguments 3 "$@" ;;
    *) usage "unknown command '${1:-}'" ;;
esac

path=$2
staging=$path.servestack-new

case $1 in
    stage)
        install -d -m 700 -o root -g root -- "$(dirname -- "$path")"
        rm -f -- "$staging"
        install -m 600 -o root -g root /dev/null "$staging"
        ;;
    place)
        [ -f "$staging" ] || { echo "secrets-file.sh: nothing staged at $staging" >&2; exit 1; }
        chmod 600 -- "$staging"
        move_into_place "$staging" "$path"
        rm -rf -- "$3"
        ;;
    remove)
        rm -f -- "$path" "$staging"
        ;;
esac
