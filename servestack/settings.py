"""Per-host settings: the manifest's defaults with the host's (and its groups') data applied.

Every servestack host-data key is declared in `keys.host_keys()` with its type, its default (read
from the manifest) and what it means; `Settings` has a typed field for each. `validate_inventory`
checks every host before any connection and refuses, in one message, every unknown key
(strict_keys.py), wrong type or inconsistent value (the cross-key rules here and the service
profile rules of profiles.py), naming the host, the key and what was expected. Operations call
`host_settings(host)`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import weakref
from typing import Any, Callable

from servestack.errors import ConfigError, ManifestError
from servestack.keys import (OWN_PREFIXES, PROFILE_KEYS, PROFILE_MERGES, Key, host_keys, index_key, profile_default,
                             unknown_profile, user_key_names, wheel_key)
from servestack.manifest import SERVER_CHOICES, DEFAULT_MANIFEST, Manifest, Package, Runfile, Stack, load_manifest
from servestack.profiles import ADAPTIVE_FIELDS, profile_rules, speculation_policy_problems
from servestack.strict_keys import foreign_key_problem, unknown_key
from servestack.values import Invalid, abs_path, env_names


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated settings of one host: a field for each host-data key (keys.py says what each
    means), but the index_<name>_url and wheel_url_<package> keys, which are `index_urls` and
    `wheel_urls`."""

    host_name: str
    manifest: Manifest
    servestack_manifest: str
    servestack_allow_local: bool
    servestack_state_dir: str
    stack_locks_dir: str
    servestack_user_keys: tuple[str, ...]
    cuda_version: str
    cuda_install_path: str
    cuda_link_policy: str
    cuda_cache_dir: str
    cuda_tmpdir: str
    cuda_mirror: str | None
    cuda_runfile_url: str | None
    cuda_runfile_path: str | None
    cuda_existing_toolkit: str
    cuda_runfile_from: str
    cuda_installer_override: bool
    gpu_compute_capability: str
    gpu_count: int
    uv_index_url: str
    uv_install_dir: str
    uv_cache_dir: str | None
    venv_rollback_to: str | None
    rollout_batch: int
    rollout_failure_budget: int
    service_cache_dir: str
    service_secret_env: tuple[str, ...]
    service_models_dir: str
    service_model_revision: str | None
    service_draft_model_revision: str | None
    service_model_local_copy: str | None
    service_draft_model_local_copy: str | None
    service_hub_endpoint: str
    service_hub_token_env: str | None
    service_speculation: str
    service_speculation_min_gain: float
    verify_reuse: bool
    index_urls: dict[str, str]  # by the manifest's index name: index_<name>_url
    wheel_urls: dict[str, str | None]  # by package name: wheel_url_<package> (None: the manifest's)
    venv_path: str
    venv_releases_dir: str
    venv_python: str
    venv_keep_releases: int
    venv_keep_backups: int
    service_name: str
    service_user: str
    service_launch_module: str
    service_profile: str
    service_tp: int
    service_host: str
    service_port: int
    service_start_timeout_s: int
    service_health_timeout_s: int
    service_start_limit_burst: int
    service_models_keep: int
    service_stack: str
    service_model_path: str
    service_model_architecture: str
    service_draft_model_path: str | None
    service_speculative_algorithm: str
    service_speculative_num_steps: int
    service_speculative_eagle_topk: int
    service_speculative_num_draft_tokens: int
    service_attention_backend: str
    service_quantization: str | None
    service_kv_cache_dtype: str | None
    service_trust_remote_code: bool
    service_enable_torch_symm_mem: bool
    service_enable_flashinfer_allreduce_fusion: bool
    service_extra_args: tuple[str, ...]
    service_env: dict[str, str]
    service_patches: tuple[str, ...]

    @classmethod
    def from_values(cls, host_name: str, manifest: Manifest, values: dict[str, Any]) -> Settings:
        """The settings of {host-data key: value} for every key `host_keys(manifest)` declares."""
        index_urls = {name: values[index_key(name)] for name in manifest.indexes}
        wheel_urls = {package.name: values[wheel_key(package.name)]
                      for package in manifest.all_packages() if package.wheel}
        in_maps = {*map(index_key, index_urls), *map(wheel_key, wheel_urls)}
        return cls(host_name, manifest, index_urls=index_urls, wheel_urls=wheel_urls,
                   **{name: value for name, value in values.items() if name not in in_maps})

    @property
    def values(self) -> dict[str, Any]:
        """{host-data key: value} for every key (the verify step's reuse digest holds them)."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name == "index_urls":
                values.update({index_key(name): url for name, url in self.index_urls.items()})
            elif field.name == "wheel_urls":
                values.update({wheel_key(name): url for name, url in self.wheel_urls.items()})
            elif field.name not in ("host_name", "manifest"):
                values[field.name] = getattr(self, field.name)
        return values

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
        return self.index_urls[name]

    def wheel_url(self, package: Package, arch: str) -> str:
        """The URL of the wheel of `package`, one the manifest gives wheels of."""
        return self.wheel_urls[package.name] or (package.wheel or {})[arch]

    @property
    def stack(self) -> Stack:
        """The Python stack of the host's service profile (service_stack)."""
        return self.manifest.stacks[self.service_stack]

    @property
    def served_quantization(self) -> str | None:
        """The method sglang loads the served model with: --quantization, else the checkpoint's own (the
        manifest's [service.models] entry for service_model_path; a local path has none)."""
        model = self.manifest.service.get("models", {}).get(self.service_model_path, {})
        return self.service_quantization or model.get("quantization")

    @property
    def packages(self) -> tuple[Package, ...]:
        return self.stack.packages

    def package(self, name: str) -> Package:
        """The host's stack's pin of package `name` (KeyError: the stack has none)."""
        return self.stack.package(name)


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
    fields = {field: values[f"service_{field}"] for field in PROFILE_KEYS}
    errors += [f"'service_{field}': {why} (profile {values['service_profile']!r})"
               for field, why in profile_rules(fields, manifest,
                                                lambda *needed: usable("service_profile",
                                                                       *(f"service_{f}" for f in needed)))]
    if usable("service_speculation", "service_profile", *(f"service_{field}" for field in ADAPTIVE_FIELDS)):
        errors += [f"'service_{field}': {why} (profile {values['service_profile']!r})"
                   for field, why in speculation_policy_problems(values["service_speculation"], fields, manifest)]
    if usable("cuda_runfile_url", "cuda_mirror") and values["cuda_runfile_url"] and values["cuda_mirror"]:
        errors.append("'cuda_runfile_url': set either cuda_runfile_url or cuda_mirror, not both")
    if usable("service_stack") and values["service_stack"] in manifest.stacks:
        errors += _server_choice_problems(values, manifest.stacks[values["service_stack"]], usable)
    return errors + _service_rules(values, usable)


