"""Sandbox hosts dressed as pre-upgrade GPU hosts (a hand-made +cu128 /opt/ml-env), an artifact
server with the stand-in indexes in the controller namespace, and a pyinfra runner.

Used by test_venv.py and test_rollback.py until sandbox/lab.py provides the same.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.standins.build import ArtifactSet, build_artifacts
from sandbox.standins.host import dress_gpu_host
from servestack.manifest import load_manifest

REPO = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")
PORT = 18080
# The deploys the venv and rollback tests run, and the paths they check.
UPGRADE = "tests/integration/deploys/venv_upgrade.py"
ROLLBACK = "tests/integration/deploys/venv_rollback.py"
MANIFEST = load_manifest()
STACK = MANIFEST.stacks[MANIFEST.service["profiles"][MANIFEST.service["profile"]]["stack"]]  # the default profile's
VENV = MANIFEST.venv["path"]
RELEASES = MANIFEST.venv["releases_dir"]


@dataclass
class VenvLab:
    sandbox: object
    artifacts: ArtifactSet
    server: subprocess.Popen

    def base_url(self, host) -> str:
        return f"http://{host.controller_address}:{PORT}"

    def host_data(self, host, **extra) -> dict:
        data = self.artifacts.host_data(self.base_url(host))
        return {**data, **extra}

    def write_inventory(self, **extra) -> Path:
        return self.sandbox.write_inventory(lambda host: self.host_data(host, **extra))

    def pyinfra(self, deploy: str, *args: str, extra_data: dict | None = None, timeout: int = 600):
        """Run pyinfra in the controller namespace; returns (CompletedProcess, parsed --json or None)."""
        inventory = self.write_inventory(**(extra_data or {}))
        argv = [str(PYINFRA), "-y", "--json", str(inventory), deploy, *args]
        result = subprocess.run(self.sandbox.controller_cmd(argv), cwd=REPO, capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL)
        try:
            parsed = json.loads(result.stdout[result.stdout.index("{"):])
        except ValueError:
            parsed = None
        return result, parsed

    def dry(self, deploy: str, *args: str, extra_data: dict | None = None):
        inventory = self.write_inventory(**(extra_data or {}))
        argv = [str(PYINFRA), str(inventory), deploy, "--dry", *args]
        return subprocess.run(self.sandbox.controller_cmd(argv), cwd=REPO, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    def run_controller(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(self.sandbox.controller_cmd(argv), cwd=REPO, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    def sh(self, host, command: str) -> str:
        return self.sandbox.exec(host, command, check=True).stdout

    def __enter__(self) -> VenvLab:
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop the artifact server, then take the hosts down."""
        stop_lab(self)
        self.sandbox.down()

    def counts(self) -> dict:
        """{path: GET requests} the artifact server saw since the last reset."""
        return json.loads(self._control("urlopen(f'{base}/counts').read().decode()"))

    def reset(self) -> None:
        self._control("urlopen(Request(f'{base}/reset', data=b'{}', method='POST')).read().decode()")

    def _control(self, expression: str) -> str:
        """Evaluate a urllib call on the server's /__control/ API inside the controller namespace."""
        code = (f"from urllib.request import Request, urlopen; base = 'http://127.0.0.1:{PORT}/__control'; "
                f"print({expression})")
        return subprocess.run(self.sandbox.controller_cmd([sys.executable, "-c", code]), check=True,
                              capture_output=True, text=True).stdout


_ARTIFACTS: dict[Path, ArtifactSet] = {}


def artifacts_once(directory: Path) -> ArtifactSet:
    """The stand-in artifact tree, built once per test process and removed when it exits."""
    if directory not in _ARTIFACTS:
        atexit.register(shutil.rmtree, directory.parent, True)
        _ARTIFACTS[directory] = build_artifacts(directory)
    return _ARTIFACTS[directory]


def start_lab(sandbox_factory, artifacts_dir: Path | None = None, hosts: int = 1) -> VenvLab:
    artifacts_dir = artifacts_dir or Path(f"/var/tmp/servestack-venv-tests-{os.getpid()}/artifacts")
    artifacts = artifacts_once(artifacts_dir)
    sb = sandbox_factory(hosts, pre_boot=lambda host, root: dress_gpu_host(root, with_cuda_128=False))
    log = artifacts_dir.parent / f"artifact-server-{sb.name}.log"
    server = subprocess.Popen(sb.controller_cmd([sys.executable, "-m", "sandbox.artifacts", "--root",
                                                 str(artifacts.root), "--bind", "0.0.0.0", "--port", str(PORT),
                                                 "--log", str(log)]), cwd=REPO)
    lab = VenvLab(sb, artifacts, server)
    for _ in range(100):
        try:
            lab.counts()
            break
        except subprocess.CalledProcessError:
            time.sleep(0.1)
    return lab


def stop_lab(lab: VenvLab) -> None:
    lab.server.terminate()
    try:
        lab.server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        lab.server.kill()
