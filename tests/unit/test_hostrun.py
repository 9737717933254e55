"""Bookkeeping writes (servestack/hostrun.py `keep`): they ride with the lock's release when this run
holds the lock, and run at once when it does not."""

from __future__ import annotations

import subprocess

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all

from facts.host import release_lock_command
from servestack import hostrun


def fake_host():
    inventory = Inventory((["@fake/gpu1"], {"fake_delay": 0, "fake_delay_jitter": 0}))
    state = State(inventory, Config())
    connect_all(state)
    return inventory.get_host("@fake/gpu1")


def test_while_the_run_holds_the_lock_bookkeeping_rides_with_its_release(tmp_path):
    host = fake_host()
    hostrun.release_lock_on_failure(host, str(tmp_path / "state"))
    hostrun.keep(host, f"echo one > {tmp_path / 'one'}", "the first record")
    hostrun.keep(host, "exit 7", "a record that cannot be written")
    assert host.connector.executed_commands == []  # no round trip of its own

    release = release_lock_command(str(tmp_path / "state"), "run-1")
    command, whats = hostrun.kept_with_release(host, release)
    assert command.endswith(release) and whats == ["the first record", "a record that cannot be written"]
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert (tmp_path / "one").read_text() == "one\n"
    assert result.stdout.splitlines() == [f"{hostrun.KEPT_FAILED} 1", "not-ours"]  # released all the same
    assert hostrun.kept_with_release(host, release) == (release, [])  # written once


def test_without_the_lock_bookkeeping_runs_at_once():
    host = fake_host()
    hostrun.keep(host, "echo record", "a record")
    assert host.connector.executed_commands == ["echo record"]
