"""Fleet-wide overrides of the manifest defaults (files/stack.toml). Every key is optional.

`servestack keys` lists them. Keys of your own may live here too, but one that reads as a mistyped
servestack key (`servce_port`, `tp`, `sglang_port`) stops the run before it connects, with a "did
you mean"; list a key of yours that only looks like one in `servestack_user_keys` (README "Host data").

Examples (uncomment to use):

# Air-gapped fleet: fetch the CUDA runfile from a mirror, Python packages from an internal index.
# cuda_mirror = "https://mirror.internal/nvidia/cuda/13.0.1/local_installers/"
# index_pypi_url = "https://mirror.internal/pypi/simple"
# index_torch_url = "https://mirror.internal/pytorch/whl/cu130"
# index_flashinfer_url = "https://mirror.internal/flashinfer/whl/cu130"
# wheel_url_sgl_kernel = "https://mirror.internal/sgl/sgl_kernel-0.3.21+cu130-cp310-abi3-manylinux2014_x86_64.whl"
# uv_index_url = "https://mirror.internal/pypi/simple"

# Or: the control machine downloads the runfile once and uploads it to each host that lacks it.
# cuda_runfile_from = "controller"

# Model weights: each model is staged at a pinned commit before the service starts (README "Weights").
# service_model_revision = "<40-hex commit of the profile's model>"
# service_draft_model_revision = "<40-hex commit of its draft>"
# service_models_dir = "/var/lib/servestack/models"
# service_hub_endpoint = "https://hub-mirror.internal"     # an HF_ENDPOINT-style mirror
# service_hub_token_env = "HF_TOKEN"                       # read on the control machine, never written in the unit

# Service
# service_model_path = "/models/Kimi-K2.5-NVFP4"
# service_draft_model_path = "/models/kimi-k2.5-eagle3"
# service_secret_env = ["HF_TOKEN"]   # each must be set in the control machine's environment
"""
