"""Per-host settings: the manifest's defaults with the host's (and its groups') data applied.

Every servestack host-data key is declared in `host_keys()` with its type, its default (read
from the manifest) and what it means. `validate_inventory` checks every host before any
connection and refuses, in one message, every unknown key, wrong type or inconsistent value,
naming the host, the key and what was expected. Operations call `host_settings(host)`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Callable
from weakref import WeakKeyDictionary

from packaging.version import InvalidVersion, Version

from servestack.errors import ConfigError
from servestack.manifest import DEFAULT_MANIFEST, Manifest, Package, Runfile, load_manifest

# Host-data keys starting with these belong to servestack: an unknown one is an error, not ignored.
OWN_PREFIXES = ("servestack_", "cuda_", "gpu_", "uv_", "venv_", "service_", "index_",
                "wheel_url_", "rollout_", "patches_", "verify_")

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


def host_keys(manifest: Manifest) -> dict[str, Key]:
    """Every servestack host-data key, with defaults from `manifest`."""
    keys = [
        Key("servestack_manifest", abs_path, _literal(str(DEFAULT_MANIFEST)),
            "path (on the control machine) of the stack manifest this host uses"),
        Key("servestack_allow_local", boolean, _literal(False),
            "allow targeting the machine pyinfra runs on (@local, localhost)"),
        Key("servestack_state_dir", abs_path, _literal("/var/lib/servestack"),
            "servestack's state on the host: lock, backups, records"),
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


def _check_key(key: Key, value, errors: list[str]):
    try:
        return key.check(value)
    except Invalid as problem:
        errors.append(f"'{key.name}': expected {problem}, got {value!r}")
        return None


def _unknown(name: str, known: dict[str, Key]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"'{name}': unknown servestack key{hint}; see README 'Host data'"


def _consistency(values: dict, manifest: Manifest) -> list[str]:
    errors = []
    if values["cuda_version"] != manifest.cuda["version"]:
        errors.append(f"'cuda_version': no runfile entry for CUDA {values['cuda_version']} in "
                      f"{manifest.path.name} (it has {manifest.cuda['version']})")
    tp, gpus = values["service_tp"], values["gpu_count"]
    if gpus % tp:
        errors.append(f"'service_tp': expected a tensor-parallel size that divides gpu_count={gpus}, got {tp}")
    steps, topk = values["service_speculative_num_steps"], values["service_speculative_eagle_topk"]
    draft = values["service_speculative_num_draft_tokens"]
    if topk == 1 and draft != steps + 1:
        errors.append("'service_speculative_num_draft_tokens': expected speculative_num_steps + 1 = "
                      f"{steps + 1} when speculative_eagle_topk is 1, got {draft}")
    if values["cuda_runfile_url"] and values["cuda_mirror"]:
        errors.append("'cuda_runfile_url': set either cuda_runfile_url or cuda_mirror, not both")
    return errors


def settings_from_data(host_name: str, data: dict) -> Settings:
    """Build one host's settings from its merged host data; raise ConfigError listing every problem."""
    errors: list[str] = []
    manifest_path = data.get("servestack_manifest", str(DEFAULT_MANIFEST))
    try:
        manifest = load_manifest(abs_path(manifest_path))
    except Invalid:
        raise ConfigError(f"host {host_name}: 'servestack_manifest': expected an absolute path, "
                          f"got {manifest_path!r}") from None
    except ConfigError as error:
        raise ConfigError(f"host {host_name}: {error}") from None
    known = host_keys(manifest)
    values = {}
    for name in sorted(data):
        if name.startswith(OWN_PREFIXES) and name not in known:
            errors.append(_unknown(name, known))
    for name, key in known.items():
        values[name] = _check_key(key, data[name], errors) if name in data else key.default(manifest)
    if not errors:
        errors = _consistency(values, manifest)
    if errors:
        raise ConfigError("\n".join(f"host {host_name}: {error}" for error in errors))
    return Settings(host_name, manifest, values)


_CACHE: "WeakKeyDictionary[Any, Settings]" = WeakKeyDictionary()


def real_host(host):
    """The Host behind pyinfra's `host` context proxy (whose hash and == follow the current host)."""
    get_module = getattr(type(host), "_get_module", None)
    return get_module(host) if get_module else host


def host_settings(host) -> Settings:
    """The validated settings of a pyinfra host (computed once per host)."""
    host = real_host(host)
    if host not in _CACHE:
        _CACHE[host] = settings_from_data(host.name, host.data.dict())
    return _CACHE[host]


def validate_inventory(inventory) -> dict[str, Settings]:
    """Validate every host of an inventory; raise one ConfigError listing all problems."""
    problems, settings = [], {}
    for host in inventory:
        try:
            settings[host.name] = host_settings(host)
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("invalid servestack settings (nothing was changed on any host):\n"
                          + "\n".join(problems))
    return settings
