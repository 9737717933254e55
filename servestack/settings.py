"""Per-host settings: the manifest's defaults with the host's (and its groups') data applied.

Every servestack host-data key is declared in `host_keys()` with its type, its default (read
from the manifest) and what it means. `validate_inventory` checks every host before any
connection and refuses, in one message, every unknown key, wrong type or inconsistent value,
naming the host, the key and what was expected. Operations call `host_settings(host)`.

Service profiles. The manifest's [service] holds what every host's unit shares; `service_profile`
picks one of its [service.profiles."<name>"] tables, whose fields are the defaults of the keys
`service_<field>` (`_PROFILE_KEYS`; a host's service_env and service_extra_args are added to the
profile's). `_PROFILE_RULES` refuse fields that do not fit together, in the manifest's profiles
and in each host's settings alike.

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
import ipaddress
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable
from weakref import WeakKeyDictionary

from packaging.version import InvalidVersion, Version

from servestack.errors import ConfigError, ManifestError
from servestack.hostrun import real_host
from servestack.manifest import DEFAULT_MANIFEST, Manifest, Package, Runfile, Stack, load_manifest

# Host-data keys starting with these belong to servestack: an unknown one is an error, not ignored.
OWN_PREFIXES = ("servestack_", "cuda_", "gpu_", "uv_", "venv_", "service_", "index_",
                "wheel_url_", "rollout_", "patches_", "verify_")

# Prefixes that stand for one of servestack's in host data people write (strict keys, rule 4).
PREFIX_ALIASES = {"sglang_": "service_", "sgl_": "service_", "server_": "service_", "serve_": "service_",
                  "svc_": "service_", "srv_": "service_", "toolkit_": "cuda_"}
MAX_EDITS = 2  # strict keys, rules 2 and 4

SPECULATIVE_ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN", "STANDALONE", "NONE")

# sglang 0.5.9 server_args.py `_handle_speculative_decoding`: NEXTN is renamed EAGLE (L2352-2353); for
# EAGLE, EAGLE3 and STANDALONE these architectures draft with the model itself when no draft model is
# given (L2397-2420), and all but OWN_OR_SEPARATE_DRAFT ones warn that a draft path is not needed
# (their MTP/NextN layers are the draft). tests/unit/test_profiles.py reads both lists from the wheel.
SELF_DRAFTING_ARCHITECTURES = ("DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM",
                               "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "BailingMoeForCausalLM",
                               "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM")
OWN_OR_SEPARATE_DRAFT = ("MistralLarge3ForCausalLM", "PixtralForConditionalGeneration")
MTP_ALGORITHMS = ("EAGLE", "NEXTN")            # draft with the model's own layers where it has them
SEPARATE_DRAFT_ALGORITHMS = ("EAGLE3", "STANDALONE")  # always a separate draft model
PATCHED_PACKAGE = "sglang"                     # service_patches name patches of its set (files/patches)


class Invalid(ValueError):
    """A value does not fit its key; the message says what was expected."""


@dataclass(frozen=True)
class Key:
    """One host-data key: its checker turns raw data into a value or raises Invalid."""

    name: str
    check: Callable[[Any], Any]
    default: Callable[[Manifest], Any]
    help: str
    profile_field: str | None = None  # its default is this field of the host's service profile


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


CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


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


def optional(check: Callable) -> Callable:
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
    "launch_module": (module_name, "python module the unit runs with -m"),
    "profile": (text, "the service profile the host serves: a name of the manifest's service.profiles (the "
                "profile's fields are the defaults of the service_* keys marked so)"),
    "tp": (integer(1, 64), "--tp: tensor-parallel size; must divide gpu_count"),
    "host": (host_address, "--host the server listens on"),
    "port": (integer(1, 65535), "--port"),
    "start_timeout_s": (integer(1), "systemd TimeoutStartSec"),
    "health_timeout_s": (integer(1), "seconds a restarted server has to answer /health before it is rolled back"),
    "start_limit_burst": (integer(1, 100), "starts of the unit (systemd's automatic restarts) within "
                          "burst x (start_timeout_s + RestartSec) seconds before systemd gives up on a crashing "
                          "server (StartLimitBurst; servestack's own restarts reset the count)"),
}
_PROFILE_KEYS = {  # field: (checker, meaning, required); defaults are the host's profile's
    "stack": (word, "the Python stack the release is built from: a name of the manifest's [stacks]", True),
    "model_path": (word, "--model-path: a local path or a hub id", True),
    "model_architecture": (word, "the model's architecture (its config.json 'architectures'): decides whether "
                           "EAGLE/NEXTN draft from the model itself", True),
    "draft_model_path": (optional(word), "--speculative-draft-model-path (none: not passed)", False),
    "speculative_algorithm": (choice(*SPECULATIVE_ALGORITHMS), "--speculative-algorithm ('NONE': no speculation)",
                              True),
    "speculative_num_steps": (integer(1, 16), "--speculative-num-steps", True),
    "speculative_eagle_topk": (integer(1, 16), "--speculative-eagle-topk", True),
    "speculative_num_draft_tokens": (integer(1, 64), "--speculative-num-draft-tokens (steps + 1 when topk is 1)",
                                     True),
    "attention_backend": (word, "--attention-backend", True),
    "quantization": (optional(word), "--quantization (none: not passed, sglang reads the checkpoint's)", False),
    "kv_cache_dtype": (optional(word), "--kv-cache-dtype (none: not passed)", False),
    "trust_remote_code": (boolean, "--trust-remote-code: the model repository's own code may run (Kimi-K2.5's "
                          "tokenizer and processor are code of its repository)", True),
    "enable_torch_symm_mem": (boolean, "--enable-torch-symm-mem (SM120 needs patch 0001)", True),
    "enable_flashinfer_allreduce_fusion": (boolean, "--enable-flashinfer-allreduce-fusion (no effect on SM120: "
                                           "warned)", True),
    "extra_args": (arguments, "extra sglang.launch_server arguments; a host's are added after the profile's",
                   True),
    "env": (env_map, "extra environment for the service (e.g. NCCL_P2P_DISABLE); a host's is added to the "
            "profile's, its value winning", True),
    "patches": (string_list, "servestack patches the profile needs: each must be in the patch set for the "
                "sglang of its stack", True),
}
# A host's value of these is added to its profile's instead of replacing it.
_PROFILE_MERGES = {"extra_args": lambda profile, host: tuple(profile) + tuple(host),
                   "env": lambda profile, host: {**profile, **host}}
SPECULATION_POLICIES = ("on", "off", "auto")
# [service.speculation_benchmark]: the fixed request `servestack bench` and service_speculation = "auto"
# send (servestack/bench.py); every field required.
_BENCHMARK_KEYS = {
    "prompt": text,
    "max_new_tokens": integer(1, 65536),
    "runs": integer(1, 1000),
    "warmup": integer(0, 100),
    "concurrency": levels,
    "request_timeout_s": integer(1),
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


def _table_problems(where: str, table: dict, specs: dict[str, tuple[Callable, bool]],
                    also_known: tuple[str, ...] = ()) -> list[str]:
    """A table's missing (required), unknown and refused keys; `where` names the table's key path."""
    problems = []
    for name, (check, required) in specs.items():
        key = f"{where}.{name}"
        if name not in table:
            if required:
                problems.append(f"key '{key}': expected {_expectation(check)} (missing)")
            continue
        try:
            check(table[name])
        except Invalid as problem:
            problems.append(f"key '{key}': expected {problem}, got {table[name]!r}")
    known = sorted([*specs, *also_known])
    problems += [f"key '{where}.{name}': expected one of the known keys {known} (unknown key)"
                 for name in table if name not in specs and name not in also_known]
    return problems


def _profile_table(profile: str) -> str:
    return f'service.profiles."{profile}"'


def _profiles_problems(manifest: Manifest) -> list[str]:
    """The [service.profiles.*] tables: each a complete, consistent serving configuration, and
    [service] profile naming one of them."""
    profiles = manifest.service.get("profiles")
    if not isinstance(profiles, dict) or not profiles or not all(isinstance(t, dict) for t in profiles.values()):
        return ["key 'service.profiles': expected service profiles, tables like [service.profiles.\"kimi-k2.5-eagle3\"]"
                + (" (missing)" if profiles is None else f", got {profiles!r}")]
    problems = []
    default = manifest.service.get("profile")
    if isinstance(default, str) and default not in profiles:
        problems.append(f"key 'service.profile': {_unknown_profile(default, profiles)}")
    specs = {field: (check, required) for field, (check, _meaning, required) in _PROFILE_KEYS.items()}
    for name, table in profiles.items():
        where = _profile_table(name)
        found = _table_problems(where, table, specs)
        problems += found
        if not found:
            fields = {field: _profile_value(table, field) for field in _PROFILE_KEYS}
            problems += [f"key '{where}.{field}': {why}" for field, why in _profile_rules(fields, manifest)]
    return problems


def manifest_problems(manifest: Manifest) -> list[str]:
    """Every problem of the manifest's [venv] and [service] tables and service profiles, the defaults
    of the venv_* and service_* keys: a missing key, an unknown key, a value its host-data key would
    refuse or a profile whose values do not fit together."""
    problems = []
    for section, specs, also in (("venv", _VENV_KEYS, ()),
                                 ("service", _SERVICE_KEYS, ("profiles", "speculation_benchmark"))):
        required = {name: (check, True) for name, (check, _meaning) in specs.items()}
        problems += _table_problems(section, getattr(manifest, section), required, also)
    benchmark = manifest.service.get("speculation_benchmark")
    if not isinstance(benchmark, dict):
        problems.append("key 'service.speculation_benchmark': expected a table of the benchmark's request"
                        + (" (missing)" if benchmark is None else f", got {benchmark!r}"))
    else:
        problems += _table_problems("service.speculation_benchmark", benchmark,
                                    {name: (check, True) for name, check in _BENCHMARK_KEYS.items()})
    problems += _profiles_problems(manifest)
    return [f"{manifest.path}: {problem}" for problem in problems]


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
        Key("stack_locks_dir", abs_path, _literal(str(DEFAULT_MANIFEST.parent / "locks")),
            "folder (on the control machine) where each stack's wheel hashes are fixed by its first build "
            "(operations/stack_hashes.py); commit it"),
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
        Key("cuda_installer_override", boolean, _literal(False),
            "True: run the runfile with --override, which skips its compiler check (for a host whose gcc "
            "the installer refuses as unsupported)"),
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
        Key("service_cache_dir", abs_path, _literal("/var/cache/servestack/flashinfer"),
            "JIT caches of the service (flashinfer, triton, ...): one '<cuda_version>-<release>' dir each"),
        Key("service_secret_env", env_names, _literal(()),
            "names of control-machine environment variables copied into the 0600 secrets file"),
        Key("service_speculation", choice(*SPECULATION_POLICIES), _literal("on"),
            "'on': the unit runs the profile's speculative flags; 'off': without them; 'auto': a deploy that "
            "changed what the service runs benchmarks both and keeps speculation only where it wins by "
            "service_speculation_min_gain (README 'Benchmark and speculation policy')"),
        Key("service_speculation_min_gain", fraction, _literal(0.02),
            "under service_speculation = 'auto': the least gain of the speculative mean tok/s over the "
            "baseline's that keeps speculation (0.02: 2%)"),
        Key("verify_reuse", boolean, _literal(True),
            "the deploy's verify step re-runs its heavy checks (torch on the GPUs, the CUDA sample, the "
            "patch check) only when the driver, GPUs, toolkit, release or settings changed; False: every run"),
    ]
    keys += [Key(_index_key(name), url, (lambda m, n=name: m.indexes[n]), f"URL of the '{name}' index")
             for name in manifest.indexes]
    keys += [Key(_wheel_key(package.name), optional(url), _literal(None),
                 f"URL of the {package.name} wheel (the host's architecture's manifest URL by default)")
             for package in manifest.all_packages() if package.wheel]
    keys += [Key(f"venv_{name}", check, _from("venv", name), meaning)
             for name, (check, meaning) in _VENV_KEYS.items()]
    keys += [Key(f"service_{name}", check, _from("service", name), meaning)
             for name, (check, meaning) in _SERVICE_KEYS.items()]
    keys += [Key(f"service_{field}", check, (lambda m, f=field: profile_default(m, m.service["profile"], f)),
                 f"{meaning} (default: from the host's service profile)", profile_field=field)
             for field, (check, meaning, _required) in _PROFILE_KEYS.items()]
    return {key.name: key for key in keys}


def _profile_value(table: dict, field: str):
    """A profile's field, normalised by its checker; a field left out is None (not passed)."""
    return _PROFILE_KEYS[field][0](table[field]) if field in table else None


