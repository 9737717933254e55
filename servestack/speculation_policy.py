"""The speculation policy's decisions and the host's record of a benchmark (pure; issue 17).

Two configurations of the host's service profile are measured: with its speculative flags
("speculation") and without them ("baseline"). The policy (`service_speculation`) chooses:

    "on"    speculation          "off"   baseline
    "auto"  speculation only if its mean output tok/s at concurrency 1 beats the baseline's by at
            least service_speculation_min_gain (default 0.02: 2%)
    "adaptive"  SGLang's adaptive speculation (--speculative-adaptive, sglang >= 0.5.14) with a config
            written from this host's measurements at each concurrency level (`adaptive_plan`): SGLang's
            own slots below the first level where speculation stops paying, speculation off from there
            on; the baseline where it pays at no level. A third configuration, "adaptive", is measured
            with that config.

The measurement and the decision are recorded on the host (`paths.speculation_record_path`,
`make_record`) with a fingerprint of what the service runs (release, patch set, profile, command
line, environment: `identity_fingerprint`): under "auto" a deploy benchmarks only when that
fingerprint changed, and otherwise decides from the recorded numbers (`speculation_wanted`).
operations/speculation.py measures; servestack/bench.py (`servestack bench`) reports.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone

SCHEMA = 1
SPECULATION, BASELINE, ADAPTIVE = "speculation", "baseline", "adaptive"
CONFIGURATIONS = (SPECULATION, BASELINE)   # measured under every policy; ADAPTIVE besides under "adaptive"
MEASURED_POLICIES = ("auto", "adaptive")   # the policies a deploy benchmarks for
ADAPTIVE_LEVELS = (1, 4, 16, 64)   # the deploy's benchmark under "adaptive" measures these concurrency levels

# SGLang's own adaptive config, as sglang 0.5.14 has it (srt/speculative/adaptive_spec_params.py
# DEFAULT_ADAPTIVE_CONFIG, L22-47; docs/facts/sglang-adaptive-speculation.md): the slot of batch size B
# applies from B running requests up to the next slot (`_find_closest_bs`, L341-343); candidate step 0
# is speculation off. The unit runs with it until the host's own measurements replace the slots.
SGLANG_DEFAULT_ADAPTIVE_CONFIG: dict[str, dict] = {
    "1": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
SPECULATION_OFF = SGLANG_DEFAULT_ADAPTIVE_CONFIG["64"]   # SGLang's own off slot: candidate steps [0]


# --- what the service runs -----------------------------------------------------------------------

def identity_fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


_IDENTITY_WORDS = {"release": "the release", "patchset": "the patch set", "profile": "the service profile",
                   "launch_module": "the launch module", "arguments": "the server's command line",
                   "environment": "the service environment"}


def what_changed(recorded: dict | None, identity: dict) -> str:
    """In words, what differs between the identity a record was measured for and `identity`."""
    if not recorded:
        return "what the service runs is not in the record"
    changed = []
    for key, words in _IDENTITY_WORDS.items():
        before, now = recorded.get(key), identity.get(key)
        if before == now:
            continue
        changed.append(f"{words} {before} -> {now}" if key in ("release", "profile") else words)
    return ", ".join(changed) or "what the service runs"


# --- decisions -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    """What a host serves: "speculation", "baseline" or "adaptive", the measured gain at concurrency 1
    (None: not measured), why."""

    configuration: str
    gain: float | None
    why: str

    @property
    def speculation(self) -> bool:
        return self.configuration != BASELINE


def gain_of(speculation_mean: float, baseline_mean: float) -> float | None:
    """How much faster speculation is: 0.038 for +3.8%."""
    if baseline_mean <= 0:
        return None
    return speculation_mean / baseline_mean - 1


def _numbers(speculation_mean: float, baseline_mean: float, gain: float | None) -> str:
    shown = "n/a" if gain is None else f"{gain:+.1%}"
    return f"{speculation_mean:.1f} tok/s with speculation vs {baseline_mean:.1f} without ({shown})"


def pays(gain: float | None, min_gain: float, speculation_mean: float) -> bool:
    """Whether speculation pays: a gain of at least `min_gain` (no baseline to compare: any speed)."""
    return speculation_mean > 0 if gain is None else gain >= min_gain


def decide(policy: str, min_gain: float, speculation_mean: float, baseline_mean: float) -> Decision:
    """The configuration `policy` picks given both configurations' mean output tok/s at concurrency 1."""
    gain = gain_of(speculation_mean, baseline_mean)
    numbers = _numbers(speculation_mean, baseline_mean, gain)
    if policy == "on":
        return Decision(SPECULATION, gain, f"speculation on (service_speculation = 'on'): {numbers}")
    if policy == "off":
        return Decision(BASELINE, gain, f"speculation off (service_speculation = 'off'): {numbers}")
    if pays(gain, min_gain, speculation_mean):
        return Decision(SPECULATION, gain, f"speculation kept: {numbers}, at least the {min_gain:+.1%} "
                                           "service_speculation_min_gain")
    return Decision(BASELINE, gain, f"speculation off: {numbers}, less than the {min_gain:+.1%} "
                                    "service_speculation_min_gain: the host serves without speculation")


