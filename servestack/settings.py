"""Per-host settings: the manifest's defaults with the host's (and its groups') data applied.

Every servestack host-data key is declared in `host_keys()` with its type, its default (read
from the manifest) and what it means. `validate_inventory` checks every host before any
connection and refuses, in one message, every unknown key, wrong type or inconsistent value,
naming the host, the key and what was expected. Operations call `host_settings(host)`.

Strict keys. Host data is shared with pyinfra and with the user's own deploys, so a key that is
not servestack's is left alone, except when it reads as a mistake for one (`foreign_key_problem`):
  1. it has a servestack prefix (OWN_PREFIXES) but is not a servestack key: `cuda_mirorr`;
  2. it is at most two edits from a servestack key, compared case-insensitively, an edit being an
     insertion, a deletion, a substitution or a swap of two adjacent characters (optimal string
     alignment, the restricted Damerau-Levenshtein distance): `servce_port`, `Service_Port`;
  3. it is a servestack key without its prefix, exactly: `tp`, `port`, `model_path`;
  4. it starts with a prefix people use for servestack's (`sglang_`, `server_`, `svc_`, ... for
     `service_`; `toolkit_` for `cuda_`: PREFIX_ALIASES) and, with servestack's
     prefix put in its place, is at most two edits from a servestack key: `sglang_port`.
Any other unknown prefix is the user's own (`db_port`, `app_user`, `backup_path` pass), as are
pyinfra's own keys (its global arguments `_sudo`, `name`, ... and its connectors' `ssh_*`,
`docker_*`). A key of the user's own that trips rule 2-4 (`cpu_count` is one edit from
`gpu_count`) is listed in `servestack_user_keys`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable
from weakref import WeakKeyDictionary

from packaging.version import InvalidVersion, Version

from servestack.errors import ConfigError, ManifestError
from servestack.hostrun import real_host
from servestack.manifest import DEFAULT_MANIFEST, Manifest, Package, Runfile, load_manifest

# Host-data keys starting with these belong to servestack: an unknown one is an error, not ignored.
OWN_PREFIXES = ("servestack_", "cuda_", "gpu_", "uv_", "venv_", "service_", "index_",
                "wheel_url_", "rollout_", "patches_", "verify_")

# Prefixes that stand for one of servestack's in host data people write (strict keys, rule 4).
PREFIX_ALIASES = {"sglang_": "service_", "sgl_": "service_", "server_": "service_", "serve_": "service_",
                  "svc_": "service_", "srv_": "service_", "toolkit_": "cuda_"}
MAX_EDITS = 2  # strict keys, rules 2 and 4

SPECULATIVE_ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN", "STANDALONE", "NONE")


class Invalid(ValueError):
    """A value does not fit its key; the message says what was expected."""


@dataclass(frozen=True)
class Key:
    """One host-data key: its checker turns raw data into a value or raises Invalid."""

    name: str
    check: Callable[[Any], Any]
    default: Callable[[Manifest], Any]
    help: str


# Checkers: each returns the normalised value or raises Invalid("expected ...").

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(minimum: int = 0, maximum: int | None = None) -> Callable:
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
    if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
        raise Invalid("an absolute path")
    return value.rstrip("/") or "/"


def url(value):
    if not isinstance(value, str) or not re.match(r"^(https?|file)://\S+$", value):
        raise Invalid("an http(s):// or file:// URL")
    return value


def optional(check: Callable) -> Callable:
    def check_optional(value):
        return None if value is None else check(value)
    return check_optional


def choice(*options: str) -> Callable:
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
        isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and isinstance(v, (str, int))
        for k, v in value.items()
    ):
        raise Invalid("a dict of environment variable names to string values")
    return {k: str(v) for k, v in value.items()}


def string_list(value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise Invalid("a list of strings")
    return tuple(value)


def release_name(value):
    if not isinstance(value, str) or not re.fullmatch(r"r-[0-9a-f]{12}|adopted-\d{8}T\d{6}Z", value):
        raise Invalid("a release id like 'r-0123456789ab' or 'adopted-20260101T120000Z'")
    return value


def env_names(value):
    names = string_list(value)
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name in names):
        raise Invalid("a list of environment variable names like ['HF_TOKEN']")
    return names


def user_key_names(value):
    names = string_list(value)
    for name in names:
        if name.startswith(OWN_PREFIXES):
            raise Invalid(f"keys of your own, without a servestack prefix ({name!r} has one)")
    return names


def _literal(value) -> Callable[[Manifest], Any]:
    return lambda manifest: value


def _from(section: str, name: str) -> Callable[[Manifest], Any]:
    return lambda manifest: getattr(manifest, section)[name]


def _index_key(name: str) -> str:
    return f"index_{name}_url"


def _wheel_key(package: str) -> str:
    return "wheel_url_" + re.sub(r"[-_.]+", "_", package).lower()


_SERVICE_KEYS = {  # name: (checker, meaning); defaults are the manifest's [service] table
    "name": (unit_name, "systemd unit name"),
    "user": (user_name, "unprivileged system user the server runs as (created by the deploy)"),
    "launch_module": (text, "python module the unit runs with -m"),
    "model_path": (text, "--model-path: a local path or a hub id"),
    "draft_model_path": (text, "--speculative-draft-model-path (the EAGLE-3 draft)"),
    "tp": (integer(1, 64), "--tp: tensor-parallel size; must divide gpu_count"),
    "speculative_algorithm": (choice(*SPECULATIVE_ALGORITHMS), "--speculative-algorithm ('NONE': no speculation)"),
    "speculative_num_steps": (integer(1, 16), "--speculative-num-steps"),
    "speculative_eagle_topk": (integer(1, 16), "--speculative-eagle-topk"),
    "speculative_num_draft_tokens": (integer(1, 64), "--speculative-num-draft-tokens (steps + 1 when topk is 1)"),
    "attention_backend": (text, "--attention-backend"),
    "host": (text, "--host the server listens on"),
    "port": (integer(1, 65535), "--port"),
    "enable_torch_symm_mem": (boolean, "--enable-torch-symm-mem (SM120 needs patch 0001)"),
    "enable_flashinfer_allreduce_fusion": (boolean, "--enable-flashinfer-allreduce-fusion (no effect on SM120: warned)"),
    "start_timeout_s": (integer(1), "systemd TimeoutStartSec"),
    "health_timeout_s": (integer(1), "seconds a restarted server has to answer /health before it is rolled back"),
}
_VENV_KEYS = {  # defaults are the manifest's [venv] table
    "path": (abs_path, "the stable path of the active environment (a symlink to the active release)"),
    "releases_dir": (abs_path, "where releases (one venv each) are built"),
    "python": (text, "the host's interpreter new venvs are made with"),
    "keep_releases": (integer(1), "releases kept (the active and the previous one are never pruned)"),
    "keep_backups": (integer(1), "environment snapshots kept under servestack_state_dir/backups"),
}


def _expectation(check: Callable) -> str:
    """What a checker expects, in its own words."""
    try:
        check(object())
    except Invalid as problem:
        return str(problem)
    return "a value"


def manifest_problems(manifest: Manifest) -> list[str]:
    """Every problem of the manifest's [venv] and [service] tables, the defaults of the venv_* and
    service_* keys: a missing key, an unknown key or a value its host-data key would refuse."""
    problems = []
    for section, specs in (("venv", _VENV_KEYS), ("service", _SERVICE_KEYS)):
        table = getattr(manifest, section)
        for name, (check, _meaning) in specs.items():
            where = f"{manifest.path}: key '{section}.{name}'"
            if name not in table:
                problems.append(f"{where}: expected {_expectation(check)} (missing)")
                continue
            try:
                check(table[name])
            except Invalid as problem:
                problems.append(f"{where}: expected {problem}, got {table[name]!r}")
        problems += [f"{manifest.path}: key '{section}.{name}': expected one of the known keys "
                     f"{sorted(specs)} (unknown key)" for name in table if name not in specs]
    return problems


def check_manifest_defaults(manifest: Manifest) -> None:
    """Raise ManifestError listing every problem `manifest_problems` finds."""
    problems = manifest_problems(manifest)
    if problems:
        raise ManifestError("\n".join(problems))


def host_keys(manifest: Manifest) -> dict[str, Key]:
    """Every servestack host-data key, with defaults from `manifest`; ManifestError when the
    manifest cannot give every default."""
    check_manifest_defaults(manifest)
    keys = [
        Key("servestack_manifest", abs_path, _literal(str(DEFAULT_MANIFEST)),
            "path (on the control machine) of the stack manifest this host uses"),
        Key("servestack_allow_local", boolean, _literal(False),
            "allow targeting the machine pyinfra runs on (@local, localhost)"),
        Key("servestack_state_dir", abs_path, _literal("/var/lib/servestack"),
            "servestack's state on the host: lock, backups, records"),
        Key("servestack_user_keys", user_key_names, _literal(()),
            "host-data keys of your own that look like a mistyped servestack key (e.g. cpu_count, "
            "one edit from gpu_count): never refused as one"),
        Key("cuda_version", version, _from("cuda", "version"),
            "CUDA toolkit version to install; must have a runfile entry in the manifest"),
        Key("cuda_install_path", abs_path, _from("cuda", "install_path"), "where the toolkit installs"),
        Key("cuda_link_policy", choice("keep", "new"), _literal("keep"),
            "'keep': /usr/local/cuda stays where it pointed; 'new': point it at the new toolkit"),
        Key("cuda_cache_dir", abs_path, _literal("/var/cache/servestack"), "runfile cache on the host"),
        Key("cuda_tmpdir", abs_path, _literal("/var/tmp"), "the installer's --tmpdir (needs ~8 GB)"),
        Key("cuda_mirror", optional(url), _literal(None), "base URL of a mirror holding the runfile"),
        Key("cuda_runfile_url", optional(url), _literal(None), "full URL of the runfile (beats cuda_mirror)"),
        Key("cuda_runfile_path", optional(abs_path), _literal(None),
            "a pre-staged runfile already on the host (verified before use)"),
        Key("cuda_existing_toolkit", choice("refuse", "accept"), _literal("refuse"),
            "a toolkit at cuda_install_path that servestack cannot confirm as the manifest's (no "
            "version.json, or owned by a package) but whose nvcc reports the manifest's nvcc version: "
            "'refuse' (default) or 'accept' it as installed (never installed over)"),
        Key("cuda_runfile_from", choice("host", "controller"), _literal("host"),
            "'host': each host downloads; 'controller': download once here and upload (air-gapped)"),
        Key("gpu_compute_capability", capability, _from("gpu", "compute_capability"),
            "compute capability every GPU must report"),
        Key("gpu_count", integer(1, 64), _from("gpu", "count"), "number of GPUs the host must have"),
        Key("uv_index_url", url, lambda m: m.uv["index_url"], "index the host's pip installs uv from"),
        Key("uv_install_dir", abs_path, _literal("/opt/servestack/uv"),
            "venv on the host holding servestack's uv (<dir>/bin/uv), installed if missing"),
        Key("uv_cache_dir", optional(abs_path), _literal(None),
            "uv's cache on the host (default: 'uv-cache' beside venv_releases_dir, for hard links)"),
        Key("venv_rollback_to", optional(release_name), _literal(None),
            "release id rollback.py activates (default: the release active before the last deploy)"),
        Key("rollout_batch", integer(1), _literal(1), "hosts restarted at a time"),
        Key("rollout_failure_budget", integer(0), _literal(0), "failed hosts tolerated before stopping"),
        Key("service_env", env_map, _literal({}), "extra environment for the service (e.g. NCCL_P2P_DISABLE)"),
        Key("service_extra_args", string_list, _literal(()), "extra sglang.launch_server arguments"),
        Key("service_cache_dir", abs_path, _literal("/var/cache/servestack/flashinfer"),
            "JIT caches of the service (flashinfer, triton, ...): one '<cuda_version>-<release>' dir each"),
        Key("service_secret_env", env_names, _literal(()),
            "names of control-machine environment variables copied into the 0600 secrets file"),
        Key("verify_reuse", boolean, _literal(True),
            "the deploy's verify step re-runs its heavy checks (torch on the GPUs, the CUDA sample, the "
            "patch check) only when the driver, GPUs, toolkit, release or settings changed; False: every run"),
    ]
    keys += [Key(_index_key(name), url, (lambda m, n=name: m.indexes[n]), f"URL of the '{name}' index")
             for name in manifest.indexes]
    keys += [Key(_wheel_key(package.name), optional(url), _literal(None),
                 f"URL of the {package.name} wheel (the host's architecture's manifest URL by default)")
             for package in manifest.packages if package.wheel]
    keys += [Key(f"venv_{name}", check, _from("venv", name), meaning)
             for name, (check, meaning) in _VENV_KEYS.items()]
    keys += [Key(f"service_{name}", check, _from("service", name), meaning)
             for name, (check, meaning) in _SERVICE_KEYS.items()]
    return {key.name: key for key in keys}


@dataclass(frozen=True)
class Settings:
    """Validated settings of one host: attributes are the host-data key names."""

    host_name: str
    manifest: Manifest
    values: dict = field(repr=False)

    def __getattr__(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def runfile(self, arch: str) -> Runfile:
        """The runfile for an architecture, with mirror/URL overrides applied."""
        manifest_runfile = self.manifest.runfiles[arch]
        source = self.cuda_runfile_url or (
            self.cuda_mirror and self.cuda_mirror.rstrip("/") + "/" + manifest_runfile.file)
        if not source:
            return manifest_runfile
        return Runfile(manifest_runfile.file, source, manifest_runfile.size,
                       manifest_runfile.md5, manifest_runfile.sha256)

    def index_url(self, name: str) -> str:
        return self.values[_index_key(name)]

    def wheel_url(self, package: Package, arch: str) -> str:
        return self.values[_wheel_key(package.name)] or package.wheel[arch]

    @property
    def packages(self) -> tuple[Package, ...]:
        return self.manifest.packages


def _unknown(name: str, known: dict[str, Key]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"'{name}': unknown servestack key{hint}; see README 'Host data'"


# -- strict keys (the module's docstring says which foreign keys are refused) ----------------------

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
    (strict keys, rules 2-4), or None: the key is the user's (or pyinfra's) own."""
    if name in pyinfra_keys():
        return None
    return _foreign_key_problem(name, tuple(known))


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


