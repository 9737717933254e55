"""The verification suite's adapter: a pyinfra inventory (group data, --limit, connectors) becomes
testinfra backends reaching each host the way pyinfra does, with that host's settings."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from servestack.checks.catalogue import CHECKS
from servestack.checks.outcome import FAILED, PASSED, SKIPPED
from servestack.errors import ConfigError
from servestack.fleet import limited, load_inventory
from servestack.verify import (Backend, Results, backend_for, parse_host_data, render, targets_from_inventory,
                               targets_from_testinfra)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """An inventory with SSH hosts (group data for one group), @local and @chroot."""
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text('gpu_compute_capability = "9.0"\n')
    (tmp_path / "group_data" / "gpu_hosts.py").write_text(textwrap.dedent("""\
        ssh_user = "ubuntu"
        _sudo = True
        ssh_key = "/keys/fleet key"
        ssh_known_hosts_file = "/keys/known_hosts"
        ssh_strict_host_key_checking = "yes"
        gpu_count = 4
        service_tp = 4
    """))
    path = tmp_path / "inventory.py"
    path.write_text(textwrap.dedent("""\
        gpu_hosts = [
            ("node-01", {"ssh_hostname": "10.0.0.1", "ssh_port": 2222}),
            ("node-02", {"ssh_hostname": "fd00::2", "gpu_count": 2, "service_tp": 2}),
        ]
        workstation = [("@local", {"servestack_allow_local": True, "gpu_count": 1, "service_tp": 1})]
        images = [("@chroot/srv/image", {"gpu_count": 1, "service_tp": 1})]
    """))
    return path


def by_name(targets) -> dict:
    return {target.name: target for target in targets}


def test_group_data_and_host_data_become_each_hosts_settings(inventory):
    targets = by_name(targets_from_inventory(inventory))
    assert list(targets) == ["node-01", "node-02", "@local", "@chroot/srv/image"]
    assert {t.settings.gpu_compute_capability for t in targets.values()} == {"9.0"}  # group_data/all.py
    assert targets["node-01"].settings.gpu_count == 4                               # group_data/gpu_hosts.py
    assert targets["node-02"].settings.gpu_count == 2                               # host data wins
    assert targets["@local"].settings.venv_path == "/opt/ml-env"                    # manifest default


def test_ssh_hosts_map_to_openssh_with_pyinfras_ssh_data(inventory):
    hosts = {host.name: host for host in load_inventory(inventory)}
    backend = backend_for(hosts["node-01"])
    options = dict(backend.options)
    assert backend.hostspec == "ssh://ubuntu@10.0.0.1:2222"
    assert options["ssh_identity_file"] == "/keys/fleet key"
    assert options["sudo"] is True
    assert "-o UserKnownHostsFile=/keys/known_hosts" in options["ssh_extra_args"]
    assert "-o StrictHostKeyChecking=yes" in options["ssh_extra_args"]
    assert "-o BatchMode=yes" in options["ssh_extra_args"]
    assert backend_for(hosts["node-02"]).hostspec == "ssh://ubuntu@[fd00::2]"


def test_the_ssh_command_testinfra_builds_carries_key_port_known_hosts_and_sudo(inventory):
    hosts = {host.name: host for host in load_inventory(inventory)}
    testinfra_backend = backend_for(hosts["node-01"]).connect().backend
    command, arguments = testinfra_backend._build_ssh_command("true")
    line = testinfra_backend.quote(" ".join(command), *arguments)
    assert line.startswith("ssh ")
    assert "-o User=ubuntu" in line and "-o Port=2222" in line
    assert "-i '/keys/fleet key'" in line
    assert "ControlMaster=auto" in line and "ControlPath=" in line
    assert testinfra_backend.get_command("id -u").startswith("sudo /bin/sh -c")


def control_path(backend) -> str:
    extra = dict(backend.options)["ssh_extra_args"]
    return next(part.split("=", 1)[1] for part in extra.split() if part.startswith("ControlPath="))


def test_hosts_of_two_fleets_at_the_same_address_never_share_a_master_connection():
    """OpenSSH's %C hashes only the local host, address, port, user and jump host: two fleets (or two
    sandboxes) with the same private addresses would share one master and read each other's hosts."""
    from servestack.verify import ssh_backend

    fleet = {"ssh_hostname": "10.0.0.2", "ssh_user": "root", "ssh_key": "/keys/a", "ssh_known_hosts_file": "/kh/a"}
    other_keys = {**fleet, "ssh_key": "/keys/b", "ssh_known_hosts_file": "/kh/b"}
    assert control_path(ssh_backend("h1", fleet)) == control_path(ssh_backend("h1", dict(fleet)))
    assert control_path(ssh_backend("h1", fleet)) != control_path(ssh_backend("h1", other_keys))
    assert control_path(ssh_backend("h1", fleet)) != control_path(ssh_backend("h1", {**fleet, "ssh_port": 2222}))
    # and per network namespace: the same address in another namespace is another machine
    namespace = os.stat("/proc/self/ns/net").st_ino
    assert os.path.basename(os.path.dirname(control_path(ssh_backend("h1", fleet)))) == (
        f"servestack-ssh-{os.getuid()}-{namespace}")


