"""The servestack host-data keys: each key's checker, default (read from the manifest) and meaning.

`host_keys(manifest)` declares every key; settings.py builds a host's Settings from them. The
manifest's [venv] and [service] tables hold the defaults of the venv_* and service_* keys, and
`manifest_problems` checks them with the keys' own checkers.

Service profiles. The manifest's [service] holds what every host's unit shares; `service_profile`
picks one of its [service.profiles."<name>"] tables, whose fields are the defaults of the keys
`service_<field>` (PROFILE_KEYS; a host's service_env and service_extra_args are added to the
profile's: PROFILE_MERGES). profiles.py's rules refuse fields that do not fit together, in the
manifest's profiles and in each host's settings alike.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from servestack.errors import ManifestError
from servestack.manifest import DEFAULT_MANIFEST, Manifest
from servestack.profiles import SPECULATIVE_ALGORITHMS, profile_rules
from servestack.values import (Checker, Invalid, abs_path, arguments, boolean, capability, choice, commit, env_map,
                               env_name, env_names, expectation, fraction, host_address, integer, levels,
                               module_name, optional, release_name, repository_id, string_list, text, unit_name, url,
                               user_name, version, word)

# Host-data keys starting with these belong to servestack: an unknown one is an error, not ignored.
OWN_PREFIXES = ("servestack_", "cuda_", "gpu_", "uv_", "venv_", "service_", "index_",
                "wheel_url_", "rollout_", "patches_", "verify_")

SPECULATION_POLICIES = ("on", "off", "auto", "adaptive")
DEFAULT_MODELS_DIR = "/var/lib/servestack/models"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class Key:
    """One host-data key: its checker turns raw data into a value or raises Invalid."""

    name: str
    check: Checker
    default: Callable[[Manifest], Any]
    help: str
    profile_field: str | None = None  # its default is this field of the host's service profile


def user_key_names(value):
    names = string_list(value)
    for name in names:
        if name.startswith(OWN_PREFIXES):
            raise Invalid(f"keys of your own, without a servestack prefix ({name!r} has one)")
    return names


def index_key(name: str) -> str:
    """The host-data key of the URL of the manifest's index `name`."""
    return f"index_{name}_url"


def wheel_key(package: str) -> str:
    """The host-data key of the URL of `package`'s wheel."""
    return "wheel_url_" + re.sub(r"[-_.]+", "_", package).lower()


def is_local_path(model_path: str) -> bool:
    """A model path that names a directory on the host (served as it is), not a repository id."""
    return model_path.startswith("/")


def _literal(value) -> Callable[[Manifest], Any]:
    return lambda manifest: value


def _from(section: str, name: str) -> Callable[[Manifest], Any]:
    return lambda manifest: getattr(manifest, section)[name]


def _from_profile(field: str) -> Callable[[Manifest], Any]:
    return lambda manifest: profile_default(manifest, manifest.service["profile"], field)


# Upper bounds on timeouts and counts: a value past them is a slip (an extra zero, milliseconds for seconds),
# refused before connecting instead of a gate that waits for days or a prune that never prunes.
HOUR_S = 3600
DAY_S = 24 * HOUR_S   # a model load that takes longer is stuck
MAX_HOSTS = 1000      # rollout_batch and rollout_failure_budget: hosts of one run

