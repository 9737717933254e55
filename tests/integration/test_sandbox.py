"""The sandbox harness: hosts boot, answer SSH, stay isolated and leave nothing behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandbox import hosts as hosts_module
from sandbox.hosts import NSPAWN_PROPAGATE
from sandbox import SUDO_USER, AddressCollision, Host, Sandbox, SandboxError
from sandbox import cgroups, network, rootfs
from sandbox.lab import Lab
from sandbox.network import POOL, UsedNetwork, choose_links, parse_resolvers, parse_routes

REPO = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")
SANDBOX_CLI = [sys.executable, "-m", "sandbox"]   # what ./servestack.sh sandbox runs
MARKER = "etc/servestack-pre-boot"

integration = pytest.mark.integration


# -- address chooser (no root needed) -----------------------------------------


def test_chooser_uses_the_start_of_the_benchmark_range():
    links = choose_links(2, parse_routes('[{"dst": "default", "dev": "eth0"}, {"dst": "10.0.0.0/8"}]'))
    assert [str(link.subnet) for link in links] == ["198.18.0.0/30", "198.18.0.4/30"]
    assert (str(links[0].controller), str(links[0].host)) == ("198.18.0.1", "198.18.0.2")


def test_chooser_skips_subnets_the_machine_uses():
    used = parse_routes('[{"dst": "198.18.0.0/29", "dev": "wg0"}]') + parse_resolvers("nameserver 198.18.0.9\n")
    assert [str(link.subnet) for link in choose_links(2, used)] == ["198.18.0.12/30", "198.18.0.16/30"]


def test_chooser_refuses_when_the_range_is_taken():
    used = parse_routes('[{"dst": "198.18.0.0/15", "dev": "tun0"}]')
    with pytest.raises(AddressCollision, match=r"198\.18\.0\.0/15 dev tun0"):
        choose_links(1, used)


def test_chooser_refuses_when_too_few_subnets_are_free():
    small_pool = network.IPv4Network("198.18.0.0/28")
    used = [UsedNetwork(network.IPv4Network("198.18.0.4/30"), "address 198.18.0.5/30 on vpn0")]
    with pytest.raises(AddressCollision, match="only 3 free .* vpn0"):
        choose_links(4, used, pool=small_pool)


def test_machine_networks_reads_routes_addresses_and_resolvers():
    sources = [entry.source for entry in network.machine_networks()]
    assert any(source.startswith("route 127.0.0.0/8") for source in sources)
    assert any(source.startswith("address 127.0.0.1/8 on lo") for source in sources)


def test_up_refuses_before_creating_anything_on_collision(monkeypatch, tmp_path):
    taken = [UsedNetwork(POOL, "route 198.18.0.0/15 dev tun0")]
    monkeypatch.setattr(network, "machine_networks", lambda: taken)
    sb = Sandbox("collide", state_dir=tmp_path / "collide")
    with pytest.raises(AddressCollision, match="tun0"):
        sb.up(1)
    assert not sb.state_dir.exists()


# -- booted hosts ------------------------------------------------------------------


def write_marker(host: Host, root: Path) -> None:
    """pre_boot hook: read a file of the lower layer, write one into the host's tree."""
    os_release = (root / "etc/os-release").read_text()
    (root / MARKER).write_text(f"{host.name} {'bookworm' in os_release}\n")


@pytest.fixture(scope="module")
def booted(sandbox):
    """Two hosts shared by the read-mostly tests of this module."""
    seen = []
    sb = sandbox(2, pre_boot=write_marker, post_boot=seen.append)
    assert seen == sb.hosts
    return sb


@integration
def test_hosts_answer_ssh_as_root_and_sudo_user(booted):
    for host in booted.hosts:
        assert booted.exec(host, "id -un", check=True).stdout.strip() == "root"
        assert booted.exec(host, "id -un", user=SUDO_USER, check=True).stdout.strip() == SUDO_USER
        assert booted.exec(host, "sudo -n id -un", user=SUDO_USER, check=True).stdout.strip() == "root"
        assert booted.exec(host, "hostname", check=True).stdout.strip() == host.name


