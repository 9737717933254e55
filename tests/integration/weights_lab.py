"""What the weights tests on sandbox hosts share (test_weights.py, test_reboot.py): the stand-in Hub's
repositories and paths on a host, and the lab's artifact server's records of what the Hub served."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from sandbox.lab import ARTIFACT_PORT
from sandbox.standins import hub
from servestack.manifest import PROJECT_ROOT

KIMI, DRAFT = "nvidia/Kimi-K2.5-NVFP4", "lightseekorg/kimi-k2.5-eagle3"
BIG = "model-00001-of-00002.safetensors"          # 12 MiB: more than huggingface_hub 0.36.2's 10 MiB chunk
MODELS_DIR = "/var/lib/servestack/models"
UNIT = "/etc/systemd/system/sglang.service"
GOOD_UNIT = "/var/lib/servestack/service/sglang.service.good"   # the unit a failed restart goes back to


def control(lab, method: str, *args, **kwargs):
    """A call of the lab's artifact server's control client (sandbox.artifacts.ArtifactControl)."""
    code = (f"import json; from sandbox.artifacts import ArtifactControl as C; "
            f"print(json.dumps(C('http://127.0.0.1:{ARTIFACT_PORT}').{method}(*{args!r}, **{kwargs!r})))")
    out = subprocess.run(lab.controller_argv([sys.executable, "-c", code]), cwd=PROJECT_ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def staged_dir(repo: str, generation: str = hub.GENERATIONS[0]) -> str:
    return f"{MODELS_DIR}/{repo.replace('/', '--')}/{hub.commits(generation)[repo]}"


def hub_requests(lab) -> list[dict]:
    return [record for record in control(lab, "requests") if record["path"].startswith(hub.PREFIX + "/")]


def download_process(lab, host, busy_pid: int, timeout: float = 240) -> str:
    """The pid of the download's python: busy.sh (`busy_pid`, its lock.activity's) runs `bash -c`, which runs it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = lab.exec(host, f"pgrep -f -P \"$(pgrep -d, -P {busy_pid})\" stage-weights").stdout.split()
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no download started under busy.sh {busy_pid} on {host.name} within {timeout} s")
