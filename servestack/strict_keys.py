"""Strict keys: which host-data keys read as a mistake for a servestack key.

Host data is shared with pyinfra and with the user's own deploys, so a key that is not servestack's
is left alone, except when it reads as a mistake for one (`unknown_key`, `foreign_key_problem`):
  1. it has a servestack prefix (OWN_PREFIXES) but is not a servestack key: `cuda_mirorr`;
  2. it is at most two edits from a servestack key, compared case-insensitively, an edit being an
     insertion, a deletion, a substitution or a swap of two adjacent characters (optimal string
     alignment, the restricted Damerau-Levenshtein distance): `servce_port`, `Service_Port`;
  3. it is a servestack key without its prefix, exactly: `tp`, `port`, `model_path`;
  4. it starts with a prefix people use for servestack's (`sglang_`, `server_`, `svc_`, ... for
     `service_`; `toolkit_` for `cuda_`: PREFIX_ALIASES) and, with servestack's
     prefix put in its place, is at most two edits from a servestack key: `sglang_port`.
  5. it reads as a mistake for one of pyinfra's own keys, which pyinfra ignores without a word
     (`pyinfra_key_problem`): a connector prefix (`ssh_`, `docker_`) on a key that connector does
     not read (`ssh_prot`); an authentication argument without its leading underscore (`sudo`,
     `sudo_user`: pyinfra reads `_sudo`); an underscore key at most two edits (one for a short
     one) from a global argument (`_sduo`).
Any other unknown prefix is the user's own (`db_port`, `app_user`, `backup_path` pass), as are
pyinfra's own keys (its global arguments `_sudo`, `name`, ... and its connectors' `ssh_*`,
`docker_*`). A key of the user's own that trips rule 2-5 (`cpu_count` is one edit from
`gpu_count`) is listed in `servestack_user_keys`.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Iterable

from servestack.keys import OWN_PREFIXES, Key

# Prefixes that stand for one of servestack's in host data people write (rule 4).
PREFIX_ALIASES = {"sglang_": "service_", "sgl_": "service_", "server_": "service_", "serve_": "service_",
                  "svc_": "service_", "srv_": "service_", "toolkit_": "cuda_"}
MAX_EDITS = 2  # rules 2 and 4


def unknown_key(name: str, known: dict[str, Key]) -> str:
    """Rule 1: a key with a servestack prefix that is not a servestack key."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"'{name}': unknown servestack key{hint}; see README 'Host data'"


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    adjacent characters, each one edit (no substring is edited twice)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]


def _without_prefix(key: str) -> str:
    for prefix in sorted(OWN_PREFIXES, key=len, reverse=True):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


@lru_cache(maxsize=1)
def pyinfra_keys() -> frozenset[str]:
    """pyinfra's own host-data keys: its global arguments (`_sudo`, `name`, ...) and the data its
    connectors read (`ssh_user`, `docker_identifier`, ...). Never refused as a servestack typo."""
    names: set[str] = set()
    try:
        from pyinfra.api.arguments import all_global_arguments
        names.update(name for name, _type in all_global_arguments())
    except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover - pyinfra changed
        pass
    try:
        from pyinfra.api.connectors import get_all_connectors
        for connector in get_all_connectors().values():
            names.update(getattr(connector, "data_meta", None) or {})
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - pyinfra changed
        pass
    return frozenset(names)


CONNECTOR_PREFIXES = ("ssh_", "docker_")
# pyinfra's authentication arguments, which host data sets with their leading underscore (`_sudo = True`).
# Only these are refused bare: `env`, `timeout` or `serial` are as likely a user's own names.
AUTH_ARGUMENTS = ("sudo", "sudo_user", "sudo_password", "use_sudo_login", "preserve_sudo_env", "su_user",
                  "su_password", "su_shell", "use_su_login", "preserve_su_env", "doas", "doas_user", "dzdo",
                  "dzdo_user")


def pyinfra_key_problem(name: str) -> str | None:
    """Rule 5: why a key reads as a mistake for one of pyinfra's own keys, or None."""
    keys = pyinfra_keys()
    if name in keys:
        return None
    if name.startswith(CONNECTOR_PREFIXES):
        prefix = name[:name.index("_") + 1]
        distance, near = _nearest(name, [key for key in keys if key.startswith(prefix)])
        hint = f": did you mean {' or '.join(repr(key) for key in near)}?" if distance <= MAX_EDITS else ""
        return (f"'{name}': not a key pyinfra's {prefix[:-1]} connector reads (pyinfra would ignore it){hint} "
                "(a key of your own: list it in servestack_user_keys)")
    if name in AUTH_ARGUMENTS and f"_{name}" in keys:
        return (f"'{name}': pyinfra reads this argument as '_{name}' and would ignore '{name}': did you mean "
                f"'_{name}'? (a key of your own: list it in servestack_user_keys)")
    if name.startswith("_") and not name.startswith("__"):
        distance, near = _nearest(name, [key for key in keys if key.startswith("_")])
        if distance <= (1 if len(name) <= 5 else MAX_EDITS):
            return _did_you_mean(name, f"{distance} edit{'s' if distance > 1 else ''} from pyinfra's "
                                 + " and ".join(f"'{key}'" for key in near), near)
    return None


def _nearest(name: str, known: Iterable[str]) -> tuple[int, list[str]]:
    """The smallest edit distance from `name` to a key of `known` within MAX_EDITS (else more) and
    the keys at that distance."""
    distances = {key: edit_distance(name, key) for key in known if abs(len(key) - len(name)) <= MAX_EDITS}
    best = min(distances.values(), default=MAX_EDITS + 1)
    return best, sorted(key for key, distance in distances.items() if distance == best)


def _did_you_mean(name: str, why: str, keys: list[str]) -> str:
    quoted = ", ".join(f"'{key}'" for key in keys)
    meant = quoted if len(keys) == 1 else f"one of {quoted}"
    return (f"'{name}': unknown key, {why}: did you mean {meant}? "
            "(a key of your own: list it in servestack_user_keys)")


def foreign_key_problem(name: str, known: dict[str, Key] | Iterable[str]) -> str | None:
    """Why a host-data key without a servestack prefix reads as a mistake for a servestack key
    (strict keys, rules 2-4) or for one of pyinfra's (rule 5), or None: the key is the user's (or
    pyinfra's) own."""
    if name in pyinfra_keys():
        return None
    return pyinfra_key_problem(name) or _foreign_key_problem(name, tuple(known))


@lru_cache(maxsize=4096)  # a fleet's hosts share their keys: each name is judged once per manifest
def _foreign_key_problem(name: str, known: tuple[str, ...]) -> str | None:
    folded = name.casefold()
    distance, keys = _nearest(folded, known)
    if distance <= MAX_EDITS:
        why = ("'" + keys[0] + "' in other letter case" if distance == 0 else
               f"{distance} edit{'s' if distance > 1 else ''} from " + " and ".join(f"'{key}'" for key in keys))
        return _did_you_mean(name, why, keys)
    bare = sorted(key for key in known if _without_prefix(key) == name)
    if bare:
        prefixes = sorted({key[:len(key) - len(name)] for key in bare})
        return _did_you_mean(name, "a servestack key without its prefix "
                             + " or ".join(f"'{prefix}'" for prefix in prefixes), bare)
    for alias, prefix in PREFIX_ALIASES.items():
        if folded.startswith(alias):
            distance, keys = _nearest(prefix + folded[len(alias):], known)
            if distance <= MAX_EDITS:
                return _did_you_mean(name, f"'{alias}' reads as servestack's '{prefix}'", keys)
    return None
