"""A GPU-host lab: sandbox hosts dressed as pre-upgrade GPU hosts, an artifact server, an inventory.

`Lab(name).up(n)` boots `n` sandbox hosts (sandbox.hosts) dressed with the stand-ins
(a stand-in nvidia-smi, a CUDA 12.8 stand-in with /usr/local/cuda -> cuda-12.8, a hand-made
ml-env holding torch +cu128), starts the artifact server in the sandbox's controller namespace,
and writes an inventory whose host data points every URL of the manifest at that server. The
stand-in runfile cannot match the real one's size and checksums, so the hosts use a sandbox
copy of the manifest that differs from files/stack.toml only in those three values.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sandbox.hosts import Sandbox
from sandbox.rootfs import cache_dir
from sandbox.standins import hub
from sandbox.standins.build import ArtifactSet, build_artifacts, mirror_path
from sandbox.standins.host import dress_gpu_host
from sandbox.standins.index import write_simple_index
from sandbox.standins.nvidia_smi import Gpu
from sandbox.standins.realwheels import real_index
from sandbox.standins.runfile import RunfileInfo
from servestack.manifest import DEFAULT_MANIFEST, PROJECT_ROOT, load_manifest

ARTIFACT_PORT = 8080
SERVER_PID_FILE = "artifact-server.pid"
SERVER_LOG = "artifact-requests.log"
STANDINS_SOURCE = Path(__file__).resolve().parent / "standins"
# Where lab hosts keep the stand-in SGLang server the unit starts instead of sglang.launch_server.
STANDIN_SERVER_DIR = "/opt/servestack-sandbox-standins"
STANDIN_SERVER_MODULE = "fake_sglang_server"
# The dressed hosts' CUDA 12.8 runtime (a stand-in's text; serve_real_wheels makes it loadable).
CUDA_12_RUNTIME = "/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcudart.so.12"

# Host state that a deploy may touch: a dry run must leave every entry's listing unchanged.
FINGERPRINT_PATHS = ("/usr/local", "/opt", "/etc", "/var/lib/servestack", "/var/cache/servestack",
                     "/var/log/cuda-installer.log")
# The unit types a deploy may touch. Not mounts: systemd lists a service's /run/credentials mount
# some time after booting finished (seen: systemd-tmpfiles-setup's, seconds after
# `is-system-running` said "running"), which made "a dry run changed a host" fail at random.
FINGERPRINT_UNIT_TYPES = "service,socket,timer,path"
_SNAPSHOT = (f"find {' '.join(FINGERPRINT_PATHS)} -xdev -printf '%p %s %T@ %l %m\\n' 2>/dev/null | sort; "
             f"systemctl list-units --all --no-legend --plain --type={FINGERPRINT_UNIT_TYPES}")


def gpu_spec(model: str | None = None, capability: str | None = None, driver: str | None = None,
             count: int | None = None) -> Gpu:
    """The stand-in GPU: the fleet's defaults (manifest) with any given field replaced."""
    overrides: dict[str, Any] = {"name": model, "compute_cap": capability, "driver_version": driver, "count": count}
    return replace(Gpu(), **{key: value for key, value in overrides.items() if value is not None})


def _artifacts_key(runfile_mode: str) -> str:
    digest = hashlib.sha256(DEFAULT_MANIFEST.read_bytes())
    sources = (path for path in STANDINS_SOURCE.rglob("*") if path.is_file() and "__pycache__" not in path.parts)
    for source in sorted(sources):
        digest.update(source.read_bytes())
    return f"{runfile_mode}-{digest.hexdigest()[:12]}"


def cached_artifacts(runfile_mode: str = "normal") -> ArtifactSet:
    """The artifact tree for a runfile mode, built once per manifest and stand-in source version."""
    root = cache_dir() / "artifacts"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / _artifacts_key(runfile_mode)
    description = dest.with_suffix(".json")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not description.exists():
            description.write_text(json.dumps(_describe(build_artifacts(dest, runfile_mode=runfile_mode))))
    return _artifact_set(json.loads(description.read_text()))


def _describe(artifacts: ArtifactSet) -> dict:
    return {"root": str(artifacts.root), "runfile": str(artifacts.runfile),
            "runfile_info": asdict(artifacts.runfile_info), "md5sum": str(artifacts.md5sum),
            "indexes": {k: str(v) for k, v in artifacts.indexes.items()},
            "wheels": {k: str(v) for k, v in artifacts.wheels.items()},
            "broken_indexes": {k: str(v) for k, v in artifacts.broken_indexes.items()}}