def _server_choice_problems(values: dict, stack: Stack, usable: Callable[..., bool]) -> list[str]:
    """Values the stack's sglang would refuse at start-up (its argument parser's choices)."""
    errors = []
    for key in SERVER_CHOICES:
        name, value = f"service_{key}", values[f"service_{key}"]
        if usable(name) and value is not None and value not in stack.choices(key):
            errors.append(f"'{name}': expected one of {stack.name}'s {SERVER_CHOICES[key]} choices "
                          f"({', '.join(stack.choices(key))}), got {value!r}")
    return errors


# Environment pinned by servestack: host data may not override these (service_env / secrets).
PINNED_ENV = ("CUDA_HOME", "CUDA_PATH", "PATH", "LD_LIBRARY_PATH", "CUDA_LIB_PATH", "FLASHINFER_WORKSPACE_BASE",
              "TRITON_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HOME",
              "SERVESTACK_RELEASE", "SERVESTACK_PATCHSET")

# Flags servestack builds from host data; service_extra_args may not repeat them (sglang aliases too).
MANAGED_FLAGS = ("--model-path", "--model", "--tp", "--tp-size", "--tensor-parallel-size",
                 "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
                 "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--attention-backend", "--quantization", "--kv-cache-dtype", "--enable-torch-symm-mem",
                 "--enable-flashinfer-allreduce-fusion", "--speculative-adaptive", "--speculative-adaptive-config",
                 "--host", "--port")


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


