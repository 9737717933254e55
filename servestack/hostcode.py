"""The code the Python host tools share: their output framing and their atomic writes (stdlib only).

The Python side of files/scripts/helpers.sh: `section` prints a facts/framing.py section as helpers.sh's
`section` does, and a file or link is replaced as helpers.sh replaces one, a new one beside it renamed
over it (`move_into_place`, rename(2): readers see the old one or the new one, never a part).

A tool sent to a host travels alone in its command and cannot import this module. It names what it
uses in one line alone at its top level, `from servestack.hostcode import NAME, ...`, which works where
the tool lies (the controller and the tests import servestack) and which servestack/scripts.py replaces
with this file's code when the tool is sent. So this file imports the standard library only, has no
`from __future__` import and uses no name of the tool that includes it.
"""

import os
import sys


def section_text(name, text):
    """`text` as the facts/framing.py section `name`, exit status 0 (facts/framing.py `printed`'s lines)."""
    return "@@servestack begin %s\n%s\n\n@@servestack end %s 0\n" % (name, text, name)


def section(name, text):
    """Print `text` as the facts/framing.py section `name`."""
    sys.stdout.write(section_text(name, text))


def move_into_place(temporary, path):
    """rename(2) `temporary` over `path`: the one rename over a path in host-side Python."""
    os.replace(temporary, path)


def new_file_beside(path, data, mode=0o644):
    """A new file beside `path` holding `data` (bytes), on disk, for `move_into_place`: with `path`'s mode
    (and, as root, its owner) where `path` exists, else `mode`. Its name is `path`.new.PID."""
    temporary = "%s.new.%d" % (path, os.getpid())
    remove_if_there(temporary)  # left by a killed run; and a link there is never written through (O_EXCL)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if os.path.exists(path):
            found = os.stat(path)
            os.chmod(temporary, found.st_mode & 0o7777)
            if os.geteuid() == 0:  # a root deploy must not hand a venv's files to root
                os.chown(temporary, found.st_uid, found.st_gid)
        else:
            os.chmod(temporary, mode)
    except BaseException:
        remove_if_there(temporary)
        raise
    return temporary


def write_atomically(path, data, mode=0o644):
    """Replace the file `path` with `data` (bytes, or text written as UTF-8): readers see the old file or
    the new one. Keeps `path`'s mode and owner where it exists; nothing is left behind on a failure."""
    temporary = new_file_beside(path, data.encode() if isinstance(data, str) else data, mode)
    try:
        move_into_place(temporary, path)
    except BaseException:
        remove_if_there(temporary)
        raise


def point_link(link, target):
    """Point the symlink `link` at `target`: a new link beside it, renamed over it."""
    temporary = "%s.servestack-new.%d" % (link, os.getpid())
    remove_if_there(temporary)
    os.symlink(target, temporary)
    move_into_place(temporary, link)


def remove_if_there(path):
    if os.path.lexists(path):
        os.remove(path)
