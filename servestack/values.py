"""Value checkers for host data and the manifest's defaults.

Each checker takes a raw value and returns it normalised, or raises Invalid("expected ...").
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Callable

from packaging.version import InvalidVersion, Version

Checker = Callable[[Any], Any]
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


class Invalid(ValueError):
    """A value does not fit its key; the message says what was expected."""


def expectation(check: Checker) -> str:
    """What a checker expects, in its own words."""
    try:
        check(object())
    except Invalid as problem:
        return str(problem)
    return "a value"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(minimum: int = 0, maximum: int | None = None) -> Checker:
    def check(value):
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            bound = f" from {minimum} to {maximum}" if maximum is not None else f" >= {minimum}"
            raise Invalid(f"an integer{bound}")
        return value
    return check


def boolean(value):
    if not isinstance(value, bool):
        raise Invalid("true or false")
    return value


def text(value):
    if not isinstance(value, str) or not value.strip():
        raise Invalid("a non-empty string")
    return value


def abs_path(value):
    if not isinstance(value, str) or not value.startswith("/") or CONTROL_CHARACTERS.search(value):
        raise Invalid("an absolute path")
    return value.rstrip("/") or "/"


def word(value):
    """One word of the service's command line: no whitespace or control characters."""
    if not isinstance(value, str) or not value or re.search(r"\s", value) or CONTROL_CHARACTERS.search(value):
        raise Invalid("a non-empty string without whitespace or control characters")
    return value


def module_name(value):
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value, re.ASCII):
        raise Invalid("a python module name like sglang.launch_server")
    return value


def host_address(value):
    if isinstance(value, str) and (_is_ip_address(value) or re.fullmatch(r"[A-Za-z0-9.-]+", value)):
        return value
    raise Invalid("an IP address or host name")


def _is_ip_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def url(value):
    if not isinstance(value, str) or not re.match(r"^(https?|file)://\S+$", value):
        raise Invalid("an http(s):// or file:// URL")
    return value


def optional(check: Checker) -> Checker:
    def check_optional(value):
        return None if value is None else check(value)
    return check_optional


def fraction(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise Invalid("a fraction from 0 to below 1, like 0.02 for 2%")
    return float(value)


def levels(value):
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(level) and 1 <= level <= 1024
                                                                    for level in value):
        raise Invalid("a non-empty list of concurrency levels from 1 to 1024, like [1, 4, 16]")
    return tuple(value)


def choice(*options: str) -> Checker:
    def check(value):
        if value not in options:
            raise Invalid("one of " + ", ".join(repr(option) for option in options))
        return value
    return check


def capability(value):
    if not isinstance(value, str) or not re.fullmatch(r"\d+\.\d+", value):
        raise Invalid("a compute capability string like '12.0'")
    return value


def version(value):
    try:
        Version(value)
    except (InvalidVersion, TypeError):
        raise Invalid("a version string like '13.0.1'") from None
    return value


def unit_name(value):
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9:_.@-]+\.service", value):
        raise Invalid("a systemd unit name ending in .service")
    return value


def user_name(value):
    if not isinstance(value, str) or not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", value):
        raise Invalid("a system user name like 'sglang'")
    return value


def env_map(value):
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and _env_value(v)
        for k, v in value.items()
    ):
        raise Invalid("a dict of environment variable names to single-line string values")
    return {k: str(v) for k, v in value.items()}


def _env_value(value) -> bool:
    """A string without control characters, or an integer (not a bool: True would reach the service
    as the text 'True')."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and not CONTROL_CHARACTERS.search(value))


def string_list(value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise Invalid("a list of strings")
    return tuple(value)


def release_name(value):
    if not isinstance(value, str) or not re.fullmatch(r"r-[0-9a-f]{12}|adopted-\d{8}T\d{6}Z", value):
        raise Invalid("a release id like 'r-0123456789ab' or 'adopted-20260101T120000Z'")
    return value


def arguments(value):
    items = string_list(value)
    if not all(item and not CONTROL_CHARACTERS.search(item) for item in items):
        raise Invalid("a list of non-empty arguments without control characters")
    return items


def env_names(value):
    """Environment variable names, each once (a name listed twice is one variable)."""
    names = string_list(value)
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name in names):
        raise Invalid("a list of environment variable names like ['HF_TOKEN']")
    return tuple(dict.fromkeys(names))


def commit(value):
    """A git commit of a Hugging Face repository: 40 lowercase hex digits, never a branch or a tag (a
    branch moves: two hosts, or one host on two days, would serve different weights)."""
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{40}", value):
        raise Invalid("a commit of the model's repository: 40 lowercase hex digits (never a branch such as 'main')")
    return value


def repository_id(value):
    """A Hugging Face repository id, 'org/name'."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value) or ".." in value:
        raise Invalid("a Hugging Face repository id like 'nvidia/Kimi-K2.5-NVFP4'")
    return value


def env_name(value):
    """The name of an environment variable of the control machine."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise Invalid("the name of an environment variable of the control machine, like 'HF_TOKEN'")
    return value
