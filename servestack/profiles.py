"""Service profiles: what sglang does with a serving configuration, and the rules its fields must
satisfy together.

The rules (`profile_rules`) apply to the manifest's [service.profiles."<name>"] tables and to each
host's settings alike (keys.py and settings.py); their fields are named as in a profile table.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Callable

from servestack.manifest import Manifest
from servestack.patchsets import load_patch_sets
from servestack.speculation_policy import SGLANG_DEFAULT_ADAPTIVE_CONFIG

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

Problems = list[tuple[str, str]]  # (field, what is wrong)

# Adaptive speculation (service_speculation = "adaptive", issue 33), as read in the sglang 0.5.14 wheel
# (docs/facts/sglang-adaptive-speculation.md); the stacks whose sglang has it as servestack writes its
# config say so in the manifest (`adaptive_speculation`).
# srt/speculative/adaptive_spec_params.py `adaptive_unsupported_reason` (L50-85): only EAGLE and EAGLE3
# (NEXTN is renamed EAGLE before, arg_groups/speculative_hook.py L42-48, called at L81 before the check
# at L122-125), only topk 1, and none of these flags; otherwise SGLang runs static speculation with only
# a warning (`_maybe_disable_adaptive`, L473-484). --enable-prefill-cp turns dp attention on
# (server_args.py L3560-3566, L3652-3659).
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
ADAPTIVE_EXCLUDED_FLAGS = ("--enable-dp-attention", "--enable-multi-layer-eagle", "--enable-two-batch-overlap",
                           "--enable-pdmux", "--enable-prefill-cp")


def _draft_tokens_rule(fields: dict, manifest: Manifest) -> Problems:
    steps, topk = fields["speculative_num_steps"], fields["speculative_eagle_topk"]
    draft = fields["speculative_num_draft_tokens"]
    if topk == 1 and draft != steps + 1:
        return [("speculative_num_draft_tokens", f"expected speculative_num_steps + 1 = {steps + 1} when "
                 f"speculative_eagle_topk is 1, got {draft}")]
    return []


def _draft_model_rule(fields: dict, manifest: Manifest) -> Problems:
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


def _stack_rule(fields: dict, manifest: Manifest) -> Problems:
    """The stack a profile names is one of the manifest's."""
    if fields["stack"] in manifest.stacks:
        return []
    close = difflib.get_close_matches(fields["stack"], manifest.stacks, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return [("stack", f"expected a stack of {manifest.path} ({', '.join(sorted(manifest.stacks))}), "
             f"got {fields['stack']!r}{hint}")]


def _patches_rule(fields: dict, manifest: Manifest) -> Problems:
    """The patches a profile needs are in servestack's set for its stack's sglang."""
    if fields["stack"] not in manifest.stacks:
        return []  # _stack_rule says so
    version = _sglang_version(fields["stack"], manifest)   # None: the stack installs no sglang, no patch applies
    available = patch_names(version) if version else ()
    missing = [name for name in fields["patches"] if name not in available]
    if not missing:
        return []
    offered = ", ".join(available) if available else "none"
    what = f"{PATCHED_PACKAGE} {version}" if version else f"stack {fields['stack']!r}, which installs no sglang"
    return [("patches", f"expected patches of servestack's set for {what} ({offered}), "
             f"got {', '.join(repr(name) for name in missing)}")]


_PROFILE_RULES: tuple[tuple[tuple[str, ...], Callable[[dict, Manifest], Problems]], ...] = (
    (("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"), _draft_tokens_rule),
    (("speculative_algorithm", "draft_model_path", "model_architecture"), _draft_model_rule),
    (("stack",), _stack_rule),
    (("stack", "patches"), _patches_rule),
)


def profile_rules(fields: dict, manifest: Manifest,
                  usable: Callable[..., bool] = lambda *needed: True) -> Problems:
    """(field, what is wrong) for a serving configuration's fields that do not fit together; a rule
    runs only when `usable` says every field it reads is valid."""
    return [problem for needed, rule in _PROFILE_RULES if usable(*needed) for problem in rule(fields, manifest)]


@lru_cache(maxsize=8)
def patch_names(version: str) -> tuple[str, ...]:
    """The patches of servestack's set for `version` of the patched package (files/patches)."""
    patch_set = load_patch_sets(PATCHED_PACKAGE).get(version)
    return tuple(name for name, _text in patch_set["patches"]) if patch_set else ()


def adaptive_unsupported_reason(fields: dict, manifest: Manifest) -> str | None:
    """Why a serving configuration (profile fields, host extra args merged) cannot run SGLang's adaptive
    speculation as servestack writes its config; None when it can."""
    stack = manifest.stacks.get(fields["stack"])
    if stack is None or not stack.adaptive_speculation:
        known = sorted({f"sglang {_sglang_version(name, manifest)}" for name, other in manifest.stacks.items()
                        if other.adaptive_speculation})
        return (f"stack {fields['stack']!r} has no adaptive speculation servestack knows (sglang "
                f"{_sglang_version(fields['stack'], manifest) or 'none'}; known: {', '.join(known) or 'none'}, "
                f"where a stack of {manifest.path} says adaptive_speculation = true)")
    algorithm, topk = fields["speculative_algorithm"], fields["speculative_eagle_topk"]
    if algorithm not in ADAPTIVE_ALGORITHMS:
        return (f"speculative_algorithm {algorithm}: sglang runs adaptive speculation only for "
                f"{', '.join(ADAPTIVE_ALGORITHMS)} and would silently fall back to static speculation")
    if topk != 1:
        return (f"speculative_eagle_topk {topk}: sglang runs adaptive speculation only with topk 1 and would "
                "silently fall back to static speculation")
    excluded = [flag for flag in ADAPTIVE_EXCLUDED_FLAGS
                if any(argument.split("=", 1)[0] == flag for argument in fields["extra_args"])]
    if excluded:
        return (f"extra_args {', '.join(excluded)}: sglang does not run adaptive speculation with "
                f"{'it' if len(excluded) == 1 else 'them'} and would silently fall back to static speculation")
    steps, first = fields["speculative_num_steps"], SGLANG_DEFAULT_ADAPTIVE_CONFIG["1"]["candidate_steps"]
    if steps not in first:
        # server_args' steps must be among the config's (speculative_hook.py L487-511, a ValueError at
        # start-up); servestack's configs keep SGLang's first slot.
        return (f"speculative_num_steps {steps}: sglang's adaptive config starts from steps "
                f"{', '.join(map(str, first))} and refuses a --speculative-num-steps among none of them")
    return None


ADAPTIVE_FIELDS = ("stack", "speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps", "extra_args")


def speculation_policy_problems(policy: str, fields: dict, manifest: Manifest) -> Problems:
    """A host's service_speculation that its serving configuration cannot run (settings.py: refused
    before connecting): "adaptive" where SGLang would not run adaptive speculation."""
    if policy != "adaptive":
        return []
    reason = adaptive_unsupported_reason(fields, manifest)
    return [("speculation", f"'adaptive' cannot run here: {reason}")] if reason else []


def _sglang_version(stack: str, manifest: Manifest) -> str | None:
    try:
        return manifest.stacks[stack].package(PATCHED_PACKAGE).version
    except KeyError:
        return None