@integration
def test_systemd_is_pid_1_and_booted(booted):
    for host in booted.hosts:
        assert booted.exec(host, "ps -p 1 -o comm=", check=True).stdout.strip() == "systemd"
        state = booted.exec(host, "systemctl is-system-running").stdout.strip()
        assert state in ("running", "degraded")


@integration
def test_hosts_have_distinct_identities(booted):
    machine_ids = {booted.exec(host, "cat /etc/machine-id", check=True).stdout for host in booted.hosts}
    host_keys = {(host.dir / "host_key.pub").read_text().split()[1] for host in booted.hosts}
    assert len(machine_ids) == len(host_keys) == len(booted.hosts)


@integration
def test_unknown_host_key_is_refused(booted):
    host = booted.hosts[0]
    argv = booted.ssh_argv(host, "true")
    strict_empty = ["-o", "UserKnownHostsFile=/dev/null", "-o", "ControlMaster=no", "-o", "ControlPath=none"]
    argv[argv.index("-F") : argv.index("-F")] = strict_empty
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 255
    assert "Host key verification failed" in proc.stderr


@integration
def test_hooks_see_and_write_the_host_tree(booted):
    for host in booted.hosts:
        assert booted.exec(host, f"cat /{MARKER}", check=True).stdout == f"{host.name} True\n"
        assert (host.upper_path / MARKER).is_file()
        (host.root_path / "var/tmp/from-controller").write_text("live\n")
        assert booted.exec(host, "cat /var/tmp/from-controller", check=True).stdout == "live\n"


@integration
def test_overlays_stay_out_of_the_machine_mount_table_and_pristine_tree(booted, sandbox_rootfs):
    mounts = Path("/proc/self/mounts").read_text()
    assert str(booted.state_dir) not in mounts and str(sandbox_rootfs) not in mounts
    for host in booted.hosts:
        assert str(host.merged_path) in Path(f"/proc/{host.pid}/mounts").read_text()  # in its own namespace only
    assert not (sandbox_rootfs / MARKER).exists()
    assert not list((sandbox_rootfs / "etc/ssh").glob("ssh_host_*"))
    assert not (sandbox_rootfs / "etc/ssh/sshd_config.d/servestack-sandbox.conf").exists()


@integration
def test_another_process_can_exec_and_read_the_state(booted):
    script = f"""
        from sandbox import Sandbox
        sb = Sandbox({booted.name!r}, state_dir={str(booted.state_dir)!r})
        print(sb.exec("h2", "hostname", check=True).stdout.strip())
    """
    proc = run_python(script)
    assert proc.stdout.strip() == "h2"
    record = json.loads(booted.state_file.read_text())
    assert [host["address"] for host in record["hosts"]] == [host.address for host in booted.hosts]


@integration
def test_unit_on_host_answers_on_host_address_from_controller(booted):
    host = booted.hosts[0]
    unit = f"""
        [Service]
        ExecStart=/usr/bin/python3 -m http.server 8080 --bind {host.address} --directory /srv
    """
    booted.exec(host, "echo hello-from-unit > /srv/index.txt", check=True)
    (host.root_path / "etc/systemd/system/probe.service").write_text(textwrap.dedent(unit))
    booted.exec(host, "systemctl daemon-reload && systemctl start probe", check=True)
    url = f"http://{host.address}:8080/index.txt"
    fetch = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    deadline = time.monotonic() + 15
    while True:
        proc = subprocess.run(booted.controller_cmd([sys.executable, "-c", fetch]), capture_output=True, text=True)
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert proc.stdout.strip() == "hello-from-unit", proc.stderr
    assert booted.exec(host, "systemctl show -p MainPID --value probe").stdout.strip() != "0"


