"""The speculation policy's decisions and the host's record of a benchmark (pure; issue 17).

Two configurations of the host's service profile are measured: with its speculative flags
("speculation") and without them ("baseline"). The policy (`service_speculation`) chooses:

    "on"    speculation          "off"   baseline
    "auto"  speculation only if its mean output tok/s at concurrency 1 beats the baseline's by at
            least service_speculation_min_gain (default 0.02: 2%)

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
SPECULATION, BASELINE = "speculation", "baseline"
CONFIGURATIONS = (SPECULATION, BASELINE)


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
    """What a host serves: "speculation" or "baseline", the measured gain (None: not measured), why."""

    configuration: str
    gain: float | None
    why: str

    @property
    def speculation(self) -> bool:
        return self.configuration == SPECULATION


def gain_of(speculation_mean: float, baseline_mean: float) -> float | None:
    """How much faster speculation is: 0.038 for +3.8%."""
    if baseline_mean <= 0:
        return None
    return speculation_mean / baseline_mean - 1


def _numbers(speculation_mean: float, baseline_mean: float, gain: float | None) -> str:
    shown = "n/a" if gain is None else f"{gain:+.1%}"
    return f"{speculation_mean:.1f} tok/s with speculation vs {baseline_mean:.1f} without ({shown})"


def decide(policy: str, min_gain: float, speculation_mean: float, baseline_mean: float) -> Decision:
    """The configuration `policy` picks given both configurations' mean output tok/s at concurrency 1."""
    gain = gain_of(speculation_mean, baseline_mean)
    numbers = _numbers(speculation_mean, baseline_mean, gain)
    if policy == "on":
        return Decision(SPECULATION, gain, f"speculation on (service_speculation = 'on'): {numbers}")
    if policy == "off":
        return Decision(BASELINE, gain, f"speculation off (service_speculation = 'off'): {numbers}")
    wins = speculation_mean > 0 if gain is None else gain >= min_gain
    if wins:
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
    return decide(policy, min_gain, *found) if found else None


def record_is_current(record: dict | None, fingerprint: str) -> bool:
    """The record measured what the service runs now (and holds both configurations' numbers)."""
    if not record:
        return False
    return record.get("schema") == SCHEMA and record.get("fingerprint") == fingerprint and means(record) is not None


def current_decision(policy: str, min_gain: float, record: dict | None, fingerprint: str) -> Decision | None:
    """What the recorded numbers decide when the record measured what the service runs now, else None."""
    return record_decision(policy, min_gain, record) if record_is_current(record, fingerprint) else None


def speculation_wanted(policy: str, min_gain: float, record: dict | None, fingerprint: str) -> bool:
    """Whether the unit runs the profile's speculative flags: "on" yes, "off" no; "auto" as the
    recorded numbers decide when they were measured for what the service runs, else yes (the profile
    as written, until the deploy's benchmark decides)."""
    if policy != "auto":
        return policy == "on"
    decision = current_decision(policy, min_gain, record, fingerprint)
    return True if decision is None else decision.speculation


def benchmark_reason(policy: str, min_gain: float, record: dict | None, identity: dict) -> tuple[bool, str]:
    """Whether a deploy benchmarks this host now, and why (or why not)."""
    if policy != "auto":
        served = "with" if policy == "on" else "without"
        return False, (f"service_speculation = '{policy}': the unit runs {served} the profile's speculative flags; "
                       "no benchmark (servestack bench measures on demand)")
    fingerprint = identity_fingerprint(identity)
    if not record:
        return True, "no speculation decision is recorded on the host yet"
    decision = current_decision(policy, min_gain, record, fingerprint)
    if decision is not None:
        return False, f"measured for what the service runs ({_measured(record)}): " + decision.why
    if record.get("fingerprint") == fingerprint:
        return True, "the record of the last benchmark holds no usable numbers"
    changed = what_changed(record.get("identity"), identity)
    return True, f"what the service runs changed since the last benchmark: {changed}"


def _measured(record: dict) -> str:
    return f"by {record.get('by', '?')} at {record.get('measured_at', '?')}"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_record(identity: dict, policy: str, min_gain: float, results: dict, decision: Decision, *,
                by: str, run_id: str, request: str | None, method_: dict) -> dict:
    """What the host keeps (`paths.speculation_record_path`): the measurement of both configurations and
    the decision."""
    simulated = any((results[name].get("server") or {}).get("standin") for name in CONFIGURATIONS)
    return {"schema": SCHEMA, "fingerprint": identity_fingerprint(identity), "identity": identity,
            "policy": policy, "min_gain": min_gain, "decision": decision.configuration, "gain": decision.gain,
            "why": decision.why, "by": by, "run_id": run_id, "request": request, "measured_at": utc_now(),
            "simulated": simulated, "method": {key: value for key, value in method_.items() if key != "url"},
            "configurations": {name: results[name] for name in CONFIGURATIONS}}


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