def profile_default(manifest: Manifest, profile: str, field: str):
    """The value of `field` in the manifest's service profile `profile`."""
    return _profile_value(manifest.service["profiles"][profile], field)


def _unknown_profile(name: str, profiles: Iterable[str]) -> str:
    profiles = sorted(profiles)
    close = (difflib.get_close_matches(name, profiles, n=1)
             or [profile for profile in profiles if profile.casefold().startswith(name.casefold())][:1])
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"unknown service profile {name!r}{hint}; the manifest's profiles: "
            + ", ".join(sorted(profiles)))


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
    def stack(self) -> Stack:
        """The Python stack of the host's service profile (service_stack)."""
        return self.manifest.stacks[self.service_stack]

    @property
    def packages(self) -> tuple[Package, ...]:
        return self.stack.packages

    def package(self, name: str) -> Package:
        """The host's stack's pin of package `name` (KeyError: the stack has none)."""
        return self.stack.package(name)


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
    fields = {field: values[f"service_{field}"] for field in _PROFILE_KEYS}
    errors += [f"'service_{field}': {why} (profile {values['service_profile']!r})"
               for field, why in _profile_rules(fields, manifest,
                                                lambda *needed: usable("service_profile",
                                                                       *(f"service_{f}" for f in needed)))]
    if usable("cuda_runfile_url", "cuda_mirror") and values["cuda_runfile_url"] and values["cuda_mirror"]:
        errors.append("'cuda_runfile_url': set either cuda_runfile_url or cuda_mirror, not both")
    return errors + _service_rules(values, usable)