# -- consistency ----------------------------------------------------------------------------------

def _consistency(values: dict, manifest: Manifest, bad: set[str]) -> list[str]:
    """Checks across keys, each made only when every key it reads has a valid value (`bad`: the
    keys already refused), so that one wrong value does not hide another problem."""
    def usable(*names: str) -> bool:
        return not bad.intersection(names)

    errors = []
    if usable("cuda_version") and values["cuda_version"] != manifest.cuda["version"]:
        errors.append(f"'cuda_version': no runfile entry for CUDA {values['cuda_version']} in "
                      f"{manifest.path.name} (it has {manifest.cuda['version']})")
    if usable("service_tp", "gpu_count"):
        tp, gpus = values["service_tp"], values["gpu_count"]
        if gpus % tp:
            errors.append(f"'service_tp': expected a tensor-parallel size that divides gpu_count={gpus}, got {tp}")
    if usable("service_speculative_num_steps", "service_speculative_eagle_topk",
              "service_speculative_num_draft_tokens"):
        steps, topk = values["service_speculative_num_steps"], values["service_speculative_eagle_topk"]
        draft = values["service_speculative_num_draft_tokens"]
        if topk == 1 and draft != steps + 1:
            errors.append("'service_speculative_num_draft_tokens': expected speculative_num_steps + 1 = "
                          f"{steps + 1} when speculative_eagle_topk is 1, got {draft}")
    if usable("cuda_runfile_url", "cuda_mirror") and values["cuda_runfile_url"] and values["cuda_mirror"]:
        errors.append("'cuda_runfile_url': set either cuda_runfile_url or cuda_mirror, not both")
    return errors