def _host_profile(data: dict, manifest: Manifest) -> tuple[str, str | None]:
    """The service profile a host picks (the manifest's default where it picks none or an unknown
    one) and why its choice is refused, if it is."""
    default = manifest.service["profile"]
    chosen = data.get("service_profile", default)
    if not isinstance(chosen, str) or chosen in manifest.service["profiles"]:
        return (chosen if isinstance(chosen, str) else default), None  # a non-string: the key's check says so
    return default, f"'service_profile': {unknown_profile(chosen, manifest.service['profiles'])}"


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
    (ManifestError when its manifest is unusable: with the host's other problems, in `others`)."""
    try:
        manifest, known = _host_manifest(host_name, data)
    except ConfigError as error:
        others = _problems_beside_its_manifest(data)
        shown = "\n".join([str(error), *(f"host {host_name}: {line}" for line in others)])
        if isinstance(error, ManifestError):
            raise ManifestError(shown, error.problem, others) from None
        raise ConfigError(shown) from None
    values, errors = _checked_values(data, manifest, known)
    if errors:
        raise ConfigError("\n".join(f"host {host_name}: {error}" for error in errors))
    return Settings.from_values(host_name, manifest, values)


def _problems_beside_its_manifest(data: dict) -> list[str]:
    """A host whose servestack_manifest cannot be used: its other problems, judged against the default
    manifest, so that the manifest's problem does not hide them (none when that one is unusable too)."""
    try:
        manifest = load_manifest(DEFAULT_MANIFEST)
        known = host_keys(manifest)
    except ConfigError:
        return []
    return _checked_values({**data, "servestack_manifest": str(DEFAULT_MANIFEST)}, manifest, known)[1]


def _checked_values(data: dict, manifest: Manifest, known: dict[str, Key]) -> tuple[dict, list[str]]:
    """Every key's value (None where refused) and every problem of the host's data, against `manifest`."""
    errors: list[str] = []
    try:
        own = set(user_key_names(data.get("servestack_user_keys", ())))
    except Invalid:
        own = set()  # refused below, with the other values
    for name in sorted(key for key in data if isinstance(key, str)):
        if name in known or name in own:
            continue
        if name.startswith(OWN_PREFIXES):
            errors.append(unknown_key(name, known))
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
        merge = PROFILE_MERGES.get(key.profile_field) if key.profile_field else None
        values[name] = merge(default, value) if merge else value
    errors += _consistency(values, manifest, bad)
    return values, errors


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


# Keyed by id() of the host's data: the same object through pyinfra's `host` context proxy as on the
# Host behind it, one per Host; an entry goes with its data (host data may be an unhashable dict).
_CACHE: dict[int, Settings] = {}


def host_settings(host) -> Settings:
    """The validated settings of a pyinfra host (computed once per host)."""
    data = host.data
    if id(data) not in _CACHE:
        _CACHE[id(data)] = settings_from_data(host.name, data.dict())
        weakref.finalize(data, _CACHE.pop, id(data), None)
    return _CACHE[id(data)]


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
    beside: list[tuple[int, str]] = []   # the other problems of hosts whose manifest is unusable
    for index, host in enumerate(hosts):
        try:
            settings[host.name] = host_settings(host)
        except ManifestError as error:
            manifests.setdefault(error.problem, (index, []))[1].append(host.name)
            beside += [(index, f"host {host.name}: {line}") for line in error.others]
        except ConfigError as error:
            problems += [(index, line) for line in str(error).splitlines()]
    for problem, (index, names) in manifests.items():
        problems += [(index, f"{_hosts_label(names)}: {line}") for line in problem.splitlines()]
    problems += beside   # after its manifest's line (the sort below keeps the order of equal indexes)
    problems.sort(key=lambda item: item[0])
    return settings, _said_once_per_group(problems, hosts)


_HOST_KEY_LINE = re.compile(r"host (?P<host>\S+): '(?P<key>[^']+)'(?P<rest>.*)")


def data_origin(host, key: str) -> str | None:
    """The group whose data gave `host` its value of `key` ("all" for the whole inventory's), or None
    when the value is the host's own (or a --data override). pyinfra's public Inventory API: a host's
    groups' data applies in order, the last group's value holding (Inventory.get_groups_data)."""
    inventory = getattr(host, "inventory", None)
    if inventory is None or key in inventory.get_override_data() or key in inventory.get_host_data(host.name):
        return None
    for group in reversed(list(getattr(host, "groups", ()))):
        if key in inventory.get_group_data(group):
            return group
    return "all" if key in inventory.get_data() else None


def _said_once_per_group(problems: list[tuple[int, str]], hosts) -> list[tuple[int, str]]:
    """A problem of a value that group data gave several hosts: one line naming the group's data file and
    the hosts, instead of one line per host."""
    by_name = {host.name: host for host in hosts}
    grouped: dict[tuple[str, str], list[str]] = {}
    lines: list[tuple[int, str | tuple[str, str]]] = []
    for index, line in problems:
        match = _HOST_KEY_LINE.fullmatch(line)
        group = match and match["host"] in by_name and data_origin(by_name[match["host"]], match["key"])
        if not match or not group:
            lines.append((index, line))
            continue
        said = (group, f"'{match['key']}'{match['rest']}")
        if said not in grouped:
            grouped[said] = []
            lines.append((index, said))
        grouped[said].append(match["host"])
    return [(index, line if isinstance(line, str) else
             f"group {line[0]} data (group_data/{line[0]}.py or the inventory), {_hosts_label(grouped[line])}: "
             f"{line[1]}") for index, line in lines]


def validate_inventory(inventory) -> dict[str, Settings]:
    """Validate every host of an inventory; raise one ConfigError listing all problems."""
    settings, problems = check_inventory(list(inventory))
    if problems:
        raise ConfigError("invalid servestack settings (nothing was changed on any host):\n"
                          + "\n".join(line for _index, line in problems))
    return settings