# Environment pinned by servestack: host data may not override these (service_env / secrets).
PINNED_ENV = ("CUDA_HOME", "CUDA_PATH", "PATH", "LD_LIBRARY_PATH", "FLASHINFER_WORKSPACE_BASE",
              "TRITON_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HOME",
              "SERVESTACK_RELEASE", "SERVESTACK_PATCHSET")

# Flags servestack builds from host data; service_extra_args may not repeat them (sglang aliases too).
MANAGED_FLAGS = ("--model-path", "--model", "--tp", "--tp-size", "--tensor-parallel-size",
                 "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
                 "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--attention-backend", "--quantization", "--kv-cache-dtype", "--enable-torch-symm-mem",
                 "--enable-flashinfer-allreduce-fusion", "--host", "--port")


def _service_rules(values: dict, usable: Callable[..., bool]) -> list[str]:
    """What in the service's data cannot make a working unit (operations/service.py renders it)."""
    errors = []
    if usable("service_user") and values["service_user"] == "root":
        errors.append("'service_user': expected a dedicated unprivileged user, got 'root'")
    if usable("service_extra_args"):
        errors += [f"'service_extra_args': {flag} is set from its own host-data key (see README 'Host data'), "
                   "not through extra args"
                   for flag in dict.fromkeys(argument.split("=", 1)[0] for argument in values["service_extra_args"])
                   if flag in MANAGED_FLAGS]
    for key in ("service_env", "service_secret_env"):
        if usable(key, "cuda_version"):
            errors += [f"'{key}': {name} is pinned by servestack (CUDA {values['cuda_version']} toolkit, "
                       "per-release caches) and cannot be overridden" for name in values[key] if name in PINNED_ENV]
    return errors


