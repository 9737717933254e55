"""The memo of a host read: its answer, kept on the host while nothing it read has changed (stdlib only).

Some reads give the same answer on every converge of a converged host but cost a Python start and
its imports each time: the patch check (servestack/patchlib.py) and the ML environment's state
(files/scripts/ml_env.py `state`). Their answer depends only on what they were sent (keyed by a
digest) and on the files and directories they read. The host-side code names those paths; `text`
writes them with their state (inode, size, mtime, ctime, as `stat -L -c STAT` prints them) above the
answer; an operation keeps that memo on the host (`write_command`), and the fact's shell (`reader`)
prints the kept answer while `stat` still shows exactly that state: builtins but for one `stat` and
one `cat`. Like git's index, an input changed within a second of the read is "racily clean" (its
ctime may not tell a later change apart): no memo then.

One source, two places: the facts build their shell with `reader` / `write_command` on the control
machine, and ship this file's text to the host beside the code that reads (patchlib's engine,
ml_env.py), which calls `text`. So it imports nothing beyond os and json at the top (shlex only in
the control-machine functions), and runs on any python3 a host has.
"""

import json
import os

STAT = "%i %s %.9Y %.9Z %n"
RACY_NS = 1000000000


def stamp(ns):
    """Nanoseconds since the epoch as `stat`'s `%.9Y` prints them."""
    return "%d.%09d" % (ns // 1000000000, ns % 1000000000)


def text(header, answer, inputs, started_ns):
    """The memo of `answer`: `header` (the kind of read and its digest), `P path` (present) /
    `A path` (absent) lines, `S stat` lines, `R <length of the answer>`, then the answer (JSON, one
    line of ASCII); None when an input cannot be kept this way (a dangling link, unreadable, or
    changed since `started_ns` - RACY_NS)."""
    present, absent, stats = [], [], []
    for path in inputs:
        if "\n" in path or "\n" in header:
            return None
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # what `[ -e path ]` calls absent
            if os.path.islink(path):
                return None
            absent.append("A " + path)
            continue
        except OSError:
            return None
        if min(st.st_mtime_ns, st.st_ctime_ns) < 0 or max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns - RACY_NS:
            return None
        present.append("P " + path)
        stats.append("S %d %d %s %s %s" % (st.st_ino, st.st_size, stamp(st.st_mtime_ns), stamp(st.st_ctime_ns), path))
    if not present:
        return None
    line = json.dumps(answer)  # ASCII: its length is what the shell counts whatever the locale
    return "\n".join([header] + present + absent + stats + ["R %d" % len(line), line]) + "\n"


def source():
    """This module's text, as the facts ship it to hosts."""
    with open(__file__) as handle:
        return handle.read()


# --- control machine -------------------------------------------------------------------------------

def reader(path, header):
    """Shell that prints the answer of the memo at `path` when its first line is `header` and every
    input still has the state it had (`stat -L`), and fails otherwise (no memo, another digest, a
    garbled or cut file: the answer must have the length the memo gives); builtins but for one
    `stat` and one `cat`."""
    from shlex import quote
    return (
        "m=%s; [ -r \"$m\" ] && { IFS= read -r l && [ \"$l\" = %s ] && set -- && s= && ok=1 && "
        "while IFS= read -r l && [ \"${l%%%% *}\" != R ]; do case $l in "
        "\"P \"*) set -- \"$@\" \"${l#P }\" ;; "
        "\"A \"*) if [ -e \"${l#A }\" ] || [ -L \"${l#A }\" ]; then ok=; fi ;; "
        "\"S \"*) s=\"$s${s:+\n}${l#S }\" ;; "
        "*) ok= ;; esac; done && [ \"${l%%%% *}\" = R ] && [ -n \"$ok\" ] && [ $# -gt 0 ] && "
        "[ \"$(stat -L -c %s -- \"$@\" 2>/dev/null)\" = \"$s\" ] && a=$(cat) && [ \"${#a}\" = \"${l#R }\" ] && "
        "printf '%%s\\n' \"$a\"; } < \"$m\""
    ) % (quote(path), quote(header), quote(STAT))


def write_command(path, memo):
    """Keep `memo` at `path` (atomically, umask 022) if it still holds where it is written: a memo
    whose inputs changed since the read (a later step of the same run changed them) is dropped, so
    a kept memo never describes an older state. Exits 0 either way (not writing it is no failure)."""
    from shlex import quote
    temporary = path + ".tmp"
    return ("umask 022 && printf '%%s' %s > %s && if %s >/dev/null; then mv -f %s %s; else rm -f %s; fi"
            % (quote(memo), quote(temporary), reader(temporary, memo.split("\n", 1)[0]), quote(temporary),
               quote(path), quote(temporary)))
