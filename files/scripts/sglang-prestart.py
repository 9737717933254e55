"""SGLang's own start-up checks of a release, run in the release's python before the service restarts on it.

Usage: <release>/venv/bin/python -I -c THIS_FILE PARAMS   (operations/prestart.py sends it: servestack/scripts.py)
PARAMS, a JSON object:
    release   the release id, for the messages
    profile   the service profile, for the messages
    argv      the `sglang.launch_server` arguments the unit will pass
    env       the unit's environment (SGLANG_*, HOME, CUDA_HOME, ...), set before sglang is imported

What runs is SGLang's own code, in the order `sglang.launch_server` runs it (0.5.9
entrypoints/engine.py L1026, 0.5.14 L778), never a re-implementation:
1. its argument parser (`ServerArgs.add_cli_args` on `argparse.ArgumentParser()`, as
   `prepare_server_args` builds it): an unknown flag or a bad choice is refused in its words;
2. where the model's config is on the host (a local directory, or the Hugging Face cache under the
   service's HOME): `prepare_server_args` (its __post_init__ loads the model config through
   transformers and adjusts every setting) and `check_server_args` (0.5.9: the cuDNN rule for a
   multimodal model on torch 2.9.1). Without a GPU, `--device cuda` is added, and where SGLang needs
   a GPU to go on the check says so and stops there;
3. where the tokenizer files are on the host: its `get_tokenizer`, with the command line's
   `--trust-remote-code` (a repository whose tokenizer is its own code is refused without it).
Nothing is downloaded: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set.

Output: progress lines `servestack: ...` on stdout; on a refusal one line `servestack: SGLang refuses
release R (profile P): <SGLang's message>` on stderr and exit 1; exit 2 without PARAMS. Last on
stdout, one JSON object as the section `result` (facts/framing.py): {"sglang": version, "checked": [...],
"not_checked": [...], "refused": text|null}.
"""

import json
import os
import re
import sys
from servestack.hostcode import section

# Errors that mean SGLang needs what this host lacks, not that it refuses the configuration: no GPU, or
# GPUs the running server holds (exclusive compute mode, or its memory).
NEEDS_A_GPU = ("Found no NVIDIA driver", "0 active drivers", "No accelerator", "CUDA driver", "no CUDA GPUs",
               "busy or unavailable", "CUDA out of memory")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Refused(Exception):
    """SGLang refused the configuration; the message is SGLang's."""


def say(text):
    sys.stdout.write("servestack: %s\n" % text)
    sys.stdout.flush()


def first_line(error):
    """An error's first two lines that say something (SGLang frames some in lines of dashes and
    colours them), on one line."""
    lines = [ANSI.sub("", line).strip() for line in str(error).splitlines()]
    text = " | ".join([line for line in lines if line and set(line) - set("-=")][:2])
    return "%s: %s" % (type(error).__name__, text) if text else type(error).__name__


def needs_a_gpu(error):
    return any(marker in str(error) for marker in NEEDS_A_GPU)


def is_missing_file(error):
    names = {cls.__name__ for cls in type(error).__mro__}
    return isinstance(error, OSError) or bool(names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"})


def parse_arguments(argv):
    """SGLang's own parser on the unit's arguments."""
    import argparse
    from sglang.srt.server_args import ServerArgs

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise Refused("%s: error: %s" % (self.prog, message))

    parser = Parser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def model_files_here(path, name):
    """Whether file `name` of the model at `path` (a directory or a hub id) is on this host."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, name))
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(path, name), str)
    except Exception:
        return False


def gpu_visible():
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check(params, result):
    argv = list(params["argv"])
    parsed = parse_arguments(argv)
    result["checked"].append("SGLang's argument parser accepts the unit's command line")
    model = parsed.model_path
    if not model_files_here(model, "config.json"):
        result["not_checked"].append("the model configuration checks: %s has no config.json on this host yet "
                                     "(SGLang loads it before it checks the rest)" % model)
        return
    if not gpu_visible():
        argv += ["--device", "cuda"]
        result["not_checked"].append("no GPU is visible here: checked as on CUDA; what SGLang decides from "
                                     "the GPUs themselves is not checked")
    from sglang.srt.server_args import prepare_server_args
    try:
        server_args = prepare_server_args(argv)
        result["checked"].append("ServerArgs (%s's model config, every setting)" % model)
        server_args.check_server_args()
        result["checked"].append("check_server_args")
    except Refused:
        raise
    except Exception as error:
        if needs_a_gpu(error):
            result["not_checked"].append("SGLang's checks past where it needs a GPU (%s)" % first_line(error))
            return
        if is_missing_file(error):
            result["not_checked"].append("SGLang's checks past a file not on this host (%s)" % first_line(error))
            return
        raise Refused(first_line(error))
    tokenizer = server_args.tokenizer_path or model
    if not model_files_here(tokenizer, "tokenizer_config.json"):
        result["not_checked"].append("the tokenizer: %s has no tokenizer_config.json on this host" % tokenizer)
        return
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    try:
        get_tokenizer(tokenizer, tokenizer_mode=server_args.tokenizer_mode,
                      trust_remote_code=server_args.trust_remote_code, revision=server_args.revision)
        result["checked"].append("get_tokenizer (trust_remote_code=%s)" % server_args.trust_remote_code)
    except Exception as error:
        if is_missing_file(error) and "custom code" not in str(error):
            result["not_checked"].append("the tokenizer (%s)" % first_line(error))
            return
        raise Refused(first_line(error))


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: sglang-prestart.py PARAMS_JSON  (`python -I -c TEXT PARAMS_JSON`)\n")
        return 2
    params = json.loads(argv[1])
    os.environ.update(params["env"])
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = {"sglang": None, "checked": [], "not_checked": [], "refused": None}
    say("SGLang's pre-start check of release %s (profile %s)" % (params["release"], params["profile"]))
    try:
        import sglang
        result["sglang"] = getattr(sglang, "__version__", None)
        check(params, result)
    except Refused as refusal:
        result["refused"] = str(refusal)
    except Exception as error:   # SGLang's own modules do not import or run here: it would not start
        result["refused"] = first_line(error)
    for text in result["checked"]:
        say("checked: %s" % text)
    for text in result["not_checked"]:
        say("not checked: %s" % text)
    if result["refused"]:
        sys.stderr.write("servestack: SGLang refuses release %s (profile %s): %s\n"
                         % (params["release"], params["profile"], result["refused"]))
    section("result", json.dumps(result, sort_keys=True))
    return 1 if result["refused"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
