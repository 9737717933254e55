"""SGLang for the sandbox: the REAL sglang wheels from PyPI, and what must be real beside them.

The sandbox serves each stack's whole real resolution (closure.py). Most packages there are
stand-ins carrying only their real metadata; what SGLang's own code imports before any GPU work
must be real: `import sglang` (the release check) and `sglang.srt.server_args` (the pre-start
check) with the model config it loads through transformers. SERVER_ARGS_IMPORTS lists, per sglang
release, the packages that import needed, found by importing it in an empty venv until it succeeded
(torch, torchvision and triton being the stand-ins); the sandbox serves them and everything they
require as real wheels (closure.requirements_closure).
"""

from __future__ import annotations

#: The release that already carries the upstream fix of a servestack patch ('upstream patch' tests,
#: installed without its dependencies).
UPSTREAM_PATCHED_VERSION = "0.5.10"

_FOR_0_5_9 = ("aiohttp", "annotated-types", "anyio", "certifi", "charset-normalizer", "compressed-tensors",
              "dill", "distro", "filelock", "fsspec", "gguf", "h11", "hf-xet", "httpcore", "httpx",
              "huggingface-hub", "idna", "ipython", "jiter", "loguru", "numpy", "openai", "orjson", "packaging",
              "partial-json-parser", "pillow", "psutil", "pybase64", "pydantic", "pydantic-core", "pyyaml",
              "pyzmq", "regex", "requests", "safetensors", "sentencepiece", "sniffio", "starlette", "tokenizers",
              "tqdm", "traitlets", "transformers", "typing-extensions", "typing-inspection", "urllib3", "yarl")
SERVER_ARGS_IMPORTS = {
    "0.5.9": _FOR_0_5_9,
    "0.5.14": _FOR_0_5_9 + ("annotated-doc", "click", "einops", "markdown-it-py", "mdurl", "rich", "shellingham",
                            "typer"),
}


def server_args_imports(version: str) -> tuple[str, ...]:
    """What `sglang.srt.server_args` of sglang `version` imports, beyond the code stand-ins."""
    try:
        return SERVER_ARGS_IMPORTS[version]
    except KeyError:
        raise RuntimeError(f"the sandbox does not know what sglang {version} imports: add it to "
                           "sandbox/standins/sglang.py SERVER_ARGS_IMPORTS (import "
                           "sglang.srt.server_args in an empty venv until it succeeds)") from None