SERVICE_KEYS = {  # name: (checker, meaning); defaults are the manifest's [service] table
    "name": (unit_name, "systemd unit name"),
    "user": (user_name, "unprivileged system user the server runs as (created by the deploy)"),
    "launch_module": (module_name, "python module the unit runs with -m"),
    "profile": (text, "the service profile the host serves: a name of the manifest's service.profiles (the "
                "profile's fields are the defaults of the service_* keys marked so)"),
    "tp": (integer(1, 64), "--tp: tensor-parallel size; must divide gpu_count"),
    "host": (host_address, "--host the server listens on"),
    "port": (integer(1, 65535), "--port"),
    "start_timeout_s": (integer(1, DAY_S), "systemd TimeoutStartSec"),
    "health_timeout_s": (integer(1, DAY_S),
                         "seconds a restarted server has to answer /health before it is rolled back"),
    "start_limit_burst": (integer(1, 100), "starts of the unit (systemd's automatic restarts) within "
                          "burst x (start_timeout_s + RestartSec) seconds before systemd gives up on a crashing "
                          "server (StartLimitBurst; servestack's own restarts reset the count)"),
    "models_keep": (integer(1, 100), "staged revisions kept of each model repository in service_models_dir, "
                    "pruned after the service step verified its unit (one the active or the known-good unit "
                    "serves, and a pre-staged copy, are never pruned)"),
}
PROFILE_KEYS = {  # field: (checker, meaning, required); defaults are the host's profile's
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
PROFILE_MERGES: dict[str, Callable[[Any, Any], Any]] = {
    "extra_args": lambda profile, host: tuple(profile) + tuple(host),
    "env": lambda profile, host: {**profile, **host},
}
# [service.speculation_benchmark]: the fixed request `servestack bench` and service_speculation = "auto"
# send (operations/speculation.py `method`); every field required.
BENCHMARK_KEYS = {
    "prompt": text,
    "max_new_tokens": integer(1, 65536),
    "runs": integer(1, 1000),
    "warmup": integer(0, 100),
    "concurrency": levels,
    "request_timeout_s": integer(1, HOUR_S),
}
VENV_KEYS = {  # defaults are the manifest's [venv] table
    "path": (abs_path, "the stable path of the active environment (a symlink to the active release)"),
    "releases_dir": (abs_path, "where releases (one venv each) are built"),
    "python": (text, "the host's interpreter new venvs are made with"),
    "keep_releases": (integer(1, 100), "releases kept (the active and the previous one are never pruned)"),
    "keep_backups": (integer(1, 1000), "environment snapshots kept under servestack_state_dir/backups"),
}


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
            "(servestack/stack_hashes.py); commit it"),
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
        Key("rollout_batch", integer(1, MAX_HOSTS), _literal(1), "hosts restarted at a time"),
        Key("rollout_failure_budget", integer(0, MAX_HOSTS), _literal(0), "failed hosts tolerated before stopping"),
        Key("service_cache_dir", abs_path, _literal("/var/cache/servestack/flashinfer"),
            "JIT caches of the service (flashinfer, triton, ...): one '<cuda_version>-<release>' dir each"),
        Key("service_secret_env", env_names, _literal(()),
            "names of control-machine environment variables copied into the 0600 secrets file"),
        Key("service_models_dir", abs_path, _literal(DEFAULT_MODELS_DIR),
            "where the weights step stages each served model: one directory per repository and revision, "
            "<dir>/<org>--<name>/<revision> (the unit's --model-path names it)"),
        Key("service_model_revision", optional(commit), _literal(None),
            "the commit of service_model_path's repository to stage and serve (default: the manifest's "
            "[service.models] pin; a model the manifest pins no revision for needs it)"),
        Key("service_draft_model_revision", optional(commit), _literal(None),
            "the commit of service_draft_model_path's repository (default: the manifest's pin)"),
        Key("service_model_local_copy", optional(abs_path), _literal(None),
            "a copy of service_model_path's pinned revision already on the host (e.g. from a shared disk): "
            "checked against the Hub's file list, sizes and hashes and served as it is, never modified; "
            "refused with what differs"),
        Key("service_draft_model_local_copy", optional(abs_path), _literal(None),
            "the same for service_draft_model_path"),
        Key("service_hub_endpoint", url, _literal(DEFAULT_HUB_ENDPOINT),
            "the Hugging Face Hub the hosts download weights from (HF_ENDPOINT: a mirror for an air-gapped "
            "fleet); the files' checksums stay the Hub's"),
        Key("service_hub_token_env", optional(env_name), _literal(None),
            "the control-machine environment variable holding a Hub token (e.g. 'HF_TOKEN'), for gated or "
            "private models: uploaded root-only (0600) for the download and removed after it; never in the "
            "unit, a command line, a log or the record"),
        Key("service_speculation", choice(*SPECULATION_POLICIES), _literal("on"),
            "'on': the unit runs the profile's speculative flags; 'off': without them; 'auto': a deploy that "
            "changed what the service runs benchmarks both and keeps speculation only where it wins by "
            "service_speculation_min_gain; 'adaptive': SGLang's adaptive speculation (sglang >= 0.5.14, EAGLE/"
            "EAGLE3/NEXTN with topk 1), off from the concurrency where this host's benchmark says speculation "
            "stops paying (README 'Benchmark and speculation policy')"),
        Key("service_speculation_min_gain", fraction, _literal(0.02),
            "under service_speculation = 'auto': the least gain of the speculative mean tok/s over the "
            "baseline's that keeps speculation (0.02: 2%); under 'adaptive': per concurrency level"),
        Key("verify_reuse", boolean, _literal(True),
            "the deploy's verify step re-runs its heavy checks (torch on the GPUs, the CUDA sample, the "
            "patch check) only when the driver, GPUs, toolkit, release or settings changed; False: every run"),
    ]
    keys += [Key(index_key(name), url, _from("indexes", name), f"URL of the '{name}' index")
             for name in manifest.indexes]
    keys += [Key(wheel_key(package.name), optional(url), _literal(None),
                 f"URL of the {package.name} wheel (the host's architecture's manifest URL by default)")
             for package in manifest.all_packages() if package.wheel]
    keys += [Key(f"venv_{name}", check, _from("venv", name), meaning)
             for name, (check, meaning) in VENV_KEYS.items()]
    keys += [Key(f"service_{name}", check, _from("service", name), meaning)
             for name, (check, meaning) in SERVICE_KEYS.items()]
    keys += [Key(f"service_{field}", check, _from_profile(field),
                 f"{meaning} (default: from the host's service profile)", profile_field=field)
             for field, (check, meaning, _required) in PROFILE_KEYS.items()]
    return {key.name: key for key in keys}


