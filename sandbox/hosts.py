"""Sandbox hosts: Debian bookworm systemd-nspawn machines reached over real SSH.

Each host is an overlay of the pristine rootfs (lower) and a per-host upper
directory, mounted inside a private mount namespace that only the host's
launcher process holds, so the machine's own mount table never shows it. The
host runs systemd as PID 1 under systemd-nspawn, in a network namespace of its
own joined to the sandbox's controller namespace by a veth pair.

Everything a sandbox creates is recorded in `sandbox.json` in its state
directory as soon as it exists, so `down()` removes exactly that, from this
process or a fresh one, after a complete or a partial `up()`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandbox import cgroups, network, ssh
from sandbox.rootfs import SUDO_USER, Log, ensure_rootfs, log_stderr, mounts_under

DEFAULT_STATE_ROOT = "/var/tmp/servestack-sandbox"
CONTROL_ROOT = Path("/run/servestack-sandbox")
NSPAWN_PROPAGATE = Path("/run/systemd/nspawn/propagate")
#: inotify instances one booted host holds (measured: ~7).
INOTIFY_PER_HOST = 8
STATE_FILE = "sandbox.json"
BOOTED_STATES = ("running", "degraded")
SSH_UNREACHABLE = 255
#: Seconds between repeated power-off requests to a host.
POWEROFF_RETRY = 0.5

PreBoot = Callable[["Host", Path], None]
PostBoot = Callable[["Host"], None]
HostData = Mapping[str, Any] | Callable[["Host"], Mapping[str, Any]]

# The launcher mounts the overlay in its private mount namespace, reports
# "ready", waits for one line on stdin (the tree is being prepared meanwhile)
# and then becomes systemd-nspawn, keeping its PID.
LAUNCHER = (
    'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" || exit 1; shift 4; '
    "echo ready; read -r gate || exit 1; exec \"$@\" </dev/null >&2"
)


class SandboxError(RuntimeError):
    """A sandbox could not be brought up, reached or torn down."""


@dataclass
class Host:
    """One sandbox host and where to find its pieces."""

    name: str
    machine: str
    netns: str
    address: str
    controller_address: str
    controller_ifname: str
    dir: Path
    pid: int | None = None
    ssh_port: int = 22

    @property
    def upper_path(self) -> Path:
        """Overlay upper dir: every file the host changed, readable from anywhere."""
        return self.dir / "upper"

    @property
    def merged_path(self) -> Path:
        """Mount point of the overlay; populated only inside the host's mount namespace."""
        return self.dir / "merged"

    @property
    def root_path(self) -> Path:
        """The host's root tree as seen from this mount namespace (while the host runs).

        This is the overlay itself: file systems the host mounts on top of it
        (/tmp, /run, /dev, /proc, /sys) are not visible here.
        """
        if self.pid is None:
            raise SandboxError(f"host {self.name} has no running launcher")
        return Path(f"/proc/{self.pid}/root") / self.merged_path.relative_to("/")

    @property
    def console_log(self) -> Path:
        """Console and systemd-nspawn output of the host."""
        return self.dir / "console.log"

    def to_json(self) -> dict[str, Any]:
        """Serializable form for sandbox.json."""
        return {**asdict(self), "dir": str(self.dir)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Host:
        """Inverse of to_json."""
        return cls(**{**data, "dir": Path(data["dir"])})


class Sandbox:
    """A set of sandbox hosts plus a controller network namespace to reach them from.

    Use as a context manager to guarantee teardown::

        with Sandbox("mytest") as sandbox:
            sandbox.up(3)
            sandbox.exec(sandbox.hosts[0], "uname -a")

    `Sandbox(name)` in a fresh process picks up a sandbox that is already up
    (from its state dir), so `down()` and `exec()` work there too.
    """

    def __init__(
        self,
        name: str = "default",
        *,
        state_dir: Path | str | None = None,
        rootfs: Path | None = None,
        log: Log = log_stderr,
        boot_timeout: float = 90.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.name = name
        self.state_dir = Path(state_dir or default_state_dir(name)).absolute()
        self.id = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:6]
        self.controller_netns = f"ss{self.id}-ctl"
        self.rootfs = rootfs
        self.log = log
        self.boot_timeout = boot_timeout
        self.stop_timeout = stop_timeout
        self.hosts: list[Host] = []
        self.netns: list[str] = []
        self.cgroups: list[str] = []
        self.control_dir: Path | None = None
        self._launchers: dict[str, subprocess.Popen[str]] = {}
        if self.state_file.is_file():
            self._load()

    # -- files in the state dir -------------------------------------------

    @property
    def state_file(self) -> Path:
        """JSON record of everything this sandbox created."""
        return self.state_dir / STATE_FILE

    @property
    def key_path(self) -> Path:
        """Private key accepted by root and the sudo user on every host."""
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts_path(self) -> Path:
        """Pre-seeded known_hosts with every host's key."""
        return self.state_dir / "known_hosts"

    @property
    def ssh_config_path(self) -> Path:
        """OpenSSH client config (ssh -F, testinfra --ssh-config)."""
        return self.state_dir / "ssh_config"

    @property
    def inventory_path(self) -> Path:
        """pyinfra inventory with the group `sandbox_hosts`."""
        return self.state_dir / "inventory.py"

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # -- lifecycle -----------------------------------------------------------

    def up(self, n: int, *, pre_boot: PreBoot | None = None, post_boot: PostBoot | None = None) -> list[Host]:
        """Boot `n` hosts named h1..hn and wait until each is booted and answers SSH.

        `pre_boot(host, root_path)` may write into a host's tree before it
        boots; `post_boot(host)` runs once the host answers SSH. On any failure
        everything created so far is torn down before the error propagates.
        """
        if n < 1:
            raise ValueError(f"a sandbox needs at least one host, not {n}")
        if self.state_file.exists():
            raise SandboxError(f"sandbox {self.name!r} is already up (state in {self.state_dir}); run down first")
        links = network.choose_links(n, network.machine_networks())
        refuse_without_inotify_room(n)
        rootfs = self.rootfs = self.rootfs or ensure_rootfs(log=self.log)
        started = time.monotonic()
        self._claim_state_dir()
        try:
            self._create_ssh_identity()
            self._create_controller()
            for index, link in enumerate(links, start=1):
                self._start_host(index, link, rootfs, pre_boot)
            self._write_ssh_files()
            self.write_inventory()
            for host in self.hosts:
                self._wait_booted(host)
            if post_boot:
                for host in self.hosts:
                    post_boot(host)
        except BaseException:
            self.down()
            raise
        self.log(f"sandbox {self.name}: {n} hosts up in {time.monotonic() - started:.1f} s")
        return self.hosts

    def down(self) -> None:
        """Remove everything this sandbox created, and nothing else.

        Works after a complete or partial `up()`, and from a fresh process.
        """
        started = time.monotonic()
        self._close_ssh_masters()
        self._stop_hosts()
        for name in reversed(self.cgroups):
            cgroups.remove(name)
        for name in reversed(self.netns):
            network.delete_netns(name)
        if self.control_dir:
            shutil.rmtree(self.control_dir, ignore_errors=True)
        self._remove_state_dir()
        if self.hosts:
            self.log(f"sandbox {self.name}: down in {time.monotonic() - started:.1f} s")
        self.hosts, self.netns, self.cgroups, self.control_dir = [], [], [], None
        self._launchers.clear()

    # -- using the hosts ---------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called `name`."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"sandbox {self.name!r} has no host {name!r}")

    def controller_cmd(self, argv: Sequence[str]) -> list[str]:
        """Wrap `argv` to run inside the controller network namespace."""
        return network.netns_exec(self.controller_netns, list(argv))

    def ssh_argv(self, host: Host | str, cmd: str | Sequence[str], user: str = "root") -> list[str]:
        """ssh command line (wrapped for the controller namespace) running `cmd` on `host`."""
        name = host if isinstance(host, str) else host.name
        remote = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return self.controller_cmd(["ssh", "-F", str(self.ssh_config_path), "-l", user, name, "--", remote])

    def exec(
        self,
        host: Host | str,
        cmd: str | Sequence[str],
        user: str = "root",
        *,
        check: bool = False,
        timeout: float | None = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` (a shell string or argv) on `host` over SSH as `user`."""
        return subprocess.run(
            self.ssh_argv(host, cmd, user),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def write_inventory(self, extra_host_data: HostData | None = None, user: str = "root") -> Path:
        """(Re)write inventory.py for pyinfra, logging in as `user` ("root" or the sudo user).

        `extra_host_data` is merged into every host's data: a mapping, or a
        function of the Host returning one. Each host also carries
        `sandbox_controller_address`, where it reaches the controller.
        """
        if user not in ("root", SUDO_USER):
            raise ValueError(f"user must be 'root' or {SUDO_USER!r}, not {user!r}")
        entries = []
        for host in self.hosts:
            extra = extra_host_data(host) if callable(extra_host_data) else (extra_host_data or {})
            entries.append((host.name, {**self._host_data(host, user), **extra}))
        self.inventory_path.write_text(ssh.inventory(entries, f"pyinfra inventory of sandbox {self.name}"))
        return self.inventory_path

    def reboot(self, host: Host | str, *, hard: bool = True) -> None:
        """Restart `host`'s machine and wait until it has booted again and answers SSH.

        `hard=True` is a power loss: every process in the host's cgroup is SIGKILLed at once, no unit
        stops, nothing is flushed or unmounted by the host. `hard=False` is `systemctl reboot` on the
        host (systemd stops its units; systemd-nspawn then exits 133). Either way the host then boots
        from the same disk, at the same address, with the same host key and SSH identity.

        Kept, as on a disk: every file the host wrote to its root tree (the overlay's upper dir),
        /var and /opt included, whether or not it was synced (a real power loss may also lose writes
        not yet synced: this one does not). Lost: every process and connection, /run and /tmp (tmpfs,
        fresh at boot), the boot id. The controller's shared SSH connections to the host are closed
        first and a new one is made by the wait for the boot.
        """
        host = self.host(host) if isinstance(host, str) else host
        self._close_ssh_masters(host)
        if hard:
            _cut_power(host)
        else:
            self.exec(host, "systemctl reboot", timeout=self.stop_timeout)
        timeout = self.stop_timeout if hard else self.boot_timeout
        launcher = self._launchers.pop(host.name, None)
        if launcher is not None:   # ours: reap it, or it stays a zombie of the cgroup
            launcher.wait(timeout)
        if not cgroups.wait_empty(host.machine, timeout):
            raise SandboxError(f"host {host.name} did not stop for its reboot: "
                               f"{sorted(cgroups.pids(host.machine))} still run\n{_tail(host.console_log)}")
        # nspawn's sub-cgroups (payload/, supervisor/) of the stopped machine go with it, as at down()
        cgroups.remove(host.machine)
        cgroups.create(host.machine)
        clear_propagate_dir(host.machine)
        started = time.monotonic()
        assert self.rootfs is not None  # recorded by up()
        self._release(self._launch(host, self.rootfs))
        self._wait_booted(host)
        self.log(f"sandbox {self.name}: {host.name} rebooted ({'hard' if hard else 'systemctl reboot'}) "
                 f"in {time.monotonic() - started:.1f} s")

    # -- up, step by step ----------------------------------------------------

    def _claim_state_dir(self) -> None:
        """Create sandbox.json exclusively in an otherwise empty state dir.

        From then on the state dir is this sandbox's, and down() removes it.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.state_file.touch(exist_ok=False)
        except FileExistsError:
            raise SandboxError(f"sandbox {self.name!r} is already up (state in {self.state_dir})") from None
        if [path.name for path in self.state_dir.iterdir()] != [STATE_FILE]:
            self.state_file.unlink()
            raise SandboxError(f"state dir {self.state_dir} is not empty; remove it or pick another sandbox name")
        self._save()

    def _create_ssh_identity(self) -> None:
        """The client key pair and the directory of shared-connection sockets."""
        ssh.generate_key(self.key_path, f"servestack-sandbox-{self.name}")
        control_dir = CONTROL_ROOT / self.id
        control_dir.mkdir(parents=True, exist_ok=False)
        self.control_dir = control_dir
        self._save()

    def _create_controller(self) -> None:
        """The controller network namespace: every host is reached from here."""
        network.create_netns(self.controller_netns)
        self.netns.append(self.controller_netns)
        self._save()

    def _start_host(self, index: int, link: network.Link, rootfs: Path, pre_boot: PreBoot | None) -> None:
        """Network, cgroup and overlay for host number `index`, then release it to boot."""
        machine = f"ss{self.id}-h{index}"
        host = Host(
            name=f"h{index}",
            machine=machine,
            netns=machine,
            address=str(link.host),
            controller_address=str(link.controller),
            controller_ifname=f"h{index}",
            dir=self.state_dir / "hosts" / f"h{index}",
        )
        self.hosts.append(host)
        network.create_netns(host.netns)
        self.netns.append(host.netns)
        self._save()
        network.connect(self.controller_netns, host.controller_ifname, host.netns, link)
        cgroups.create(machine)
        self.cgroups.append(machine)
        self._save()
        clear_propagate_dir(machine)
        launcher = self._launch(host, rootfs)
        self._prepare_tree(host, host.root_path)
        if pre_boot:
            pre_boot(host, host.root_path)
        self._release(launcher)

    def _launch(self, host: Host, rootfs: Path) -> subprocess.Popen[str]:
        """Start the host's launcher in its cgroup and wait until its overlay is mounted."""
        layers = [rootfs, host.upper_path, host.dir / "work", host.merged_path]
        if any(char in str(path) for path in layers for char in ",:"):
            raise SandboxError(f"overlay paths must not contain ',' or ':': {layers}")
        for path in layers[1:]:
            path.mkdir(parents=True, exist_ok=True)   # a reboot boots from the disk (upper) the host had
        unshare = ["unshare", "--mount", "--propagation", "private"]
        launcher_argv = ["sh", "-c", LAUNCHER, "launcher", *map(str, layers)]
        with open(host.console_log, "ab") as console:
            launcher = subprocess.Popen(
                [*unshare, *launcher_argv, *_nspawn_argv(host)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=console,
                text=True,
                start_new_session=True,
            )
        self._launchers[host.name] = launcher
        host.pid = launcher.pid
        self._save()
        cgroups.attach(host.machine, launcher.pid)
        assert launcher.stdout is not None
        if launcher.stdout.readline().strip() != "ready":
            launcher.wait()
            raise SandboxError(f"host {host.name}: mounting its overlay failed\n{_tail(host.console_log)}")
        return launcher

    def _prepare_tree(self, host: Host, root: Path) -> None:
        """Identity, SSH server config and authorized keys of one host."""
        (root / "etc/hostname").write_text(f"{host.name}\n")
        (root / "etc/hosts").write_text(
            f"127.0.0.1 localhost\n{host.address} {host.name}\n{host.controller_address} controller\n"
        )
        (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
        public = ssh.generate_key(root / ssh.HOST_KEY, f"root@{host.name}")
        (host.dir / "host_key.pub").write_text(public + "\n")
        (root / ssh.SSHD_DROP_IN).write_text(ssh.sshd_drop_in(host.address))
        client_key = self.key_path.with_name(self.key_path.name + ".pub").read_text()
        for home, owner in (("root", "root"), (f"home/{SUDO_USER}", SUDO_USER)):
            _install_authorized_key(root, home, owner, client_key)

    @staticmethod
    def _release(launcher: subprocess.Popen[str]) -> None:
        """Let a waiting launcher exec systemd-nspawn."""
        assert launcher.stdin is not None and launcher.stdout is not None
        launcher.stdin.write("boot\n")
        launcher.stdin.close()
        launcher.stdout.close()

    def _write_ssh_files(self) -> None:
        """known_hosts and ssh_config covering every host."""
        lines = [
            ssh.known_hosts_line(host.name, host.address, (host.dir / "host_key.pub").read_text())
            for host in self.hosts
        ]
        self.known_hosts_path.write_text("".join(lines))
        assert self.control_dir is not None
        pairs = [(host.name, host.address) for host in self.hosts]
        self.ssh_config_path.write_text(
            ssh.ssh_config(pairs, self.key_path, self.known_hosts_path, self.control_dir)
        )

    def _wait_booted(self, host: Host) -> None:
        """Wait until systemd on `host` finished booting (running/degraded) and sshd answers."""
        deadline = time.monotonic() + self.boot_timeout
        while True:
            try:
                proc = self.exec(host, "systemctl is-system-running --wait", timeout=self.boot_timeout)
            except subprocess.TimeoutExpired:
                raise SandboxError(f"host {host.name} did not finish booting\n{_tail(host.console_log)}") from None
            state = proc.stdout.strip()
            if state in BOOTED_STATES:
                return
            launcher = self._launchers.get(host.name)
            if launcher is not None and launcher.poll() is not None:
                raise SandboxError(f"host {host.name} exited while booting\n{_tail(host.console_log)}")
            if proc.returncode != SSH_UNREACHABLE:
                raise SandboxError(f"host {host.name} failed to boot: state {state!r} {proc.stderr.strip()}")
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"host {host.name} did not answer SSH within {self.boot_timeout:.0f} s: "
                    f"{proc.stderr.strip()}\n{_tail(host.console_log)}"
                )
            time.sleep(0.1)

    def _host_data(self, host: Host, user: str) -> dict[str, Any]:
        """pyinfra SSH connection data for one host, and where its deploys fix the stack's hashes."""
        data: dict[str, Any] = {
            "ssh_hostname": host.address,
            "ssh_port": host.ssh_port,
            "ssh_user": user,
            "ssh_key": str(self.key_path),
            "ssh_known_hosts_file": str(self.known_hosts_path),
            "ssh_strict_host_key_checking": "yes",
            "ssh_allow_agent": False,
            "ssh_look_for_keys": False,
            "sandbox_controller_address": host.controller_address,
            # the stack hashes its deploys fix are the sandbox's (its stand-in wheels), gone with it
            "stack_locks_dir": str(self.state_dir / "locks"),
        }
        if user != "root":
            data["_sudo"] = True
        return data

    # -- down, step by step --------------------------------------------------

    def _close_ssh_masters(self, host: Host | None = None) -> None:
        """Stop every shared SSH connection whose socket lives in our control dir (with `host`: to it)."""
        if not (self.control_dir and self.control_dir.is_dir()):
            return
        for socket in self.control_dir.iterdir():
            if host is not None and not socket.name.endswith(f"@{host.address}:{host.ssh_port}"):
                continue
            subprocess.run(
                ["ssh", "-F", "/dev/null", "-o", f"ControlPath={socket}", "-O", "exit", "sandbox-host"],
                capture_output=True,
                check=False,
            )

    def _stop_hosts(self) -> None:
        """Power hosts off (SIGTERM to nspawn), then SIGKILL whatever is left in their cgroups.

        SIGTERM is repeated because systemd ignores the shutdown request while
        it is still starting up.
        """
        deadline = time.monotonic() + self.stop_timeout
        next_request = 0.0
        while busy := self._busy_cgroups():
            now = time.monotonic()
            if now > deadline:
                break
            if now >= next_request:
                for host in self.hosts:
                    if host.machine in busy:
                        self._request_poweroff(host)
                next_request = now + POWEROFF_RETRY
            time.sleep(0.05)
        for name in self._busy_cgroups():
            self.log(f"sandbox {self.name}: {name} did not power off in time; killing it")
            cgroups.kill(name)
            if not cgroups.wait_empty(name, self.stop_timeout):
                raise SandboxError(f"processes of {name} survived SIGKILL: {sorted(cgroups.pids(name))}")
        for host in self.hosts:
            clear_propagate_dir(host.machine)

    def _busy_cgroups(self) -> list[str]:
        """Reap our own exited launchers, then list the host cgroups that still hold processes."""
        for launcher in self._launchers.values():
            launcher.poll()
        return [name for name in self.cgroups if cgroups.pids(name)]

    @staticmethod
    def _request_poweroff(host: Host) -> None:
        """SIGTERM the host's launcher (systemd-nspawn), if it is still the process we started."""
        if host.pid is not None and host.pid in cgroups.pids(host.machine):
            os.kill(host.pid, signal.SIGTERM)

    def _remove_state_dir(self) -> None:
        """Delete the state dir, if it is ours (it holds sandbox.json) and nothing is mounted in it."""
        if not self.state_file.is_file():
            return
        mounted = mounts_under(self.state_dir)
        if mounted:
            raise SandboxError(f"refusing to remove {self.state_dir}: mounted there: {', '.join(mounted)}")
        shutil.rmtree(self.state_dir)

    # -- persistence ----------------------------------------------------------

    def _save(self) -> None:
        """Write sandbox.json atomically with everything created so far."""
        record = {
            "name": self.name,
            "id": self.id,
            "state_dir": str(self.state_dir),
            "controller_netns": self.controller_netns,
            "control_dir": str(self.control_dir) if self.control_dir else None,
            "netns": self.netns,
            "cgroups": self.cgroups,
            "rootfs": str(self.rootfs) if self.rootfs else None,   # the hosts' lower layer: a reboot boots it again
            "hosts": [host.to_json() for host in self.hosts],
        }
        partial = self.state_file.with_name(STATE_FILE + ".part")
        partial.write_text(json.dumps(record, indent=2) + "\n")
        partial.rename(self.state_file)

    def _load(self) -> None:
        """Pick up a sandbox recorded in sandbox.json (by this or another process)."""
        record = json.loads(self.state_file.read_text())
        self.id = record["id"]
        self.controller_netns = record["controller_netns"]
        self.netns = list(record["netns"])
        self.cgroups = list(record["cgroups"])
        self.control_dir = Path(record["control_dir"]) if record["control_dir"] else None
        self.rootfs = Path(record["rootfs"]) if record.get("rootfs") else self.rootfs
        self.hosts = [Host.from_json(data) for data in record["hosts"]]


def inotify_instances_in_use() -> int:
    """inotify instances open by all processes (they count against one per-user limit, root's here)."""
    count = 0
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            count += sum(1 for fd in fd_dir.iterdir() if os.readlink(fd) == "anon_inode:inotify")
        except OSError:  # the process ended, or a descriptor closed, while we looked
            continue
    return count


def refuse_without_inotify_room(hosts: int) -> None:
    """Refuse (before creating anything) when `hosts` more systemd hosts would exhaust inotify instances.

    Each booted host's systemd, journald, logind and dbus hold about INOTIFY_PER_HOST instances;
    past fs.inotify.max_user_instances new hosts hang at boot with no sshd, which reads as a timeout.
    """
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    needed = inotify_instances_in_use() + hosts * INOTIFY_PER_HOST
    if needed > limit:
        raise SandboxError(
            f"{hosts} more host(s) need about {hosts * INOTIFY_PER_HOST} inotify instances but only "
            f"{max(0, limit - inotify_instances_in_use())} of fs.inotify.max_user_instances={limit} are free "
            "(other sandboxes are up?): take some down, or raise the limit, e.g. "
            "`sysctl fs.inotify.max_user_instances=1024`")


def clear_propagate_dir(machine: str) -> None:
    """Remove nspawn's leftover mount-propagation directory of a machine that is not running.

    systemd-nspawn creates /run/systemd/nspawn/propagate/<machine> and refuses to start a machine
    of that name again while it exists, when /run is not a tmpfs (as on this machine kind):
    "Attempted to remove disk file system ..., and we can't allow that". Only our own machine
    names reach here, before their launch and after they stopped.
    """
    path = NSPAWN_PROPAGATE / machine
    if path.is_dir() and not mounts_under(path):
        shutil.rmtree(path, ignore_errors=True)


def _cut_power(host: Host) -> None:
    """Kill every process of `host` at once, as a power loss stops a machine.

    One SIGKILL after another (`cgroups.kill`) is not a power loss: a process that outlives its child
    by a moment runs on (busy.sh removed lock.activity that way) and forks a process the loop never
    saw. The unified hierarchy's `cgroup.kill` kills the whole tree, new forks included, in one step.
    """
    (cgroups.HIERARCHIES[1] / host.machine / "cgroup.kill").write_text("1\n")
    cgroups.kill(host.machine)   # any process of the v1 hierarchy alone (none are expected)


def default_state_dir(name: str) -> Path:
    """State dir of sandbox `name`: $SERVESTACK_SANDBOX_DIR/<name>, default /var/tmp/servestack-sandbox/<name>."""
    return Path(os.environ.get("SERVESTACK_SANDBOX_DIR") or DEFAULT_STATE_ROOT) / name


def _nspawn_argv(host: Host) -> list[str]:
    """systemd-nspawn booting `host` from its merged overlay, in its network namespace."""
    return [
        "systemd-nspawn",
        "-q",
        f"--directory={host.merged_path}",
        "--boot",
        "--register=no",
        "--keep-unit",
        f"--machine={host.machine}",
        f"--network-namespace-path={network.NETNS_DIR / host.netns}",
        "--link-journal=no",
        "--resolv-conf=off",
        "--console=pipe",
    ]


def _install_authorized_key(root: Path, home: str, owner: str, public_key: str) -> None:
    """Authorize `public_key` for `owner` whose home is `root/home`, with sshd's required modes."""
    uid, gid = _passwd_ids(root, owner)
    ssh_dir = root / home / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    keys.write_text(public_key)
    keys.chmod(0o600)
    for path in (ssh_dir, keys):
        os.chown(path, uid, gid)


def _passwd_ids(root: Path, user: str) -> tuple[int, int]:
    """uid and gid of `user` in the tree's /etc/passwd."""
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise SandboxError(f"user {user} missing from {root}/etc/passwd")


def _tail(path: Path, lines: int = 30) -> str:
    """Last lines of a log file, for error messages."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