def test_local_and_chroot_hosts_map_to_their_testinfra_backends(inventory):
    hosts = {host.name: host for host in load_inventory(inventory)}
    assert backend_for(hosts["@local"]) == Backend("local://")
    chroot = backend_for(hosts["@chroot/srv/image"])
    assert chroot == Backend("/srv/image", (("connection", "chroot"),))
    assert type(chroot.connect().backend).__name__ == "ChrootBackend"
    assert chroot.connect().backend.name == "/srv/image"


@pytest.mark.parametrize("limit, expected", [
    (["gpu_hosts"], ["node-01", "node-02"]),
    (["node-02"], ["node-02"]),
    (["node-*", "@local"], ["node-01", "node-02", "@local"]),
    (["images", "node-01"], ["node-01", "@chroot/srv/image"]),
])
def test_limit_takes_groups_hosts_and_globs_like_pyinfra(inventory, limit, expected):
    assert [host.name for host in limited(load_inventory(inventory), limit)] == expected


def test_a_limit_matching_nothing_is_refused(inventory):
    with pytest.raises(ConfigError, match="--limit gpu-hosts: no group or host of the inventory matches"):
        limited(load_inventory(inventory), ["node-01", "gpu-hosts"])


def test_a_comma_does_not_separate_limit_names_as_in_pyinfra(inventory):
    """pyinfra matches `--limit node-01,node-02` as one name; servestack's commands say so, with the fix."""
    with pytest.raises(ConfigError, match=r"--limit node-01,node-02: no group or host of the inventory is named "
                                          r"that; a comma does not separate names: give --limit once per name "
                                          r"\(--limit node-01 --limit node-02\)"):
        limited(load_inventory(inventory), ["node-01,node-02"])


def test_bad_host_data_is_refused_naming_host_and_key(inventory):
    with pytest.raises(ConfigError, match=r"host node-02: 'gpu_count': expected an integer from 1 to 64"):
        targets_from_inventory(inventory, ["node-02"], override_data={"gpu_count": 0})


def test_override_data_applies_to_every_host(inventory):
    targets = targets_from_inventory(inventory, override_data={"gpu_compute_capability": "12.0"})
    assert {target.settings.gpu_compute_capability for target in targets} == {"12.0"}


def test_passwords_and_unsupported_connectors_are_refused():
    with pytest.raises(ConfigError, match="host n1: the verification suite does not use SSH passwords"):
        backend_for(SimpleNamespace(name="n1", connector_cls=_ssh(), data=_Data({"ssh_password": "x"})))
    from pyinfra.connectors.docker import DockerConnector

    with pytest.raises(ConfigError, match="host @docker/ubuntu: .* cannot reach hosts of pyinfra's DockerConnector"):
        backend_for(SimpleNamespace(name="@docker/ubuntu", connector_cls=DockerConnector, data=_Data({})))


