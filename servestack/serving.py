"""What the SGLang service runs, from the host's settings (pure): its command line, its environment,
and where the health gate and the checks reach it.

The service step (operations/service.py) renders these into the unit; the checks (servestack/checks)
compare the running server with them.
"""

from __future__ import annotations

import hashlib

from servestack.paths import release_cache_dir, service_home_dir
from servestack.releases import Release
from servestack.settings import Settings
from servestack.weights import served_path

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GENERATE_REQUEST = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def speculates(settings: Settings) -> bool:
    """Whether the host's service profile (with its host data) runs speculative decoding."""
    return settings.service_speculative_algorithm != "NONE"


def speculative_arguments(settings: Settings) -> list[str]:
    """The speculative-decoding flags of the profile: none without speculation; no draft path for a
    model that drafts with its own MTP layers (settings.py checks which need one)."""
    if not speculates(settings):
        return []
    args = ["--speculative-algorithm", settings.service_speculative_algorithm]
    if settings.service_draft_model_path is not None:
        args += ["--speculative-draft-model-path", served_path(settings, "draft")]
    return args + ["--speculative-num-steps", str(settings.service_speculative_num_steps),
                   "--speculative-eagle-topk", str(settings.service_speculative_eagle_topk),
                   "--speculative-num-draft-tokens", str(settings.service_speculative_num_draft_tokens)]


def adaptive_config_path(rel: Release, text: str) -> str:
    """Where SGLang's adaptive config (`text`) lies on the host: in the release, named by its content, so
    a changed config is a changed unit (a restart through the health gate) and the unit a gate rolls back
    to still finds the config it was verified with."""
    return f"{rel.dir}/speculative-adaptive-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def adaptive_arguments(config_path: str) -> list[str]:
    """SGLang's adaptive speculation (sglang 0.5.14 server_args.py L1544-1551) with the config at `config_path`."""
    return ["--speculative-adaptive", "--speculative-adaptive-config", config_path]


def launch_arguments(settings: Settings, speculation: bool = True, adaptive_config: str | None = None) -> list[str]:
    """`sglang.launch_server` arguments of the host's service profile and host data; with
    `speculation=False`, the same without the speculative flags (the profile's baseline); with
    `adaptive_config` (a path on the host), SGLang's adaptive speculation with that config."""
    args = ["--model-path", served_path(settings, "model"), "--tp", str(settings.service_tp)]
    if speculation:
        args += speculative_arguments(settings)
        if adaptive_config is not None and speculates(settings):
            args += adaptive_arguments(adaptive_config)
    args += ["--attention-backend", settings.service_attention_backend]
    if settings.service_quantization is not None:
        args += ["--quantization", settings.service_quantization]
    if settings.service_kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", settings.service_kv_cache_dtype]
    if settings.service_trust_remote_code:
        args.append("--trust-remote-code")
    if settings.service_enable_torch_symm_mem:
        args.append("--enable-torch-symm-mem")
    if settings.service_enable_flashinfer_allreduce_fusion:
        args.append("--enable-flashinfer-allreduce-fusion")
    args += ["--host", settings.service_host, "--port", str(settings.service_port)]
    return args + list(settings.service_extra_args)


def service_environment(settings: Settings, rel: Release, patchset: str | None,
                        writable: str | None = None) -> list[tuple[str, str]]:
    """The unit's environment: the manifest's toolkit first, per-toolkit/release caches, then host data.
    With `writable`, its caches and HOME lie under that directory instead: the release check imports as the
    server will, but as root and before the service user's directories exist, so what its imports write
    (flashinfer 0.6.12 opens <FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer/<version>/flashinfer_jit.log) must
    not land in them."""
    cuda = settings.cuda_install_path
    cache = writable or release_cache_dir(settings, rel.id)
    pinned = [
        ("CUDA_HOME", cuda),
        ("CUDA_PATH", cuda),
        ("PATH", f"{cuda}/bin:{rel.venv}/bin:{SYSTEM_PATH}"),
        ("LD_LIBRARY_PATH", f"{cuda}/lib64"),
        # flashinfer loads CUDA_LIB_PATH/libcudart.so.12 into the process when it is there, by default from
        # /usr/local/cuda, which a host may keep on its 12.8 toolkit (0.6.4 flashinfer/jit/__init__.py L91-95,
        # 0.6.12 L102-106): pointed at the service's own toolkit, which has no .so.12, it loads no second runtime
        ("CUDA_LIB_PATH", f"{cuda}/lib64"),
        ("FLASHINFER_WORKSPACE_BASE", cache),
        ("TRITON_CACHE_DIR", f"{cache}/triton"),
        ("SGLANG_DG_CACHE_DIR", f"{cache}/deep_gemm"),
        ("TORCHINDUCTOR_CACHE_DIR", f"{cache}/inductor"),
        ("HOME", f"{writable}/home" if writable else service_home_dir(settings)),
        ("SERVESTACK_RELEASE", rel.id),
        ("SERVESTACK_PATCHSET", patchset or "none"),
    ]
    return pinned + sorted(settings.service_env.items())


def check_url(settings: Settings) -> str:
    """Where the health gate reaches the server from the host itself."""
    address = settings.service_host
    if address in ("0.0.0.0", "::", "localhost", ""):
        address = "127.0.0.1"
    elif ":" in address:
        address = f"[{address}]"
    return f"http://{address}:{settings.service_port}"