def _artifact_set(described: dict) -> ArtifactSet:
    paths = lambda table: {key: Path(value) for key, value in table.items()}  # noqa: E731
    return ArtifactSet(Path(described["root"]), Path(described["runfile"]),
                       RunfileInfo(**described["runfile_info"]), Path(described["md5sum"]),
                       paths(described["indexes"]), paths(described["wheels"]),
                       paths(described["broken_indexes"]))


def private_copy(artifacts: ArtifactSet, dest: Path) -> ArtifactSet:
    """A copy of an artifact tree at `dest` made of hard links (an index page is replaced, never
    written in place: index.py), and the set's paths in it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["cp", "-al", str(artifacts.root), str(dest)], capture_output=True).returncode != 0:
        subprocess.run(["rm", "-rf", str(dest)], check=True)
        subprocess.run(["cp", "-a", str(artifacts.root), str(dest)], check=True)   # another filesystem
    moved = lambda path: dest / Path(path).relative_to(artifacts.root)  # noqa: E731
    return ArtifactSet(dest, moved(artifacts.runfile), artifacts.runfile_info, moved(artifacts.md5sum),
                       {key: moved(value) for key, value in artifacts.indexes.items()},
                       {key: moved(value) for key, value in artifacts.wheels.items()},
                       {key: moved(value) for key, value in artifacts.broken_indexes.items()})


def pin_standin_models(text: str) -> str:
    """The manifest's text with each model pinned to the stand-in Hub's commit of its repository."""
    for repo, commit in hub.commits().items():
        table = f'[service.models."{repo}"]\n'
        if text.count(table) != 1:
            raise RuntimeError(f"cannot pin the stand-in Hub's {repo}: {table.strip()} is not unique in the manifest")
        text = text.replace(table, f'{table}revision = "{commit}"   # the STAND-IN Hub\'s commit\n')
    return text


def sandbox_manifest(path: Path, artifacts: ArtifactSet) -> Path:
    """Write the hosts' copy of the manifest: the stand-in runfile's size and checksums in place."""
    real = load_manifest().runfiles["x86_64"]
    info = artifacts.runfile_info
    text = DEFAULT_MANIFEST.read_text()
    for old, new in ((str(real.size), str(info.size)), (real.md5, info.md5), (real.sha256, info.sha256)):
        if text.count(old) != 1:
            raise RuntimeError(f"cannot place the stand-in runfile's value: {old!r} is not unique in the manifest")
        text = text.replace(old, new)
    text = pin_standin_models(text)
    header = ("# SANDBOX COPY of files/stack.toml, written by sandbox.lab: identical but for the\n"
              "# x86_64 runfile's size and checksums, which are those of the STAND-IN runfile, and the\n"
              "# models' revisions, the STAND-IN Hub's commits (sandbox/standins/hub.py).\n")
    path.write_text(header + text)
    return path


class Lab:
    """Dressed sandbox hosts plus their artifact server (see the module docstring)."""

    artifacts: ArtifactSet  # what the lab serves, from `up` on
    gpu: Gpu  # the hosts' stand-in GPU, from `up` on

    def __init__(self, name: str = "default", *, state_dir: Path | None = None, rootfs: Path | None = None):
        self.sandbox = Sandbox(name, state_dir=state_dir, rootfs=rootfs)

    @property
    def state_dir(self) -> Path:
        return self.sandbox.state_dir

    @property
    def inventory_path(self) -> Path:
        return self.sandbox.inventory_path

    @property
    def hosts(self):
        return self.sandbox.hosts

    def up(self, hosts: int, *, gpu: Gpu | None = None, user: str = "root", runfile_mode: str = "normal",
           dress: bool = True, host_data: dict | None = None, private_artifacts: bool = False) -> Path:
        """Boot the lab; return the path of its pyinfra inventory. `private_artifacts`: serve a copy of
        the artifact tree (hard links) that `serve_more` may add to, leaving the shared one as it is."""
        self.gpu = gpu or gpu_spec()
        self.artifacts = cached_artifacts(runfile_mode)
        pre_boot = (lambda host, root: self._dress(root)) if dress else None
        self.sandbox.up(hosts, pre_boot=pre_boot)
        try:
            if private_artifacts:
                self.artifacts = private_copy(self.artifacts, self.state_dir / "artifacts")
            self._start_server()
            manifest = sandbox_manifest(self.state_dir / "stack.toml", self.artifacts)
            self.sandbox.write_inventory(lambda host: self.host_data(host, manifest, host_data or {}), user)
        except BaseException:
            self.down()
            raise
        return self.inventory_path

    def _dress(self, root: Path) -> None:
        dress_gpu_host(root, gpu=self.gpu)
        server_dir = root / STANDIN_SERVER_DIR.lstrip("/")
        server_dir.mkdir(parents=True, exist_ok=True)
        source = STANDINS_SOURCE / f"{STANDIN_SERVER_MODULE}.py"
        (server_dir / source.name).write_text(source.read_text())

    def host_data(self, host, manifest: Path, extra: dict) -> dict:
        """Host data pointing `host` at the lab's artifact server and stand-in GPU."""
        base_url = f"http://{host.controller_address}:{ARTIFACT_PORT}"
        tp = load_manifest().service["tp"]
        return {
            **self.artifacts.host_data(base_url),
            "servestack_manifest": str(manifest),
            "gpu_count": self.gpu.count,
            "gpu_compute_capability": self.gpu.compute_cap,
            "service_tp": tp if self.gpu.count % tp == 0 else self.gpu.count,
            "service_launch_module": STANDIN_SERVER_MODULE,
            "service_env": {"PYTHONPATH": STANDIN_SERVER_DIR},
            "service_health_timeout_s": 120,
            "service_hub_endpoint": f"{base_url}{hub.PREFIX}",
            **extra,
        }

    def serve_more(self, wheels: list[Path], upload_times: dict[str, str] | None = None) -> None:
        """Add `wheels` to the pypi-like index this lab serves (a private copy: `up(private_artifacts=True)`),
        with the `upload_times` given (file name -> RFC 3339; index.NEWER: after every stack's bound)."""
        if not self.artifacts.root.is_relative_to(self.state_dir):
            raise RuntimeError("serve_more needs a lab brought up with private_artifacts=True")
        write_simple_index(self.artifacts.indexes["pypi"], wheels, upload_times)

    def serve_real_wheels(self, stack: str) -> Path:
        """Serve the REAL wheels of manifest stack `stack` (realwheels.real_index, a hard-linked copy) under
        real/<stack>/ beside the stand-ins (a private copy: `up(private_artifacts=True)`); return that index's
        path. `real_wheels_data` points a host at it.

        The hosts' stand-in CUDA 12.8 runtime becomes a loadable library: real flashinfer (0.6.12
        flashinfer/jit/__init__.py L102-106) loads `libcudart.so.12` from /usr/local/cuda, which the deploy
        keeps at cuda-12.8 (cuda_link_policy "keep"), and the real library loads without a GPU where the
        stand-in's text would not. It becomes a glibc stub (libutil.so.1, empty since glibc 2.34)."""
        if not self.artifacts.root.is_relative_to(self.state_dir):
            raise RuntimeError("serve_real_wheels needs a lab brought up with private_artifacts=True")
        dest = self.artifacts.root / "real" / stack / mirror_path(load_manifest().indexes["pypi"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(real_index(load_manifest().stacks[stack])), str(dest)], check=True)
        for host in self.hosts:
            self.exec(host, f'cp --remove-destination /usr/lib/x86_64-linux-gnu/libutil.so.1 "$(readlink -f '
                            f'{CUDA_12_RUNTIME})"', check=True)
        return dest

    def real_wheels_data(self, host, index: Path) -> dict[str, str]:
        """Host data installing uv and every PyPI package from `index` (`serve_real_wheels`)."""
        url = self.artifacts.url(index, self.server_url(host))
        return {"uv_index_url": url, "index_pypi_url": url}

    def server_url(self, host) -> str:
        return f"http://{host.controller_address}:{ARTIFACT_PORT}"

    def _start_server(self) -> None:
        argv = [sys.executable, "-m", "sandbox.artifacts", "--root", str(self.artifacts.root),
                "--bind", "0.0.0.0", "--port", str(ARTIFACT_PORT), "--log", str(self.state_dir / SERVER_LOG)]
        server = subprocess.Popen(self.sandbox.controller_cmd(argv), cwd=PROJECT_ROOT, start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        (self.state_dir / SERVER_PID_FILE).write_text(f"{server.pid}\n")
        assert server.stdout is not None  # stdout=PIPE
        if "serving" not in (server.stdout.readline() or ""):
            raise RuntimeError("the artifact server did not start")

    def _stop_server(self) -> None:
        pid_file = self.state_dir / SERVER_PID_FILE
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(50):
                _reap(pid)
                os.killpg(pid, 0)
                time.sleep(0.1)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(pid)
        pid_file.unlink()

    def down(self) -> None:
        """Stop the artifact server, then remove the hosts and everything the sandbox created."""
        if self.state_dir.exists():
            self._stop_server()
        self.sandbox.down()

    def reboot(self, host, *, hard: bool = True) -> None:
        """Restart `host`'s machine (`Sandbox.reboot` says what a reboot keeps and loses); the artifact
        server, in the controller namespace, stays up."""
        self.sandbox.reboot(host, hard=hard)

    def controller_argv(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run in the controller namespace, where the hosts are reachable."""
        return self.sandbox.controller_cmd(argv)

    def run_in_controller(self, argv: list[str]) -> int:
        if not argv:
            argv = [os.environ.get("SHELL", "/bin/bash")]
        return subprocess.call(self.controller_argv(argv))

    def exec(self, host, cmd, **kwargs) -> subprocess.CompletedProcess:
        return self.sandbox.exec(host, cmd, **kwargs)

    def exec_interactive(self, host: str, argv: list[str]) -> int:
        ssh = self.sandbox.ssh_argv(host, argv or "exec bash -l")
        return subprocess.call(ssh[:ssh.index("ssh") + 1] + ["-t"] + ssh[ssh.index("ssh") + 1:])

    def fingerprint(self, host) -> str:
        """A hash of every path, size, mtime and link target under the paths a deploy may touch, and
        of the states of the systemd units of the types a deploy may touch (`snapshot`, hashed on
        the host)."""
        return self.sandbox.exec(host, f"{{ {_SNAPSHOT}; }} | sha256sum", check=True).stdout

    def fingerprints(self) -> dict[str, str]:
        return {host.name: self.fingerprint(host) for host in self.hosts}

    def snapshot(self, host) -> str:
        """What `fingerprint` hashes, as text: one line per path, then one per unit."""
        return self.sandbox.exec(host, _SNAPSHOT, check=True).stdout

    def snapshots(self) -> dict[str, str]:
        return {host.name: self.snapshot(host) for host in self.hosts}

    @staticmethod
    def changes(before: dict[str, str], after: dict[str, str], limit: int = 12) -> list[str]:
        """`host: - line` / `host: + line` for what differs between two `snapshots` (at most `limit`)."""
        found = []
        for name in before:
            old, new = set(before[name].splitlines()), set(after.get(name, "").splitlines())
            found += [f"{name}: - {line}" for line in sorted(old - new)]
            found += [f"{name}: + {line}" for line in sorted(new - old)]
        return found[:limit]

    def artifact_requests(self, status: int | None = None) -> dict[str, int]:
        """Requests per path the artifact server answered (with `status`, only those)."""
        return self._artifact_control("counts" if status is None else f"counts?status={status}")

    def artifact_bytes(self) -> dict[str, int]:
        """Bytes of files the artifact server sent, per path asked for (its /__control/bytes)."""
        return self._artifact_control("bytes")

    def _artifact_control(self, action: str):
        """The JSON answer of the artifact server's GET /__control/<action>, asked in the controller namespace."""
        argv = [sys.executable, "-c", "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                f"'http://127.0.0.1:{ARTIFACT_PORT}/__control/{action}').read().decode())"]
        result = subprocess.run(self.controller_argv(argv), capture_output=True, text=True, check=True)
        return json.loads(result.stdout)

    def print_status(self) -> None:
        table = Table(title=f"sandbox {self.sandbox.name}")
        for column in ("host", "address", "reaches controller at"):
            table.add_column(column)
        for host in self.hosts:
            table.add_row(host.name, host.address, host.controller_address)
        console = Console()
        console.print(table)
        console.print(f"inventory: {self.inventory_path}")
        console.print("run pyinfra or pytest against it in the controller namespace: "
                      f"./servestack.sh sandbox run -- .venv/bin/pyinfra {self.inventory_path} deploy.py --dry --diff")


def _reap(pid: int) -> None:
    """Collect the exit status of `pid` where it is this process's child (the lab started the server here):
    until then it is a zombie, which keeps its process group, and the wait above, alive."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:   # started by another process (`sandbox up`), or reaped already
        pass