def test_missing_inventory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="inventory file not found"):
        load_inventory(tmp_path / "nope.py")


def test_host_data_overrides_parse_like_pyinfras_data_option():
    assert parse_host_data(["gpu_count=4", 'gpu_compute_capability="9.0"', "x=true"]) == {
        "gpu_count": 4, "gpu_compute_capability": "9.0", "x": True}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_host_data(["gpu_count"])


def test_testinfra_hosts_get_manifest_expectations_plus_host_data():
    [target] = targets_from_testinfra(["local://"], {"gpu_count": 2, "service_tp": 2})
    assert target.name == "local" and target.settings.gpu_count == 2
    assert target.settings.gpu_compute_capability == "12.0"


def test_the_table_lists_checks_in_catalogue_order_with_every_reason():
    from rich.console import Console

    results = Results()
    results.add("service_active", "n1", PASSED, "")
    results.add("driver_version", "n1", SKIPPED, "no NVIDIA driver answers on n1: nvidia-smi not found")
    results.add("driver_version", "n2", FAILED, "driver 570.1 on n2 is older than 580.82.07")
    results.add("driver_version", "n2", PASSED, "")  # a later report never hides a failure
    console = Console(record=True, width=120)
    render(results, console)
    text = console.export_text()
    assert text.index("driver_version") < text.index("service_active")
    assert "skipped n1 driver_version: no NVIDIA driver answers on n1" in text
    assert "failed n2 driver_version: driver 570.1 on n2 is older" in text
    assert "1 passed, 1 failed, 1 skipped on 2 host(s)" in text


def test_an_unreachable_host_is_one_line_not_one_per_check():
    from rich.console import Console

    from servestack.verify import UNREACHABLE

    results = Results()
    why = f"{UNREACHABLE} n2 (ssh://10.0.0.2): ssh: connect to host 10.0.0.2 port 22: Connection timed out"
    for check in ("driver_version", "nvcc_version", "service_active"):
        results.add(check, "n1", PASSED, "")
        results.add(check, "n2", FAILED, why)
    results.add("gpu_count", "n1", FAILED, "1 GPU on n1, expected 8")
    console = Console(record=True, width=300)
    render(results, console)
    lines = console.export_text().splitlines()
    assert [line for line in lines if "n2" in line and "Connection timed out" in line] == [
        f"unreachable n2: {why} (3 checks not run)"]
    assert "failed n1 gpu_count: 1 GPU on n1, expected 8" in lines
    assert lines[-1] == "3 passed, 1 failed, 0 skipped on 2 host(s); 1 could not be reached"


def test_the_suite_is_parametrised_per_inventory_host(inventory):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/verify", "--inventory", str(inventory), "--limit", "gpu_hosts",
         "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert "tests/verify/test_gpu.py::test_driver_version[node-01]" in ids
    assert "tests/verify/test_release.py::test_package_version[node-02-torch]" in ids
    assert not any("@local" in line for line in ids)
    per_host = len(CHECKS) - 1 + len(targets_from_inventory(inventory, "node-01")[0].settings.packages)
    assert len(ids) == 2 * per_host


def test_without_hosts_the_suite_fails_with_one_line_instead_of_passing_empty():
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/verify", "-q", "-rs", "-p", "no:cacheprovider"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 4, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "ERROR: no host to verify: give --inventory INVENTORY (and --limit GROUP_OR_HOST) or --hosts ssh://HOST"]
    assert " passed" not in result.stdout and " skipped" not in result.stdout


def test_bad_inventory_stops_the_suite_with_servestacks_message(inventory):
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/verify", "--inventory", str(inventory),
                             "--limit", "nowhere", "-q", "-p", "no:cacheprovider"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 4
    assert "--limit nowhere: no group or host of the inventory matches" in result.stderr


def _ssh():
    from pyinfra.connectors.ssh import SSHConnector

    return SSHConnector


class _Data(dict):
    def dict(self):
        return dict(self)


