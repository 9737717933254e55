"""The model weights check: the unit serves, for its model (and its draft, when it speculates), the directory
the weights step staged the pinned revision in, and that step's record says it verified that revision there
(servestack/weights.py `is_current`). A local model path (nothing staged) is skipped with the reason."""

from __future__ import annotations

import shlex

from servestack.checks.outcome import Fail, Skip
from servestack.paths import unit_path
from servestack.settings import Settings
from servestack.weights import MODEL_FLAGS, is_current, pinned_models


def exec_start_words(lines: list[str] | None) -> list[str]:
    """The words of a unit file's ExecStart= (the unit servestack writes has one, continued over lines)."""
    text = "\n".join(lines or []).replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            try:
                return shlex.split(line[len("ExecStart="):])
            except ValueError:
                return line[len("ExecStart="):].split()
    return []


def flag_value(words: list[str], flag: str) -> str | None:
    for word, value in zip(words, words[1:]):
        if word == flag:
            return value
    return next((word.partition("=")[2] for word in words if word.startswith(flag + "=")), None)


def served_weights(settings: Settings, readings) -> str:
    models = pinned_models(settings)
    if not models:
        raise Skip(f"{settings.service_name} serves no model staged from the Hub ({settings.service_model_path})")
    unit_lines, *records = readings.weights
    words = exec_start_words(unit_lines)
    if not words:
        raise Fail(f"{unit_path(settings)} {readings.on} has no ExecStart: the served model cannot be read")
    notes = []
    for model, record in zip(models, records):
        flag, wanted = MODEL_FLAGS[model.role], model.directory(settings)
        served = flag_value(words, flag)
        if served is None and model.role == "draft":
            notes.append(f"{model.label} not served (the unit does not speculate)")
            continue
        if served != wanted:
            raise Fail(f"{settings.service_name} {readings.on} serves {flag} {served}, expected {wanted} "
                       f"({model.label}, pinned)")
        if not is_current(record, model, settings):
            found = (f"its record names {record.get('repo')}@{str(record.get('revision'))[:12]} in "
                     f"{record.get('dir')}" if record else "no record of it")
            raise Fail(f"{wanted} {readings.on} is not a verified copy of {model.label}: {found} "
                       f"({model.record(settings)})")
        notes.append(f"{flag} {wanted}: {model.label}, verified {record.get('verified_at')}")
    return "; ".join(notes)
