"""What the host says about the SGLang service: the active release, the unit's state, servestack's record.

Every command here succeeds when the thing it looks at is absent (an unknown unit, a missing
record, a venv path that is not a link yet): absence is a value, not an error.
"""

from __future__ import annotations

import hashlib
import json
import shlex

from pyinfra.api import FactBase
from pyinfra.facts.server import Users

from servestack.paths import PATCH_RECORDS

# Properties read from `systemctl show`; the restart decision, the verification checks (the unit's
# files: fragment and drop-ins) and the tests use them.
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "UnitFileState",
                   "NeedDaemonReload", "FragmentPath", "DropInPaths", "InvocationID", "Result")
# The Result of a unit systemd stopped restarting: its StartLimitBurst was reached (systemd.unit(5),
# StartLimitIntervalSec=; `Result` values in org.freedesktop.systemd1(5)).
GAVE_UP = "start-limit-hit"


def gave_up_text(unit: str) -> str:
    """How verify and status name a unit systemd gave up on."""
    return (f"systemd gave up on {unit} (Result={GAVE_UP}): its server kept exiting until the unit's "
            "StartLimitBurst was reached; see `journalctl -u " + unit + "`, then re-run the deploy")


class PatchsetDigest(FactBase):
    """
    sha256 over a release's patch-set record(s), or None when the release has none.

    The patches step records the set it applied in ``<release>/patches.json`` (docs/design.md);
    its operation's default is ``<release>/venv/servestack-patches.json``: both are read, so a
    change in either is a patch-set change.

    + release_dir: the release's directory
    """

    def command(self, release_dir: str) -> str:
        files = " ".join(shlex.quote(f"{release_dir}/{name}") for name in PATCH_RECORDS)
        return f"for f in {files}; do if [ -f \"$f\" ]; then sha256sum \"$f\"; fi; done"

    def process(self, output):
        return combine_digests(output)



def combine_digests(lines: list[str]) -> str | None:
    entries = [line.split()[0] for line in lines if line.strip()]
    if not entries:
        return None
    if len(entries) == 1:
        return entries[0]
    return hashlib.sha256(" ".join(entries).encode()).hexdigest()


def show_command(unit: str) -> str:
    """`systemctl show` of a unit's UNIT_PROPERTIES (stdin closed: it may run inside a batch)."""
    return f"systemctl show --property={','.join(UNIT_PROPERTIES)} -- {shlex.quote(unit)} </dev/null"


class UnitState(FactBase):
    """
    `systemctl show` properties of a unit, as a dict; ``{"SystemdRunning": "no"}`` where systemd
    is not the init system (containers, some cloud images).

    An unknown unit reports ``LoadState=not-found`` and ``ActiveState=inactive``; a failing
    `systemctl show` reads as ``{}``.

    + unit: the unit's name
    """

    def command(self, unit: str) -> str:
        return (f"if [ -d /run/systemd/system ]; then {show_command(unit)} 2>/dev/null || true; "
                "else echo SystemdRunning=no; fi")

    def process(self, output):
        return parse_properties(output)

    @staticmethod
    def default() -> dict:
        return {}


def parse_properties(lines: list[str]) -> dict[str, str]:
    values = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


class ServiceRecord(FactBase):
    """
    servestack's record of the last unit that passed the health gate (a JSON object), or None.

    + path: the record's file
    """

    def command(self, path: str) -> str:
        return f"cat {shlex.quote(path)} 2>/dev/null || true"

    def process(self, output):
        return parse_record(output)


def parse_record(lines: list[str]) -> dict | None:
    try:
        record = json.loads("\n".join(lines))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class UserAccount(Users):
    """
    pyinfra's ``Users`` fact for one user: ``{user: {"home", "shell", "comment", "group", "groups", ...}}``
    or ``{}``. Same parser; reads one passwd entry instead of running ``id`` and ``lastlog`` for
    every account on the host.

    + user: the user's name
    """

    # pyinfra gives each fact's command that fact's own arguments (FactBase.command is Callable[..., ...]), but
    # types Users.command with none: mypy reads this one, with the user, as an incompatible override
    def command(self, user: str) -> str:  # type: ignore[override]
        quoted = shlex.quote(user)
        # `id -Gn` lists the primary group first: one `id` answers both (pyinfra runs `id -gn` too)
        return (f"ENTRY=$(getent passwd {quoted}); if [ -n \"$ENTRY\" ]; then G=$(id -Gn {quoted}); "
                f"echo \"$ENTRY|${{G%% *}}|$G||\"; fi; true")


class PathOwner(FactBase):
    """
    Owner name and octal mode of a path, as ``{"owner": "sglang", "mode": "750"}``, or None.

    + path: the path
    """

    def command(self, path: str) -> str:
        return f"stat -c '%U %a' -- {shlex.quote(path)} 2>/dev/null || true"

    def process(self, output):
        fields = output[0].split() if output else []
        return {"owner": fields[0], "mode": fields[1]} if len(fields) == 2 else None


class UnreadableBy(FactBase):
    """
    Which of `paths` an existing `user` cannot read (a list; empty when the user does not exist yet).

    + user: the user's name
    + paths: the paths to check
    """

    def command(self, user: str, paths: list[str]) -> str:
        quoted_user = shlex.quote(user)
        checks = " ".join(shlex.quote(path) for path in paths)
        return (f"if id -u {quoted_user} >/dev/null 2>&1; then for p in {checks}; do "
                f"runuser -u {quoted_user} -- test -r \"$p\" || echo \"$p\"; done; fi")

    def process(self, output):
        return [line for line in output if line.strip()]

    @staticmethod
    def default() -> list:
        return []
