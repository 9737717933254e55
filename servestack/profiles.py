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
