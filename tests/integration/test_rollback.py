"""Rollback on a sandbox host: refuse with nothing to return to, back to the adopted env, idempotent,
roll forward without a rebuild, and to an explicit release."""

from __future__ import annotations

import json

import pytest

from venv_lab import RELEASES, ROLLBACK, STACK, UPGRADE, VENV, start_lab

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lab(sandbox):
    with start_lab(sandbox) as lab:
        yield lab


def torch_of(lab, host) -> str:
    return lab.sh(host, f"{VENV}/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'").strip()


def link(lab, host) -> str:
    return lab.sh(host, f"readlink {VENV} || echo not-a-link").strip()


def changes(report) -> int:
    return report["results"]["totals"]["success"]


def test_rollback_refuses_when_there_is_nothing_to_roll_back_to(lab):
    host = lab.sandbox.hosts[0]
    result, _ = lab.pyinfra(ROLLBACK)
    assert result.returncode != 0
    assert "refused: nothing to roll back to" in result.stdout + result.stderr
    assert link(lab, host) == "not-a-link" and torch_of(lab, host).endswith("+cu128 12.8")


def test_rollback_returns_to_the_adopted_env_and_is_idempotent(lab):
    host = lab.sandbox.hosts[0]
    result, _ = lab.pyinfra(UPGRADE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert torch_of(lab, host) == f"{STACK.package('torch').version} 13.0"
    new = link(lab, host)
    result, report = lab.pyinfra(ROLLBACK)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert changes(report) >= 1
    assert link(lab, host).startswith(f"{RELEASES}/adopted-")
    assert torch_of(lab, host).endswith("+cu128 12.8")  # the hand-made env works through /opt/ml-env again
    result, report = lab.pyinfra(ROLLBACK)
    assert result.returncode == 0 and changes(report) == 0, result.stderr[-2000:]
    assert lab.sh(host, f"test -d {new} && echo kept").strip() == "kept"


def test_deploy_rolls_forward_without_rebuilding(lab):
    host = lab.sandbox.hosts[0]
    built = lab.sh(host, f"cat {RELEASES}/r-*/release.json")
    result, report = lab.pyinfra(UPGRADE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch_of(lab, host) == f"{STACK.package('torch').version} 13.0"
    history = json.loads(lab.sh(host, "cat /var/lib/servestack/releases.json"))["activations"]
    assert [entry["by"] for entry in history] == ["adopt", "deploy", "rollback", "deploy"]
    assert lab.sh(host, f"cat {RELEASES}/r-*/release.json") == built  # re-activated, not rebuilt
    result, report = lab.pyinfra(UPGRADE)
    assert changes(report) == 0


def test_rollback_to_an_explicit_release(lab):
    host = lab.sandbox.hosts[0]
    adopted = lab.sh(host, f"ls -d {RELEASES}/adopted-*").strip().rsplit("/", 1)[1]
    current = link(lab, host)
    result, _ = lab.pyinfra(ROLLBACK, extra_data={"venv_rollback_to": adopted})
    assert result.returncode == 0, result.stderr[-2000:]
    assert link(lab, host) == f"{RELEASES}/{adopted}/venv"
    result, _ = lab.pyinfra(ROLLBACK, extra_data={"venv_rollback_to": "r-000000000000"})
    assert result.returncode != 0 and "is not kept on the host" in result.stdout + result.stderr
    assert link(lab, host) == f"{RELEASES}/{adopted}/venv"
    lab.pyinfra(UPGRADE)
    assert link(lab, host) == current