def means(record: dict | None) -> tuple[float, float] | None:
    """(speculation, baseline) mean output tok/s at concurrency 1 of a record, None when it has none."""
    if record is None:
        return None
    try:
        return _mean(record, SPECULATION), _mean(record, BASELINE)
    except (KeyError, TypeError, ValueError):
        return None


def _mean(record: dict, configuration: str) -> float:
    return float(record["configurations"][configuration]["output_tok_s"]["mean"])


def record_decision(policy: str, min_gain: float, record: dict | None) -> Decision | None:
    found = means(record)
    if record is None or not found:
        return None
    if policy == "adaptive":
        plan = adaptive_plan(min_gain, record["configurations"])
        return plan.decision(gain_of(*found)) if plan else None
    return decide(policy, min_gain, *found)


def record_is_current(record: dict | None, fingerprint: str, policy: str | None = None) -> bool:
    """The record measured what the service runs now (and holds both configurations' numbers; under
    "adaptive", a measurement made for it: the numbers per concurrency level and its plan)."""
    if not record:
        return False
    if policy == "adaptive" and ADAPTIVE not in record:
        return False
    return record.get("schema") == SCHEMA and record.get("fingerprint") == fingerprint and means(record) is not None


def current_decision(policy: str, min_gain: float, record: dict | None, fingerprint: str) -> Decision | None:
    """What the recorded numbers decide when the record measured what the service runs now, else None."""
    return record_decision(policy, min_gain, record) if record_is_current(record, fingerprint, policy) else None


def speculation_wanted(policy: str, min_gain: float, record: dict | None, fingerprint: str) -> bool:
    """Whether the unit runs the profile's speculative flags: "on" yes, "off" no; "auto" as the
    recorded numbers decide when they were measured for what the service runs, else yes (the profile
    as written, until the deploy's benchmark decides)."""
    if policy != "auto":
        return policy == "on"
    decision = current_decision(policy, min_gain, record, fingerprint)
    return True if decision is None else decision.speculation


@dataclass(frozen=True)
class Served:
    """What the unit runs: "speculation", "baseline" or "adaptive" (with SGLang's adaptive config)."""

    configuration: str
    adaptive_config: dict | None = None

    @property
    def speculation(self) -> bool:
        return self.configuration != BASELINE


def served(policy: str, min_gain: float, record: dict | None, fingerprint: str) -> Served:
    """What the unit runs under `policy`: under "adaptive", the config the recorded numbers give when they
    were measured for what the service runs (or the baseline where speculation paid at no level), else
    SGLang's own config until the deploy's benchmark measures; the others as `speculation_wanted`."""
    if policy != "adaptive":
        return Served(SPECULATION if speculation_wanted(policy, min_gain, record, fingerprint) else BASELINE)
    if record is None or not record_is_current(record, fingerprint, policy):
        return Served(ADAPTIVE, SGLANG_DEFAULT_ADAPTIVE_CONFIG)
    plan = adaptive_plan(min_gain, record["configurations"])
    if plan is None or plan.config is None:
        return Served(BASELINE)
    return Served(ADAPTIVE, plan.config)