def _profile_value(table: dict, field: str):
    """A profile's field, normalised by its checker; a field left out is None (not passed)."""
    return PROFILE_KEYS[field][0](table[field]) if field in table else None


def profile_default(manifest: Manifest, profile: str, field: str):
    """The value of `field` in the manifest's service profile `profile`."""
    return _profile_value(manifest.service["profiles"][profile], field)


def unknown_profile(name: str, profiles: Iterable[str]) -> str:
    profiles = sorted(profiles)
    close = (difflib.get_close_matches(name, profiles, n=1)
             or [profile for profile in profiles if profile.casefold().startswith(name.casefold())][:1])
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"unknown service profile {name!r}{hint}; the manifest's profiles: "
            + ", ".join(sorted(profiles)))


# -- the manifest's defaults --------------------------------------------------------------------------

def _table_problems(where: str, table: dict, specs: dict[str, tuple[Checker, bool]],
                    also_known: tuple[str, ...] = ()) -> list[str]:
    """A table's missing (required), unknown and refused keys; `where` names the table's key path."""
    problems = []
    for name, (check, required) in specs.items():
        key = f"{where}.{name}"
        if name not in table:
            if required:
                problems.append(f"key '{key}': expected {expectation(check)} (missing)")
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
        problems.append(f"key 'service.profile': {unknown_profile(default, profiles)}")
    specs = {field: (check, required) for field, (check, _meaning, required) in PROFILE_KEYS.items()}
    for name, table in profiles.items():
        where = _profile_table(name)
        found = _table_problems(where, table, specs)
        problems += found
        problems += _profile_model_problems(where, table, manifest.service.get("models", {}))
        if not found:
            fields = {field: _profile_value(table, field) for field in PROFILE_KEYS}
            problems += [f"key '{where}.{field}': {why}" for field, why in profile_rules(fields, manifest)]
    return problems