def _host_manifest(host_name: str, data: dict) -> tuple[Manifest, dict[str, Key]]:
    manifest_path = data.get("servestack_manifest", str(DEFAULT_MANIFEST))
    try:
        path = abs_path(manifest_path)
    except Invalid:
        raise ConfigError(f"host {host_name}: 'servestack_manifest': expected an absolute path, "
                          f"got {manifest_path!r}") from None
    try:
        manifest = load_manifest(path)
        return manifest, host_keys(manifest)
    except ManifestError as error:
        raise ManifestError("\n".join(f"host {host_name}: {line}" for line in error.problem.splitlines()),
                            error.problem) from None


def settings_from_data(host_name: str, data: dict) -> Settings:
    """Build one host's settings from its merged host data; raise ConfigError listing every problem
    (ManifestError when its manifest is unusable)."""
    manifest, known = _host_manifest(host_name, data)
    errors: list[str] = []
    try:
        own = set(user_key_names(data.get("servestack_user_keys", ())))
    except Invalid:
        own = set()  # refused below, with the other values
    for name in sorted(key for key in data if isinstance(key, str)):
        if name in known or name in own:
            continue
        if name.startswith(OWN_PREFIXES):
            errors.append(_unknown(name, known))
        elif problem := foreign_key_problem(name, known):
            errors.append(problem)
    values, bad = {}, set()
    for name, key in known.items():
        if name not in data:
            values[name] = key.default(manifest)
            continue
        try:
            values[name] = key.check(data[name])
        except Invalid as problem:
            errors.append(f"'{name}': expected {problem}, got {data[name]!r}")
            values[name], bad = None, bad | {name}
    errors += _consistency(values, manifest, bad)
    if errors:
        raise ConfigError("\n".join(f"host {host_name}: {error}" for error in errors))
    return Settings(host_name, manifest, values)