def test_an_unreachable_host_fails_each_check_once_tried_without_retrying():
    from servestack.settings import settings_from_data
    from servestack.verify import Target, Unreachable

    calls = []

    def connect():
        calls.append(1)
        raise RuntimeError("ssh: connect to host 10.0.0.9 port 22: Connection timed out")

    target = Target("node-09", settings_from_data("node-09", {}), connect, "ssh://10.0.0.9")
    for _ in range(3):
        with pytest.raises(Unreachable, match="cannot run the probes on node-09 .*Connection timed out"):
            target.read("host")
    assert len(calls) == 1
    with pytest.raises(pytest.fail.Exception, match="cannot run the probes on node-09"):
        target.check("driver_version")


def test_a_host_ssh_cannot_reach_is_named_with_sshs_own_words_not_every_probe(tmp_path):
    """testinfra raises its whole CommandResult (the probe scripts included: 140 KB for `status`)."""
    from servestack.verify import Unreachable

    with socket.socket() as probe:     # a loopback port nothing listens on: the connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f'hosts = [("sr", {{"ssh_hostname": "127.0.0.1", "ssh_port": {port}, '
                         f'"servestack_allow_local": True}})]\n')
    target = targets_from_inventory(str(inventory), None, action="read", local=False)[0]
    with pytest.raises(Unreachable) as error:
        target.read("host")
    message = str(error.value)
    assert "Connection refused" in message and "ssh exited 255" in message and len(message) < 700


def test_the_example_inventorys_placeholders_are_refused():
    with pytest.raises(ConfigError, match="host gpu-node-01.example: 'gpu-node-01.example' is a placeholder"):
        targets_from_inventory(ROOT / "inventory.py")


def test_loading_an_inventory_leaves_this_process_unpatched_and_closing_fds(inventory: Path):
    """pyinfra_cli's import gevent-patches the process; patched, os.close defers closing directory
    fds to a hub that never runs, and each rmtree leaked one fd per directory (EMFILE in CI)."""
    program = textwrap.dedent(f"""\
        import os, shutil, subprocess, tempfile
        from gevent import monkey
        from servestack.fleet import load_inventory
        assert list(load_inventory({str(inventory)!r}))
        subprocess.run(["true"], check=True)  # patched, this starts gevent's hub
        tree = tempfile.mkdtemp()
        for index in range(30):
            os.makedirs(os.path.join(tree, str(index), "a", "b"))
        before = len(os.listdir("/proc/self/fd"))
        shutil.rmtree(tree)
        print(monkey.is_module_patched("os"), len(os.listdir("/proc/self/fd")) - before)
        """)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "0"]


# --- the reports: whole reasons when not a terminal, every row naming its subject ----------------


LONG_REASON = ("sglang.service is inactive (dead) on n1: ActiveState=inactive, SubState=dead, UnitFileState=enabled, "
               "LoadState=loaded, NeedDaemonReload=no; the unit's last start: <urlopen error [Errno 111] Connection "
               "refused> after 120 s of waiting for GET http://127.0.0.1:30000/health")
PACKAGES = ("torch", "torchvision", "torchaudio", "sglang", "sgl-kernel", "flashinfer-python")


def _results_of_a_fleet(hosts=("n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8")) -> Results:
    results = Results()
    for host in hosts:
        results.add("driver_version", host, PASSED, "")
        for package in PACKAGES:
            results.add(f"package_version[{package}]", host, PASSED, "")
        results.add("service_active", host, FAILED, LONG_REASON.replace("n1", host))
        results.add("cuda_sample", host, SKIPPED,
                    f"no /dev/nvidiactl on {host}: no GPU device the CUDA runtime could open")
    results.add("package_version[torch]", "n2", FAILED, "torch 2.9.1+cu128 on n2, expected 2.9.1+cu130")
    return results