def _profile_model_problems(where: str, table: dict, models) -> list[str]:
    """A profile's model and draft are models of [service.models] (their type, architectures and pinned
    revision), and its model_architecture is one its model's config.json declares."""
    if not isinstance(models, dict):
        return []   # _models_problems says so
    problems = [f"key '{where}.{field}': expected a model of the manifest's [service.models] (its model_type, "
                f"architectures and pinned revision), got {table[field]!r}"
                for field in ("model_path", "draft_model_path")
                if isinstance(table.get(field), str) and not is_local_path(table[field]) and table[field] not in models]
    listed = models.get(table.get("model_path"))
    if isinstance(listed, dict) and table.get("model_architecture") not in listed.get("architectures", ()):
        problems.append(f"key '{where}.model_architecture': expected an architecture {table['model_path']}'s "
                        f"config.json declares ({', '.join(listed.get('architectures', ()))}, the manifest's "
                        f"[service.models]), got {table.get('model_architecture')!r}")
    return problems


def manifest_problems(manifest: Manifest) -> list[str]:
    """Every problem of the manifest's [venv] and [service] tables and service profiles, the defaults
    of the venv_* and service_* keys: a missing key, an unknown key, a value its host-data key would
    refuse or a profile whose values do not fit together."""
    problems = []
    sections: tuple[tuple[str, dict[str, tuple[Checker, str]], tuple[str, ...]], ...] = (
        ("venv", VENV_KEYS, ()), ("service", SERVICE_KEYS, ("profiles", "speculation_benchmark", "models")))
    for section, specs, also in sections:
        required = {name: (check, True) for name, (check, _meaning) in specs.items()}
        problems += _table_problems(section, getattr(manifest, section), required, also)
    benchmark = manifest.service.get("speculation_benchmark")
    if not isinstance(benchmark, dict):
        problems.append("key 'service.speculation_benchmark': expected a table of the benchmark's request"
                        + (" (missing)" if benchmark is None else f", got {benchmark!r}"))
    else:
        problems += _table_problems("service.speculation_benchmark", benchmark,
                                    {name: (check, True) for name, check in BENCHMARK_KEYS.items()})
    problems += _models_problems(manifest)
    problems += _profiles_problems(manifest)
    return [f"{manifest.path}: {problem}" for problem in problems]


# [service.models."<org>/<name>"]: what a served model's config.json declares, and its pinned commit.
MODEL_KEYS = {  # field: (checker, required)
    "model_type": (word, True),
    "architectures": (string_list, True),
    "revision": (commit, False),
    "quantization": (word, False),   # sglang's name for the checkpoint's method (what it loads it as)
}


def _models_problems(manifest: Manifest) -> list[str]:
    models = manifest.service.get("models", {})
    if not isinstance(models, dict) or not all(isinstance(table, dict) for table in models.values()):
        return ["key 'service.models': expected tables like [service.models.\"nvidia/Kimi-K2.5-NVFP4\"], "
                f"got {models!r}"]
    problems = []
    for name, table in models.items():
        try:
            repository_id(name)
        except Invalid as problem:
            problems.append(f"key 'service.models.\"{name}\"': expected {problem}")
        problems += _table_problems(f'service.models."{name}"', table, MODEL_KEYS)
    return problems


def manifest_models(manifest: Manifest) -> dict[str, dict]:
    """The manifest's [service.models] tables, by repository id."""
    return manifest.service.get("models", {})


def check_manifest_defaults(manifest: Manifest) -> None:
    """Raise ManifestError listing every problem `manifest_problems` finds."""
    problems = manifest_problems(manifest)
    if problems:
        raise ManifestError("\n".join(problems))