def secret_problems(host_name: str, data: dict, environ=None) -> list[str]:
    """Lines naming every variable of the host's `service_secret_env` the control machine cannot
    supply (the secrets file is written from this environment: operations/service.py
    `secrets_content`). `data`: the host's merged host data (its other problems do not matter here;
    a `service_secret_env` that is no list of names is settings_from_data's to refuse)."""
    environ = os.environ if environ is None else environ
    try:
        names = env_names(data.get("service_secret_env", ()))
    except Invalid:
        return []
    problems = []
    for name in names:
        value = environ.get(name)
        if value is None:
            problems.append(f"{name} is not set in the control machine's environment (export it before the run)")
        elif not value:
            problems.append(f"{name} is set but empty in the control machine's environment")
        elif "\n" in value or "'" in value or "\x00" in value:
            problems.append(f"{name} contains a newline or a single quote, which the secrets file cannot hold")
    return [f"host {host_name}: 'service_secret_env': {problem}" for problem in problems]


_CACHE: "WeakKeyDictionary[Any, Settings]" = WeakKeyDictionary()


def host_settings(host) -> Settings:
    """The validated settings of a pyinfra host (computed once per host)."""
    host = real_host(host)
    if host not in _CACHE:
        _CACHE[host] = settings_from_data(host.name, host.data.dict())
    return _CACHE[host]


