"""Run the verification suite against every host of a pyinfra inventory (or testinfra --hosts).

    pytest tests/verify --inventory inventory.py [--limit GROUP_OR_HOST] [-m "not deployed"]
    pytest tests/verify --hosts=ssh://root@gpu-node-01 [--host-data gpu_compute_capability='"9.0"']

Every test takes the `target` fixture (servestack.verify.Target): one inventory host with its
settings (the expectations) and what its checks read of it. Tests are parametrised per
host, ids are the inventory's host names. `host` is that host's testinfra host, for checks of
your own. Tests marked `deployed` need what servestack's deploy leaves (records, the release,
the service); the others hold on any CUDA 13 host.
"""

from __future__ import annotations

import pytest

from servestack.checks.catalogue import CHECKS_BY_NAME
from servestack.errors import ConfigError
from servestack.fleet import LIMIT_HELP
from servestack.verify import Target, parse_host_data, prefetch, targets_from_inventory, targets_from_testinfra

TARGETS = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("servestack", "servestack verification")
    group.addoption("--inventory", default=None, help="pyinfra inventory file: verify each of its hosts")
    group.addoption("--limit", action="append", default=[],
                    help=LIMIT_HELP)
    group.addoption("--host-data", action="append", default=[], metavar="KEY=VALUE",
                    help="override host data for every host, parsed like pyinfra's --data")


def _targets(config: pytest.Config) -> list[Target]:
    option = config.option
    data = parse_host_data(option.host_data)
    if option.inventory and getattr(option, "hosts", None):
        raise pytest.UsageError("give --inventory or --hosts, not both")
    if option.inventory:
        return targets_from_inventory(option.inventory, option.limit, data)
    if getattr(option, "hosts", None):
        return targets_from_testinfra(
            option.hosts.split(","), data, connection=option.connection, ssh_config=option.ssh_config,
            ssh_identity_file=option.ssh_identity_file, sudo=option.sudo, sudo_user=option.sudo_user)
    # a run that verifies nothing must not pass: every check would be an empty, "passing" parameter set
    raise pytest.UsageError("no host to verify: give --inventory INVENTORY (and --limit GROUP_OR_HOST) "
                            "or --hosts ssh://HOST")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deployed: needs servestack's deploy (records, release, service)")
    try:
        config.stash[TARGETS] = _targets(config)
    except ConfigError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" not in metafunc.fixturenames:
        return
    targets = metafunc.config.stash[TARGETS]
    if "package" in metafunc.fixturenames:  # one test per (host, manifest package)
        pairs = [(target, package.name) for target in targets for package in target.settings.packages]
        metafunc.parametrize(("target", "package"), pairs, ids=[f"{t.name}-{p}" for t, p in pairs],
                             scope="module")
    else:
        metafunc.parametrize("target", targets, ids=[target.name for target in targets], scope="module")


def _check_name(item: pytest.Item) -> str:
    name = item.originalname.removeprefix("test_")
    package = item.callspec.params.get("package")
    return f"{name}[{package}]" if package else name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Label each test with its host and check (JUnit properties, `servestack verify`'s table)."""
    for item in items:
        target = getattr(item, "callspec", None) and item.callspec.params.get("target")
        if isinstance(target, Target):
            item.user_properties += [("servestack_host", target.name), ("servestack_check", _check_name(item))]


@pytest.fixture(scope="session", autouse=True)
def _read_all_hosts(request: pytest.FixtureRequest) -> None:
    """Read what every selected check reads, on all hosts at once, before the first test."""
    plan: dict[Target, set[str]] = {}
    for item in request.session.items:
        target = getattr(item, "callspec", None) and item.callspec.params.get("target")
        check = CHECKS_BY_NAME.get(item.originalname.removeprefix("test_"))
        if isinstance(target, Target) and check:
            plan.setdefault(target, set()).update(check.groups)
    if plan:
        prefetch(plan)


@pytest.fixture(scope="module")
def host(target: Target):
    """The target's testinfra host (overrides testinfra's fixture, so its tests follow the inventory)."""
    return target.host
