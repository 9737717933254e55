"""The lab (sandbox.lab) plus what the toolkit tests need on top of it:

- a second artifact server (same controller namespace, port 18090) serving copies of the
  stand-in runfile in every mode (normal, repoint, fail_midway, broken_nvcc), one copy per
  scenario under `/<scenario>/...`, so server faults (per URL path glob) and request counts are
  per scenario and several scenarios run on several hosts in one pyinfra run;
- manifests carrying each mode's size and checksums (and a "no_disk" one whose extraction budget
  no disk has);
- per-host host data and stand-in GPUs, pyinfra runs (optionally --debug, to count commands);
- host-side knobs of the stand-ins: files put on a host (a pre-staged runfile), the gcc version the
  stand-in runfile's compiler check finds (`set_gcc`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.lab import Lab, pin_standin_models
from sandbox.standins.build import mirror_path
from sandbox.standins.nvidia_smi import Gpu, render_nvidia_smi
from sandbox.standins.runfile import build_runfile, runfile_info
from servestack.manifest import DEFAULT_MANIFEST, load_manifest

REPO = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
PORT = 18090
MODES = ("normal", "repoint", "fail_midway", "broken_nvcc")
INSTALL = "/usr/local/cuda-13.0"
KEPT = "/usr/local/cuda-12.8"
CACHE = "/var/cache/servestack"
GCC_KNOB = "/etc/servestack-sandbox/gcc-version"     # read by the stand-in runfile's compiler check
TREE_LISTING = "find {path} -printf '%P %y %s %l\\n' | LC_ALL=C sort | sha256sum"


def manifest_for(runfile: Path, dest: Path, **cuda_overrides) -> Path:
    """The project manifest with the x86_64 runfile's size and checksums replaced by `runfile`'s, and the models
    pinned to the stand-in Hub's commits (as the sandbox's own copy: doctor refuses a model pinned nowhere)."""
    info = runfile_info(runfile)
    text = DEFAULT_MANIFEST.read_text()
    section = text.index("[cuda.runfile.x86_64]")
    end = text.index("\n[", section + 1)
    body = text[section:end]
    body = re.sub(r"size = \d+", f"size = {info.size}", body)
    body = re.sub(r'md5 = "[0-9a-f]+"', f'md5 = "{info.md5}"', body)
    body = re.sub(r'sha256 = "[0-9a-f]+"', f'sha256 = "{info.sha256}"', body)
    text = pin_standin_models(text[:section] + body + text[end:])
    for key, value in cuda_overrides.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    load_manifest(dest)
    return dest


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def results(self) -> dict:
        return json.loads(self.stdout[self.stdout.index("{"):])["results"]

    def changed(self, host: str) -> list[str]:
        return [op["name"] for op in self.results["operations"] if host in op["success"]]

    def errors(self, host: str) -> list[str]:
        return [op["name"] for op in self.results["operations"] if host in op["error"]]

    def host_lines(self, host: str) -> list[str]:
        return [line.strip() for line in self.output.splitlines() if f"[{host}]" in line]

    def commands(self, host: str) -> list[str]:
        """With --debug: every remote command pyinfra ran on `host`."""
        marker = f"Running command on {host}: "
        return [line.split(marker, 1)[1] for line in self.output.splitlines() if marker in line]


@dataclass
class ToolkitLab:
    lab: Lab
    root: Path
    server: subprocess.Popen | None = None
    runfiles: dict = field(default_factory=dict)
    manifests: dict = field(default_factory=dict)
    host_data: dict = field(default_factory=dict)

    @property
    def hosts(self):
        return self.lab.hosts

    def host(self, name: str):
        return self.lab.sandbox.host(name)

    def url(self, host, scenario: str) -> str:
        return f"http://{host.controller_address}:{PORT}/{scenario}/{self.url_path}"

    @property
    def url_path(self) -> str:
        return str(mirror_path(load_manifest().runfiles["x86_64"].url))

    def scenario(self, host, name: str, mode: str = "normal", manifest: str | None = None, **extra) -> str:
        """Point `host` at its own copy of the `mode` runfile under /<name>/ on the second server."""
        target = self.root / "serve" / name / self.url_path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.runfiles[mode], target)
        self.host_data[host.name] = {"servestack_manifest": str(self.manifests[manifest or mode]),
                                     "cuda_runfile_url": self.url(host, name), **extra}
        return f"/{name}/{self.url_path}"

    def write_inventory(self) -> Path:
        manifest = self.lab.state_dir / "stack.toml"
        return self.lab.sandbox.write_inventory(
            lambda host: self.lab.host_data(host, manifest, self.host_data.get(host.name, {})))

    def pyinfra(self, deploy: str, *args: str, limit: list[str] | None = None, env: dict | None = None,
                debug: bool = False, dry: bool = False, timeout: int = 600) -> Run:
        """Run pyinfra on the lab inventory (`-y --json` unless dry: then `--dry --diff`)."""
        inventory = self.write_inventory()
        flags = ["--dry", "--diff"] if dry else ["-y", "--json"]
        for pattern in limit or ():
            flags += ["--limit", pattern]
        flags += ["--debug"] if debug else []
        argv = self.lab.controller_argv([PYINFRA, *flags, str(inventory), str(REPO / deploy), *args])
        started = time.monotonic()
        result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        return Run(result.returncode, result.stdout, result.stderr, time.monotonic() - started)

    def sh(self, host, command: str, check: bool = True) -> str:
        result = self.lab.exec(host, command)
        if check and result.returncode != 0:
            raise AssertionError(f"{host.name}: {command!r} failed ({result.returncode}): {result.stderr}")
        return result.stdout

    def exists(self, host, path: str) -> bool:
        return self.lab.exec(host, f"test -e {path} || test -L {path}").returncode == 0

    def tree(self, host, path: str = KEPT) -> str:
        return self.sh(host, TREE_LISTING.format(path=path)).split()[0]

    def link(self, host, path: str = "/usr/local/cuda") -> str:
        return self.sh(host, f"readlink {path}").strip()

    def direct_ssh_argv(self, host, command: str) -> list[str]:
        """ssh argv with a connection of its own (no shared master): killing it closes that connection."""
        argv = self.lab.sandbox.ssh_argv(host, command)
        at = argv.index("ssh") + 1
        return argv[:at] + ["-o", "ControlMaster=no", "-o", "ControlPath=none"] + argv[at:]

    def put_file(self, host, path: str, data: bytes) -> None:
        argv = self.lab.sandbox.ssh_argv(host, f"mkdir -p $(dirname {path}) && cat > {path}")
        result = subprocess.run(argv, input=data, capture_output=True)
        assert result.returncode == 0, result.stderr

    def set_gcc(self, host, version: str) -> None:
        """The gcc version the stand-in runfile's compiler check finds on `host` (and refuses)."""
        self.sh(host, f"mkdir -p $(dirname {GCC_KNOB}) && echo {version} > {GCC_KNOB}")

    def set_gpu(self, host, gpu: Gpu) -> None:
        argv = self.lab.sandbox.ssh_argv(host, "cat > /usr/bin/nvidia-smi && chmod 755 /usr/bin/nvidia-smi")
        result = subprocess.run(argv, input=render_nvidia_smi(gpu), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr

    def server_call(self, method: str, *args, **kwargs):
        code = (f"import json; from sandbox.artifacts import ArtifactControl as C; "
                f"print(json.dumps(C('http://127.0.0.1:{PORT}').{method}(*{args!r}, **{kwargs!r})))")
        out = subprocess.run(self.lab.controller_argv([sys.executable, "-c", code]), cwd=REPO,
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out)

    def requests(self, scenario: str) -> list[dict]:
        return [r for r in self.server_call("requests") if r["path"].startswith(f"/{scenario}/")]

    def start_server(self) -> None:
        serve = self.root / "serve"
        serve.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "sandbox.artifacts", "--root", str(serve), "--bind", "0.0.0.0",
                "--port", str(PORT), "--log", str(self.root / "requests.log")]
        self.server = subprocess.Popen(self.lab.controller_argv(argv), cwd=REPO, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if "serving" not in (self.server.stdout.readline() or ""):
            raise RuntimeError("the toolkit artifact server did not start")

    def __enter__(self) -> ToolkitLab:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
        self.lab.down()


def build_modes(root: Path) -> tuple[dict, dict]:
    runfiles, manifests = {}, {}
    for mode in MODES:
        runfiles[mode] = build_runfile(root / "build" / mode, mode)
        manifests[mode] = manifest_for(runfiles[mode], root / "manifests" / f"{mode}.toml")
    manifests["no_disk"] = manifest_for(runfiles["normal"], root / "manifests" / "no_disk.toml",
                                        extract_bytes="1_000_000_000_000_000")
    return runfiles, manifests


def start_toolkit_lab(name: str, root: Path, hosts: int, rootfs: Path | None = None) -> ToolkitLab:
    """Boot a lab of `hosts` dressed hosts plus the toolkit scenarios' artifact server (stopped by
    `stop()`, or on leaving `with start_toolkit_lab(...) as lab:`)."""
    root.mkdir(parents=True, exist_ok=True)
    runfiles, manifests = build_modes(root)
    lab = Lab(name, rootfs=rootfs)
    lab.up(hosts)
    toolkit_lab = ToolkitLab(lab, root, runfiles=runfiles, manifests=manifests)
    try:
        toolkit_lab.start_server()
    except BaseException:
        toolkit_lab.stop()
        raise
    return toolkit_lab