# -- service profiles: what must hold together --------------------------------------------------------

def _draft_tokens_rule(fields: dict, manifest: Manifest) -> list[tuple[str, str]]:
    steps, topk = fields["speculative_num_steps"], fields["speculative_eagle_topk"]
    draft = fields["speculative_num_draft_tokens"]
    if topk == 1 and draft != steps + 1:
        return [("speculative_num_draft_tokens", f"expected speculative_num_steps + 1 = {steps + 1} when "
                 f"speculative_eagle_topk is 1, got {draft}")]
    return []


def _draft_model_rule(fields: dict, manifest: Manifest) -> list[tuple[str, str]]:
    """A separate draft model exactly where the algorithm and the architecture need one."""
    algorithm, draft, architecture = (fields["speculative_algorithm"], fields["draft_model_path"],
                                      fields["model_architecture"])
    if algorithm in SEPARATE_DRAFT_ALGORITHMS and draft is None:
        return [("draft_model_path", f"expected a draft model: speculative_algorithm {algorithm} drafts with a "
                 "separate model, got none")]
    if algorithm not in MTP_ALGORITHMS:
        return []
    if architecture in SELF_DRAFTING_ARCHITECTURES and draft is not None:
        return [("draft_model_path", f"expected none: with speculative_algorithm {algorithm}, {architecture} "
                 f"drafts with its own MTP (NextN) layers, got {draft!r}")]
    if architecture not in SELF_DRAFTING_ARCHITECTURES + OWN_OR_SEPARATE_DRAFT and draft is None:
        return [("draft_model_path", f"expected a draft model: {architecture} (model_architecture) has no "
                 f"MTP layers sglang drafts with for speculative_algorithm {algorithm}; those that do: "
                 + ", ".join(SELF_DRAFTING_ARCHITECTURES + OWN_OR_SEPARATE_DRAFT))]
    return []