def test_not_on_a_terminal_every_reason_is_printed_whole_on_one_line():
    import io

    from servestack.verify import UNCUT_WIDTH, report_console

    out = io.StringIO()
    console = report_console(file=out)
    assert not console.is_terminal and console.width == UNCUT_WIDTH
    render(_results_of_a_fleet(), console)
    lines = out.getvalue().splitlines()
    assert f"failed n8 service_active: {LONG_REASON.replace('n1', 'n8')}" in lines
    assert "failed n2 package_version[torch]: torch 2.9.1+cu128 on n2, expected 2.9.1+cu130" in lines
    assert "skipped n3 cuda_sample: no /dev/nvidiactl on n3: no GPU device the CUDA runtime could open" in lines
    assert "…" not in out.getvalue()
    assert lines[-1] == "55 passed, 9 failed, 8 skipped on 8 host(s)"


def test_every_row_names_its_subject_in_the_order_the_checks_ran():
    import io

    from servestack.verify import report_console

    out = io.StringIO()
    render(_results_of_a_fleet(), report_console(file=out))
    rows = [line.split("│")[1].strip() for line in out.getvalue().splitlines() if line.startswith("│")]
    assert rows == ["driver_version", "cuda_sample", *[f"package_version[{package}]" for package in PACKAGES],
                    "service_active"]
    table_row = next(line for line in out.getvalue().splitlines() if "package_version[torch]" in line)
    assert table_row.count("pass") == 7 and table_row.count("FAIL") == 1


def test_on_a_narrow_terminal_names_fold_instead_of_being_cut():
    import io

    from servestack.verify import report_console

    out = io.StringIO()
    console = report_console(file=out, force_terminal=True, width=70, color_system=None)
    assert console.is_terminal and console.width == 70
    render(_results_of_a_fleet(), console)
    text = out.getvalue()
    assert "…" not in text
    assert "package_version[torch]: torch 2.9.1+cu128 on n2," in text  # a reason wraps: nothing is lost
    assert "GET \nhttp://127.0.0.1:30000/health" in text and "55 passed, 9 failed, 8 skipped on 8 host(s)" in text


def test_the_totals_show_when_no_check_ran():
    import io

    from servestack.verify import report_console

    out = io.StringIO()
    render(Results(), report_console(file=out))
    assert out.getvalue() == "0 passed, 0 failed, 0 skipped on 0 host(s): no check ran\n"


def test_read_all_reads_each_host_and_names_the_one_that_cannot_be_read(tmp_path):
    import testinfra

    from facts.batch import FactRequest
    from facts.host import HostLock, LockState
    from servestack.settings import settings_from_data
    from servestack.verify import Target, Unreachable, read_all

    def unreachable():
        raise RuntimeError("ssh: connect to host 10.0.0.9 port 22: No route to host")

    here = Target("here", settings_from_data("here", {}), lambda: testinfra.get_host("local://"), "local://")
    away = Target("away", settings_from_data("away", {}), unreachable, "ssh://10.0.0.9")
    (tmp_path / "lock").write_text('{"run_id": "r1", "started": "20260107T095900Z", "pid": null}\n')
    found = read_all([here, away], lambda target: [FactRequest.of(HostLock, state_dir=str(tmp_path))])
    assert list(found) == ["here", "away"]
    [lock] = found["here"]
    assert isinstance(lock, LockState) and lock.present and lock.run_id == "r1"
    assert isinstance(found["away"], Unreachable) and "No route to host" in str(found["away"])


def test_reports_other_than_verify_refuse_this_machine_unless_allowed(tmp_path):
    path = tmp_path / "inventory.py"
    path.write_text('hosts = [("localhost", {}), ("@local", {"servestack_allow_local": True}), ("10.0.0.1", {})]\n')
    refusal = r"cannot read the hosts' status:\nhost localhost: 'localhost' is this machine"
    with pytest.raises(ConfigError, match=refusal):
        targets_from_inventory(path, action="read the hosts' status", local=False)
    limited = targets_from_inventory(path, ["@local", "10.*"], local=False)
    assert [target.name for target in limited] == ["@local", "10.0.0.1"]
    assert len(targets_from_inventory(path)) == 3  # the verification suite checks wherever it is pointed