@integration
def test_hosts_reach_the_controller_only(booted):
    host, other = booted.hosts
    assert "default" not in booted.exec(host, "ip -4 route", check=True).stdout
    assert "default" not in run(["ip", "-n", booted.controller_netns, "-4", "route"]).stdout
    for target in ("1.1.1.1", "192.0.2.1", other.address):
        proc = booted.exec(host, f"ip route get {target}")
        assert proc.returncode != 0 and "unreachable" in proc.stderr, (target, proc)
    assert booted.exec(host, "curl -sS -m 3 http://deb.debian.org/").returncode != 0
    assert booted.exec(host, "getent hosts controller", check=True).stdout.split()[0] == host.controller_address
    forwarding = run(["ip", "netns", "exec", booted.controller_netns, "sysctl", "-n", "net.ipv4.ip_forward"])
    assert forwarding.stdout.strip() == "0"


@integration
def test_pyinfra_runs_against_the_generated_inventory(booted):
    inventory = booted.write_inventory({"servestack_test_marker": "yes"}, user=SUDO_USER)
    data = inventory.read_text()
    assert "'_sudo': True" in data and "'ssh_strict_host_key_checking': 'yes'" in data
    proc = subprocess.run(
        booted.controller_cmd([str(PYINFRA), "-y", str(inventory), "exec", "--", "id -u"]),
        capture_output=True,
        text=True,
        cwd=booted.state_dir,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for host in booted.hosts:
        assert f"[{host.name}] 0" in proc.stdout + proc.stderr


@integration
def test_second_up_of_the_same_sandbox_is_refused(booted):
    with pytest.raises(SandboxError, match="already up"):
        Sandbox(booted.name, state_dir=booted.state_dir).up(1)


# -- teardown -------------------------------------------------------------------------


def leftovers(sb: Sandbox, names: list[str]) -> list[str]:
    """Anything of sandbox `sb` (with netns/cgroup `names`) still present on the machine."""
    found = [f"netns {name}" for name in names if network.netns_exists(name)]
    found += [f"cgroup {name}" for name in names if cgroups.exists(name)]
    found += [f"dir {path}" for path in (sb.state_dir, Path("/run/servestack-sandbox") / sb.id) if path.exists()]
    mounts = Path("/proc/self/mounts").read_text()
    found += [f"mount of {sb.state_dir}" for _ in [1] if str(sb.state_dir) in mounts]
    found += [f"process {pid}" for pid in live_processes_mentioning(f"ss{sb.id}-")]
    found += [f"nspawn propagate dir {path}" for path in NSPAWN_PROPAGATE.glob(f"ss{sb.id}-*")]
    return found


def live_processes_mentioning(needle: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains `needle`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        if needle in cmdline and state != "Z" and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def resource_names(sb: Sandbox) -> list[str]:
    return [sb.controller_netns, *(host.netns for host in sb.hosts)]


@integration
def test_failing_test_inside_context_manager_leaves_nothing(sandbox_rootfs, sandbox_name):
    sb = Sandbox(sandbox_name("fail"), rootfs=sandbox_rootfs)
    names: list[str] = []
    with pytest.raises(AssertionError, match="boom"):
        with sb:
            sb.up(2)
            names = resource_names(sb)
            assert all(network.netns_exists(name) for name in names)
            raise AssertionError("boom")
    assert names and leftovers(sb, names) == []


@integration
def test_a_machine_name_used_before_boots_again(sandbox_rootfs, sandbox_name):
    """nspawn refuses a machine whose propagate dir is left over on a non-tmpfs /run (this machine kind)."""
    sb = Sandbox(sandbox_name("again"), rootfs=sandbox_rootfs)
    leftover = NSPAWN_PROPAGATE / f"ss{sb.id}-h1"
    leftover.mkdir(parents=True, exist_ok=True)
    with sb:
        sb.up(1)
        assert sb.exec(sb.hosts[0], "true").returncode == 0
    assert not leftover.exists()


@integration
def test_failing_pre_boot_hook_cleans_up_partial_up(sandbox_rootfs, sandbox_name):
    def fail_on_h2(host: Host, root: Path) -> None:
        if host.name == "h2":
            raise RuntimeError("hook failed")

    sb = Sandbox(sandbox_name("hook"), rootfs=sandbox_rootfs)
    with pytest.raises(RuntimeError, match="hook failed"):
        sb.up(2, pre_boot=fail_on_h2)
    names = [f"ss{sb.id}-ctl", f"ss{sb.id}-h1", f"ss{sb.id}-h2"]
    assert leftovers(sb, names) == []


@integration
def test_down_from_fresh_process_after_crash_in_up(sandbox_rootfs, sandbox_name):
    name = sandbox_name("crash")
    script = f"""
        import os
        from pathlib import Path
        from sandbox import Sandbox
        def crash_on_h2(host, root):
            if host.name == "h2":
                os._exit(3)
        Sandbox({name!r}, rootfs=Path({str(sandbox_rootfs)!r})).up(2, pre_boot=crash_on_h2)
    """
    assert run_python(script, check=False).returncode == 3
    sb = Sandbox(name)
    names = resource_names(sb)
    assert len(names) == 3 and all(network.netns_exists(n) for n in names)
    sb.down()
    assert leftovers(sb, names) == []


@integration
def test_sandboxes_run_side_by_side_and_hosts_outlive_their_process(booted, sandbox_name, sandbox_rootfs):
    name = sandbox_name("cli")
    script = f"""
        from pathlib import Path
        from sandbox import Sandbox
        Sandbox({name!r}, rootfs=Path({str(sandbox_rootfs)!r})).up(1)
    """
    run_python(script)
    with Sandbox(name) as other:
        assert other.controller_netns != booted.controller_netns
        assert other.hosts[0].address == booted.hosts[0].address  # same addresses, separate namespaces
        assert other.exec("h1", "cat /etc/machine-id", check=True).stdout != booted.exec(
            "h1", "cat /etc/machine-id", check=True
        ).stdout
        names = resource_names(other)
    assert leftovers(other, names) == []
    assert booted.exec("h1", "true").returncode == 0


# -- the sandbox commands, as docs/sandbox.md shows them ---------------------------------------------------

# docs/sandbox.md's "Sandbox commands", verbatim: the sandbox is "default" there, named by SERVESTACK_SANDBOX here.
README_COMMANDS = {
    "up": './servestack.sh sandbox up --hosts 3 [--gpu "NVIDIA B200" --capability 10.0 --driver 580.159.04] '
          '[--user ubuntu]',
    "run": "./servestack.sh sandbox run -- .venv/bin/pyinfra /var/tmp/servestack-sandbox/default/inventory.py "
           "deploy.py --dry --diff",
    "exec": "./servestack.sh sandbox exec h1 -- systemctl status",
    "down": "./servestack.sh sandbox down",
}


def test_the_docs_show_the_sandbox_commands_tested_here():
    block = (REPO / "docs" / "sandbox.md").read_text().split("## Sandbox commands", 1)[1].split("```")[1]
    assert [line for line in block.splitlines()[1:] if line.strip()] == list(README_COMMANDS.values())


class CliSandbox:
    """A sandbox the `./servestack.sh sandbox` commands made, for the session's teardown: taken down as a fresh
    process would (nothing to do once `sandbox down` removed it)."""

    def __init__(self, name: str):
        self.name = name

    def down(self) -> None:
        Lab(self.name).down()


def readme_command(action: str, name: str) -> subprocess.CompletedProcess[str]:
    """docs/sandbox.md's `action` command, with the optional parts it shows, for the sandbox `name`."""
    text = README_COMMANDS[action].replace("[", "").replace("]", "")
    argv = shlex.split(text.replace("/servestack-sandbox/default/", f"/servestack-sandbox/{name}/"))
    return sandbox_cli(argv[2:], name)


def sandbox_cli(args: list[str], name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SANDBOX_CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, env={**os.environ, "SERVESTACK_SANDBOX": name})


@integration
def test_the_readme_sandbox_commands_up_run_exec_down(sandbox_rootfs, sandbox_name, made):
    name = made.add(CliSandbox(sandbox_name("readme"))).name
    up = readme_command("up", name)
    assert up.returncode == 0, up.stdout + up.stderr
    inventory = Path(f"/var/tmp/servestack-sandbox/{name}/inventory.py")
    assert f"inventory: {inventory}" in up.stdout and all(f"│ h{n} " in up.stdout for n in (1, 2, 3))
    lab = Lab(name)
    assert [host.name for host in lab.hosts] == ["h1", "h2", "h3"]
    data = inventory.read_text()
    assert data.count("'ssh_user': 'ubuntu'") == data.count("'_sudo': True") == 3       # --user ubuntu
    for host in lab.hosts:                                                              # --gpu --capability --driver
        gpus = lab.exec(host, "nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader",
                        check=True).stdout.splitlines()
        assert gpus and set(gpus) == {"NVIDIA B200, 10.0, 580.159.04"}

    before = lab.fingerprints()
    dry = readme_command("run", name)
    said = dry.stdout + dry.stderr
    assert dry.returncode == 0, said[-6000:]
    for host in lab.hosts:
        assert f"[{host.name}] install 13.0.1 into /usr/local/cuda-13.0" in said
        assert f"[{host.name}] will restart sglang.service on release r-" in said
    assert lab.fingerprints() == before, "the dry run changed a host"

    status = readme_command("exec", name)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("● h1\n"), status.stdout[:400]
    assert re.search(r"State: (running|degraded)", status.stdout), status.stdout[:400]
    unknown = sandbox_cli(["exec", "host1", "--", "true"], name)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == f"servestack: sandbox '{name}' has no host 'host1'; its hosts: h1, h2, h3"

    names = resource_names(lab.sandbox)
    down = readme_command("down", name)
    assert down.returncode == 0, down.stdout + down.stderr
    assert leftovers(lab.sandbox, names) == []
    assert live_processes_mentioning(str(lab.state_dir)) == []                         # the artifact server too
    gone = sandbox_cli(["exec", "h1", "--", "true"], name)
    assert gone.returncode == 2 and f"sandbox '{name}' is not up" in gone.stderr


# -- helpers ----------------------------------------------------------------------------


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True)


def run_python(script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `script` in a fresh interpreter with the repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=180
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# -- rootfs cache -----------------------------------------------------------------------


def test_recipe_key_follows_the_package_set_not_its_order():
    assert rootfs.recipe_key(("a", "b")) == rootfs.recipe_key(("b", "a"))
    assert rootfs.recipe_key(("a", "b")) != rootfs.recipe_key(("a", "b", "c"))
    assert rootfs.recipe_key() == rootfs.recipe_key(rootfs.PACKAGES)


@integration
def test_concurrent_processes_extract_the_rootfs_once(sandbox_rootfs, tmp_path):
    key = rootfs.recipe_key()
    cache = tmp_path / "cache"
    cache.mkdir()
    os.link(rootfs.tarball_path(key), cache / rootfs.tarball_path(key).name)
    script = "from sandbox import ensure_rootfs; print(ensure_rootfs())"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SERVESTACK_SANDBOX_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0]
        assert {out.strip() for out, _err in outputs} == {str(cache / f"rootfs-{key}")}
        logs = "".join(err for _out, err in outputs)
        assert logs.count("extracted") == 1 and logs.count("waiting") == 1, logs
        assert (cache / f"rootfs-{key}/etc/ssh/sshd_config").is_file()
        assert not list((cache / f"rootfs-{key}/etc/ssh").glob("ssh_host_*"))
    finally:
        shutil.rmtree(cache)  # a whole rootfs: do not leave it to pytest's tmp retention


def test_up_refuses_clearly_when_inotify_instances_would_run_out(monkeypatch, tmp_path):
    """Past fs.inotify.max_user_instances hosts hang at boot; refuse before creating anything."""
    monkeypatch.setattr(hosts_module, "inotify_instances_in_use", lambda: 120)
    sb = Sandbox("inotify", state_dir=tmp_path / "state")
    with pytest.raises(SandboxError, match=r"fs.inotify.max_user_instances=\d+ are free"):
        sb.up(2)
    assert not (tmp_path / "state").exists()
