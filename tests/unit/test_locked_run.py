"""One skeleton of preflight, lock and steps (operations/preflight.py `locked_run`), which deploy.py,
rollback.py and `servestack bench`'s run (operations/speculation.py `bench_now`) run with their reads, their
choice of release and their steps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from operations import preflight

ROOT = Path(__file__).resolve().parents[2]


class Calls(list):
    """What locked_run called, in order; `passes`: what preflight answers."""

    passes = True


@pytest.fixture
def calls(monkeypatch) -> Calls:
    made = Calls()
    monkeypatch.setattr(preflight, "preflight", lambda reads, decides: made.append(("preflight", reads, decides))
                        or made.passes)
    monkeypatch.setattr(preflight, "lock", lambda reads: made.append(("lock", reads)))
    monkeypatch.setattr(preflight, "release_lock", lambda: made.append(("release_lock",)))
    return made


def reads(release=None):
    return ["read", release]


def test_the_steps_get_the_chosen_release_under_the_lock(calls):
    preflight.locked_run(reads=reads, decides=["decides"], choose=lambda: "r-1",
                         steps=lambda release: calls.append(("steps", release)))
    assert calls == [("preflight", ["read", None], ["decides"]), ("lock", ["read", "r-1"]), ("steps", "r-1"),
                     ("release_lock",)]


def test_a_refused_host_chooses_nothing_and_takes_no_lock(calls):
    calls.passes = False
    preflight.locked_run(reads=reads, decides=[], choose=lambda: pytest.fail("chose"),
                         steps=lambda release: pytest.fail("ran a step"))
    assert calls == [("preflight", ["read", None], [])]


def test_no_release_chosen_takes_no_lock(calls):
    preflight.locked_run(reads=reads, decides=[], choose=lambda: None, steps=lambda release: pytest.fail("ran a step"))
    assert calls == [("preflight", ["read", None], [])]


def _calls(tree: ast.AST) -> set[str]:
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("name", ["deploy.py", "rollback.py", "bench_now"])
def test_deploy_rollback_and_the_benchmark_run_the_one_skeleton(name):
    if name == "bench_now":
        module = ast.parse((ROOT / "operations" / "speculation.py").read_text())
        tree: ast.AST = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name)
    else:
        tree = ast.parse((ROOT / name).read_text())
    called = _calls(tree)
    assert "preflight.locked_run" in called
    assert not called & {"preflight.preflight", "preflight.lock", "preflight.release_lock"}
