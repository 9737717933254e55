# upload-staging.sh prepare REMOTE USER | place REMOTE USER OWNER
#
# A file uploaded over SFTP as the login USER (not root), then put in place as root (run by
# servestack/download.py with the operation's sudo). The staging directory is `.incoming-USER`
# beside REMOTE (same filesystem: placing the file is a rename); the staged file has REMOTE's name.
#
#   prepare REMOTE USER        creates the staging directory (owned by USER, mode 700); when REMOTE
#                              exists and nothing is staged yet, moves REMOTE there (owned by USER),
#                              so that the upload resumes it. Prints the staged file's path.
#   place REMOTE USER OWNER    renames the staged file to REMOTE (helpers.sh `move_into_place`),
#                              chowns it to OWNER (root:root) and removes the staging directory.
# Exit: 0 done; non-zero with the reason on stderr.
set -eu
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='upload-staging.sh prepare REMOTE USER | place REMOTE USER OWNER'
case ${1:-} in
    prepare) need_arguments 3 "$@" ;;
    place) need_arguments 4 "$@" ;;
    *) usage "unknown command '${1:-}'" ;;
esac

remote=$2 user=$3
staging=$(dirname -- "$remote")/.incoming-$user
staged=$staging/$(basename -- "$remote")

case $1 in
    prepare)
        mkdir -p -- "$staging"
        chown -- "$user" "$staging"
        chmod 700 -- "$staging"
        if [ -f "$remote" ] && [ ! -f "$staged" ]; then
            mv -- "$remote" "$staged"
            chown -- "$user" "$staged"
        fi
        printf '%s\n' "$staged"
        ;;
    place)
        move_into_place "$staged" "$remote"
        chown -- "$4" "$remote"
        rmdir -- "$staging"
        ;;
esac