def _hosts_label(names: list[str], shown: int = 5) -> str:
    if len(names) == 1:
        return f"host {names[0]}"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return "hosts " + ", ".join(names[:shown]) + more


def check_inventory(hosts) -> tuple[dict[str, Settings], list[tuple[int, str]]]:
    """Validate every host: the settings of the valid ones, and one (host index, line) per problem
    of the others, in inventory order. A manifest problem shared by several hosts is one line."""
    settings: dict[str, Settings] = {}
    problems: list[tuple[int, str]] = []
    manifests: dict[str, tuple[int, list[str]]] = {}
    for index, host in enumerate(hosts):
        try:
            settings[host.name] = host_settings(host)
        except ManifestError as error:
            manifests.setdefault(error.problem, (index, []))[1].append(host.name)
        except ConfigError as error:
            problems += [(index, line) for line in str(error).splitlines()]
    for problem, (index, names) in manifests.items():
        problems += [(index, f"{_hosts_label(names)}: {line}") for line in problem.splitlines()]
    problems.sort(key=lambda item: item[0])
    return settings, problems


def validate_inventory(inventory) -> dict[str, Settings]:
    """Validate every host of an inventory; raise one ConfigError listing all problems."""
    settings, problems = check_inventory(list(inventory))
    if problems:
        raise ConfigError("invalid servestack settings (nothing was changed on any host):\n"
                          + "\n".join(line for _index, line in problems))
    return settings