def _stack_rule(fields: dict, manifest: Manifest) -> list[tuple[str, str]]:
    """The stack a profile names is one of the manifest's."""
    if fields["stack"] in manifest.stacks:
        return []
    close = difflib.get_close_matches(fields["stack"], manifest.stacks, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return [("stack", f"expected a stack of {manifest.path} ({', '.join(sorted(manifest.stacks))}), "
             f"got {fields['stack']!r}{hint}")]


def _patches_rule(fields: dict, manifest: Manifest) -> list[tuple[str, str]]:
    """The patches a profile needs are in servestack's set for its stack's sglang."""
    if fields["stack"] not in manifest.stacks:
        return []  # _stack_rule says so
    try:
        version = manifest.stacks[fields["stack"]].package(PATCHED_PACKAGE).version
    except KeyError:
        version = None  # the stack installs no sglang: no patch applies
    available = patch_names(version) if version else ()
    missing = [name for name in fields["patches"] if name not in available]
    if not missing:
        return []
    offered = ", ".join(available) if available else "none"
    what = f"{PATCHED_PACKAGE} {version}" if version else f"stack {fields['stack']!r}, which installs no sglang"
    return [("patches", f"expected patches of servestack's set for {what} ({offered}), "
             f"got {', '.join(repr(name) for name in missing)}")]


_PROFILE_RULES = (
    (("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"), _draft_tokens_rule),
    (("speculative_algorithm", "draft_model_path", "model_architecture"), _draft_model_rule),
    (("stack",), _stack_rule),
    (("stack", "patches"), _patches_rule),
)


def _profile_rules(fields: dict, manifest: Manifest,
                   usable: Callable[..., bool] = lambda *needed: True) -> list[tuple[str, str]]:
    """(field, what is wrong) for a serving configuration's fields that do not fit together; a rule
    runs only when `usable` says every field it reads is valid."""
    return [problem for needed, rule in _PROFILE_RULES if usable(*needed) for problem in rule(fields, manifest)]


@lru_cache(maxsize=8)
def patch_names(version: str) -> tuple[str, ...]:
    """The patches of servestack's set for `version` of the patched package (files/patches)."""
    from facts.patches import load_patch_sets  # the patch step's own reading of files/patches
    patch_set = load_patch_sets(PATCHED_PACKAGE).get(version)
    return tuple(name for name, _text in patch_set["patches"]) if patch_set else ()


def _host_profile(data: dict, manifest: Manifest) -> tuple[str, str | None]:
    """The service profile a host picks (the manifest's default where it picks none or an unknown
    one) and why its choice is refused, if it is."""
    default = manifest.service["profile"]
    chosen = data.get("service_profile", default)
    if not isinstance(chosen, str) or chosen in manifest.service["profiles"]:
        return (chosen if isinstance(chosen, str) else default), None  # a non-string: the key's check says so
    return default, f"'service_profile': {_unknown_profile(chosen, manifest.service['profiles'])}"


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
    profile, profile_problem = _host_profile(data, manifest)
    if profile_problem:
        errors.append(profile_problem)
        bad.add("service_profile")
    for name, key in known.items():
        default = (profile_default(manifest, profile, key.profile_field) if key.profile_field
                   else key.default(manifest))
        if name not in data:
            values[name] = default
            continue
        try:
            value = key.check(data[name])
        except Invalid as problem:
            errors.append(f"'{name}': expected {problem}, got {data[name]!r}")
            values[name], bad = None, bad | {name}
            continue
        merge = _PROFILE_MERGES.get(key.profile_field)
        values[name] = merge(default, value) if merge else value
    errors += _consistency(values, manifest, bad)
    if errors:
        raise ConfigError("\n".join(f"host {host_name}: {error}" for error in errors))
    return Settings(host_name, manifest, values)


def secret_problems(host_name: str, data: dict, environ=None) -> list[str]:
    """Lines naming every variable of the host's `service_secret_env` the control machine cannot
    supply (the secrets file is written from this environment: operations/service.py
    `secrets_content`). `data`: the host's merged host data (its other problems do not matter here;
    a `service_secret_env` that is no list of names is settings_from_data's to refuse)."""
    try:
        names = env_names(data.get("service_secret_env", ()))
    except Invalid:
        return []
    return [f"host {host_name}: 'service_secret_env': {problem}"
            for problem in secret_variable_problems(names, os.environ if environ is None else environ)]


def secret_variable_problems(names, environ) -> list[str]:
    """What is wrong with each named control-machine variable as a secret (never its value)."""
    problems = []
    for name in names:
        value = environ.get(name)
        if value is None:
            problems.append(f"{name} is not set in the control machine's environment (export it before the run)")
        elif not value:
            problems.append(f"{name} is set but empty in the control machine's environment")
        elif "\n" in value or "'" in value or "\x00" in value:
            problems.append(f"{name} contains a newline or a single quote, which the secrets file cannot hold")
    return problems


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
