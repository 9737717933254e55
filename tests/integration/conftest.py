"""Shared fixtures for integration tests: throwaway sandbox hosts reached over SSH.

`sandbox` is a session-scoped factory. Call it to get a Sandbox that is up::

    def test_something(sandbox):
        sb = sandbox(2, pre_boot=install_stand_ins)
        sb.exec(sb.hosts[0], "systemctl is-system-running", check=True)

Every sandbox it made is torn down when the session ends (whatever the
outcome); use the returned Sandbox as a context manager to tear it down
earlier. The rootfs is built (or taken from the cache) once per session.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sandbox import Sandbox, ensure_rootfs
from sandbox.hosts import PostBoot, PreBoot

REQUIRED_TOOLS = ("debootstrap", "systemd-nspawn", "unshare", "ip", "ssh", "ssh-keygen", "zstd")
# Set by .ci/run: integration tests that cannot run there are errors, not skips (a green CI run converged hosts).
REQUIRE_SANDBOX = "SERVESTACK_REQUIRE_SANDBOX"

SandboxFactory = Callable[..., Sandbox]


def pytest_configure(config: pytest.Config) -> None:
    """Register the `integration` marker."""
    config.addinivalue_line("markers", "integration: boots sandbox hosts (needs root and systemd-nspawn)")


def sandbox_unavailable() -> str | None:
    """Why sandbox hosts cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "sandbox hosts need root"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"sandbox hosts need {', '.join(missing)}"
    return None


REPOSITORY_LOCKS = Path(__file__).resolve().parents[2] / "files" / "locks"


@pytest.fixture(scope="session", autouse=True)
def repository_stack_hashes_untouched() -> Iterator[None]:
    """Sandbox deploys fix their stand-in wheels' hashes in the sandbox's own folder (sandbox/hosts.py),
    never in the repository's `files/locks`, which holds real fleets' hashes."""
    before = sorted(REPOSITORY_LOCKS.glob("*")) if REPOSITORY_LOCKS.exists() else []
    yield
    after = sorted(REPOSITORY_LOCKS.glob("*")) if REPOSITORY_LOCKS.exists() else []
    assert after == before, f"the integration tests wrote {sorted(set(after) - set(before))} into the repository"


@pytest.fixture(scope="session")
def sandbox_rootfs() -> Path:
    """The pristine rootfs, built on first use and cached across sessions."""
    reason = sandbox_unavailable()
    if reason and os.environ.get(REQUIRE_SANDBOX) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_SANDBOX}=1 requires the integration tests to run", pytrace=False)
    if reason:
        pytest.skip(reason)
    return ensure_rootfs()


@pytest.fixture(scope="session")
def sandbox_name() -> Callable[[str], str]:
    """Make sandbox names unique to this pytest process, so parallel runs never clash."""
    counter = itertools.count(1)

    def name(prefix: str = "t") -> str:
        return f"{prefix}{os.getpid()}-{next(counter)}"

    return name


class Made:
    """Everything the factories brought up, so each test module's leftovers are torn down with it."""

    def __init__(self) -> None:
        self.items: list = []

    def add(self, item):
        self.items.append(item)
        return item

    def tear_down_from(self, first: int) -> None:
        """Take down everything made since index `first` (newest first); raise once if any failed."""
        errors = []
        while len(self.items) > first:
            item = self.items.pop()
            try:
                item.down()
            except Exception as error:  # keep tearing down the others
                errors.append(f"{getattr(item, 'name', item)}: {error}")
        if errors:
            raise RuntimeError("sandbox teardown failed: " + "; ".join(errors))


@pytest.fixture(scope="session")
def made() -> Iterator[Made]:
    registry = Made()
    try:
        yield registry
    finally:
        registry.tear_down_from(0)


@pytest.fixture(scope="module", autouse=True)
def _tear_down_this_modules_sandboxes(made: Made) -> Iterator[None]:
    """Hosts made by module-scoped fixtures live as long as their module (memory, inotify instances)."""
    first = len(made.items)
    yield
    made.tear_down_from(first)


@pytest.fixture(autouse=True)
def _tear_down_this_tests_sandboxes(made: Made) -> Iterator[None]:
    """Hosts made by a test (or its function-scoped fixtures) end with it: they never pile up."""
    first = len(made.items)
    yield
    made.tear_down_from(first)


@pytest.fixture(scope="session")
def sandbox(sandbox_rootfs: Path, sandbox_name: Callable[[str], str], made: Made) -> SandboxFactory:
    """Factory `sandbox(n=1, *, pre_boot=None, post_boot=None) -> Sandbox` (already up)."""

    def make(n: int = 1, *, pre_boot: PreBoot | None = None, post_boot: PostBoot | None = None) -> Sandbox:
        sb = made.add(Sandbox(sandbox_name("t"), rootfs=sandbox_rootfs))
        sb.up(n, pre_boot=pre_boot, post_boot=post_boot)
        return sb

    return make


if TYPE_CHECKING:
    from sandbox.lab import Lab

LabFactory = Callable[..., "Lab"]


@pytest.fixture(scope="session")
def lab(sandbox_rootfs: Path, sandbox_name: Callable[[str], str], made: Made) -> LabFactory:
    """Factory `lab(n=1, **Lab.up kwargs) -> Lab`: dressed GPU-host stand-ins + artifact server, up.

    `lab.inventory_path` is a pyinfra inventory for them; run pyinfra in the controller
    namespace (`lab.controller_argv(argv)`, or the `run_pyinfra` helper in tests/integration/pyinfra_run.py).
    """
    from sandbox.lab import Lab

    def make(n: int = 1, **kwargs) -> Lab:
        the_lab = made.add(Lab(sandbox_name("l"), rootfs=sandbox_rootfs))
        the_lab.up(n, **kwargs)
        return the_lab

    return make


@pytest.fixture(scope="session")
def toolkit_lab(sandbox_rootfs: Path, sandbox_name: Callable[[str], str], tmp_path_factory):
    """Factory `toolkit_lab(prefix, folder, hosts) -> ToolkitLab` (tests/integration/toolkit_lab.py), up,
    under a new temporary directory `folder`. Not torn down with the test that made it: a module's or a
    class's fixture holds it as `with toolkit_lab(...) as tk: yield tk`, which stops it when they end.
    """
    from toolkit_lab import start_toolkit_lab

    def make(prefix: str, folder: str, hosts: int):
        return start_toolkit_lab(sandbox_name(prefix), tmp_path_factory.mktemp(folder), hosts=hosts,
                                 rootfs=sandbox_rootfs)

    return make