def benchmark_reason(policy: str, min_gain: float, record: dict | None, identity: dict) -> tuple[bool, str]:
    """Whether a deploy benchmarks this host now, and why (or why not)."""
    if policy not in MEASURED_POLICIES:
        served = "with" if policy == "on" else "without"
        return False, (f"service_speculation = '{policy}': the unit runs {served} the profile's speculative flags; "
                       "no benchmark (servestack bench measures on demand)")
    fingerprint = identity_fingerprint(identity)
    if not record:
        return True, "no speculation decision is recorded on the host yet"
    decision = current_decision(policy, min_gain, record, fingerprint)
    if decision is not None:
        return False, f"measured for what the service runs ({_measured(record)}): " + decision.why
    if record.get("fingerprint") == fingerprint and policy == "adaptive" and means(record) is not None:
        return True, ("the last benchmark was not made for service_speculation = 'adaptive' (no numbers per "
                      "concurrency level and no adaptive config recorded)")
    if record.get("fingerprint") == fingerprint:
        return True, "the record of the last benchmark holds no usable numbers"
    changed = what_changed(record.get("identity"), identity)
    return True, f"what the service runs changed since the last benchmark: {changed}"


def _measured(record: dict) -> str:
    return f"by {record.get('by', '?')} at {record.get('measured_at', '?')}"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_record(identity: dict, policy: str, min_gain: float, results: dict, decision: Decision, *,
                by: str, run_id: str, request: str | None, method_: dict, plan: "AdaptivePlan | None" = None) -> dict:
    """What the host keeps (`paths.speculation_record_path`): the measurement of both configurations (and
    of the adaptive one, where measured), the decision, and under "adaptive" the config and its numbers."""
    simulated = any((result.get("server") or {}).get("standin") for result in results.values())
    extra = {} if plan is None else {ADAPTIVE: plan.as_record()}
    return {**extra, "schema": SCHEMA, "fingerprint": identity_fingerprint(identity), "identity": identity,
            "policy": policy, "min_gain": min_gain, "decision": decision.configuration, "gain": decision.gain,
            "why": decision.why, "by": by, "run_id": run_id, "request": request, "measured_at": utc_now(),
            "simulated": simulated, "method": {key: value for key, value in method_.items() if key != "url"},
            "configurations": {name: results[name] for name in (*CONFIGURATIONS, ADAPTIVE) if name in results}}


def crossover(record: dict) -> int | None:
    """The first concurrency level where speculation no longer beats the baseline (None: never)."""
    try:
        levels = {name: {level["concurrency"]: level["tok_s"]["mean"] for level in
                         record["configurations"][name]["concurrency"]} for name in CONFIGURATIONS}
    except (KeyError, TypeError):
        return None
    for level in sorted(set(levels[SPECULATION]) & set(levels[BASELINE])):
        if levels[SPECULATION][level] <= levels[BASELINE][level]:
            return level
    return None


# --- "adaptive": SGLang's adaptive config from the host's own crossover ----------------------------

def level_means(configurations: dict, configuration: str) -> dict[int, float]:
    """Aggregate output tok/s per concurrency level of one measured configuration ({} when absent)."""
    try:
        return {level["concurrency"]: float(level["tok_s"]["mean"])
                for level in configurations[configuration]["concurrency"]}
    except (KeyError, TypeError, ValueError):
        return {}


@dataclass(frozen=True)
class AdaptivePlan:
    """SGLang's adaptive config for a host and the numbers it came from.

    off_from: the running batch size from which speculation is off (its slot's candidate steps [0]):
    the first concurrency level measured where speculation stops paying, or, where it paid at every
    level measured, SGLang's own off slot above them (None: none). config: None where speculation paid
    at no level (the lowest one measured): the host serves the baseline, since SGLang needs the
    profile's --speculative-num-steps among the config's steps (srt/arg_groups/speculative_hook.py
    `_init_adaptive_speculative_params`, L487-511) and speculation off everywhere is the baseline
    with a draft model loaded. levels: per level measured, both means and speculation's gain."""

    off_from: int | None
    config: dict | None
    levels: tuple[dict, ...]
    min_gain: float

    def why(self) -> str:
        numbers = ", ".join(f"{_signed(level['gain'])} at {level['concurrency']}" for level in self.levels)
        measured = f"speculation's gain by concurrency: {numbers} (at least {self.min_gain:+.1%} pays)"
        if self.config is None:
            return f"adaptive speculation: speculation pays at no level measured, {measured}: the baseline is served"
        kept = [key for key, slot in self.config.items() if slot["candidate_steps"] != [0]]
        slots = f"SGLang's own slots {', '.join(kept)}" if kept else "no slot of SGLang's"
        if self.off_from is None:
            return f"adaptive speculation: {slots}, never off: {measured}"
        measured_here = any(level["concurrency"] == self.off_from for level in self.levels)
        where = ("where it stops paying" if measured_here
                 else "SGLang's own off slot: speculation paid at every level measured")
        return (f"adaptive speculation: {slots}, speculation off from {self.off_from} running requests, {where}; "
                f"{measured}")

    def decision(self, gain_at_1: float | None) -> Decision:
        return Decision(BASELINE if self.config is None else ADAPTIVE, gain_at_1, self.why())

    def as_record(self) -> dict:
        return {"off_from": self.off_from, "config": self.config, "levels": list(self.levels),
                "min_gain": self.min_gain, "why": self.why()}


def _signed(gain: float | None) -> str:
    return "n/a" if gain is None else f"{gain:+.1%}"


def adaptive_plan(min_gain: float, configurations: dict) -> AdaptivePlan | None:
    """The adaptive config from both configurations' aggregate tok/s per concurrency level (None: no
    level measured by both).

    A running batch of B requests is routed to the slot of the largest configured batch size <= B
    (sglang 0.5.14 adaptive_spec_params.py `_route`, L327-343), so speculation off from concurrency N is
    a slot "N": [0], with SGLang's own slots below N kept. Between two levels measured, the one where
    speculation still paid and the first where it no longer does, the crossover is not known: the
    off slot is the first level measured to lose. Speculation stops only where a measurement says it
    no longer pays; below that, SGLang's own slots (from 8: with step 0 among their candidates) still
    turn it down by its acceptance."""
    speculation, baseline = level_means(configurations, SPECULATION), level_means(configurations, BASELINE)
    common = sorted(set(speculation) & set(baseline))
    if not common:
        return None
    gains = {level: gain_of(speculation[level], baseline[level]) for level in common}
    levels = tuple({"concurrency": level, "speculation": speculation[level], "baseline": baseline[level],
                    "gain": gains[level]} for level in common)
    losing = [level for level in common if not pays(gains[level], min_gain, speculation[level])]
    if losing and losing[0] == common[0]:
        return AdaptivePlan(losing[0], None, levels, min_gain)
    off_from = losing[0] if losing else _sglang_off_slot_above(common[-1])
    config = {key: slot for key, slot in SGLANG_DEFAULT_ADAPTIVE_CONFIG.items()
              if (off_from is None or int(key) < off_from) and slot["candidate_steps"] != [0]}
    if off_from is not None:
        config[str(off_from)] = SPECULATION_OFF
    return AdaptivePlan(off_from, config, levels, min_gain)


def _sglang_off_slot_above(level: int) -> int | None:
    """The smallest batch size above `level` where SGLang's own config turns speculation off."""
    above = [int(key) for key, slot in SGLANG_DEFAULT_ADAPTIVE_CONFIG.items()
             if slot["candidate_steps"] == [0] and int(key) > level]
    return min(above) if above else None


def adaptive_config_text(config: dict) -> str:
    """The config file's bytes (`--speculative-adaptive-config`): the same config, the same bytes."""
    return json.dumps(config, indent=1) + "\n"
