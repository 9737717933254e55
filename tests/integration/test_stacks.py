"""Each profile's stack on sandbox hosts (issue 28): the release a host builds is its profile's stack
as a real host resolves it (test_profiles.py, on its hosts of each profile), SGLang's own pre-start check
refuses a release it would not start, and every host with the same inputs installs the same set whenever
it builds.

The sandbox serves each stack's whole resolution from the real PyPI (stand-ins with the real metadata
where the wheel cannot be served; closure.py), so what a host installs here is what a real host
installs, package for package."""

import json
import shlex

import pytest

from pyinfra_run import apply, run_pyinfra
from sandbox.lab import sandbox_manifest
from sandbox.standins import closure
from sandbox.standins.index import NEWER
from sandbox.standins.wheels import build_wheel, standin_wheel
from servestack.manifest import load_manifest

pytestmark = pytest.mark.integration

KIMI, GLM = "kimi-k2.5-eagle3", "glm-5-mtp"
CUDNN_FIX = ('[[stacks."sglang-0.5.9".packages]]\nname = "nvidia-cudnn-cu13"\nversion = "9.16.0.29"\n'
             'index = "pypi"\nstep = 1\n\n')
# SGLang 0.5.9's refusal (srt/server_args.py check_torch_2_9_1_cudnn_compatibility), as SGLang says it.
CUDNN_REFUSAL = "RuntimeError: CRITICAL WARNING: PyTorch 2.9.1 & CuDNN Compatibility Issue Detected"
# A model directory as the server would find it: the config.json SGLang loads first. Its model_type
# and architectures are Kimi-K2.5's (sglang 0.5.9 srt/configs/kimi_k25.py: KimiK25Config.model_type).
KIMI_DIR = "/models/kimi-k2.5"
KIMI_CONFIG = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]}


def active_release(lab, host) -> dict:
    """release.json of the release /opt/ml-env points at."""
    venv = load_manifest().venv["path"]
    out = lab.exec(host, f"cat \"$(dirname \"$(readlink -f {venv})\")/release.json\"", check=True).stdout
    return json.loads(out)


def locked_files(lab, host, release: dict) -> set[str]:
    """Every file hash of a release's lock (what --require-hashes installs), wherever it was served."""
    lock = lab.exec(host, f"cat /opt/servestack/releases/{release['id']}/lock.txt", check=True).stdout
    return {line.strip().rstrip("\\").strip() for line in lock.splitlines() if line.strip().startswith("--hash=")}


def write_inventory(lab, data_of) -> None:
    manifest = sandbox_manifest(lab.state_dir / "stack.toml", lab.artifacts)
    lab.sandbox.write_inventory(lambda host: lab.host_data(host, manifest, data_of(host)))


def test_sglang_refuses_a_release_without_the_cudnn_fix_and_the_previous_release_keeps_serving(lab):
    the_lab = lab(1, private_artifacts=True)
    host = the_lab.hosts[0]
    # The same manifest without the fix: torch 2.9.1+cu130's own cuDNN pin, 9.13.0.50, which the index
    # serves beside 9.16.0.29 from the start, as PyPI does
    text = (the_lab.state_dir / "stack.toml").read_text()
    assert text.count(CUDNN_FIX) == 1
    unfixed = the_lab.state_dir / "stack-without-the-cudnn-fix.toml"
    unfixed.write_text(text.replace(CUDNN_FIX, ""))
    resolved = closure.resolve(load_manifest(unfixed).stacks["sglang-0.5.9"], manifest_path=str(unfixed))
    assert resolved["nvidia-cudnn-cu13"] == "9.13.0.50"
    metadata = closure.pypi_metadata({"nvidia-cudnn-cu13": "9.13.0.50"})
    the_lab.serve_more([build_wheel(standin_wheel("nvidia-cudnn-cu13", "9.13.0.50", metadata["nvidia-cudnn-cu13"]),
                                    the_lab.state_dir / "more")])

    the_lab.exec(host, f"mkdir -p {KIMI_DIR} && echo {shlex.quote(json.dumps(KIMI_CONFIG))} > {KIMI_DIR}/config.json",
                 check=True)
    write_inventory(the_lab, lambda h: {"service_profile": KIMI, "service_model_path": KIMI_DIR})
    good = apply(the_lab)
    assert f"checked: ServerArgs ({KIMI_DIR}'s model config" in good.output
    assert "checked: check_server_args" in good.output
    before = active_release(the_lab, host)
    assert before["packages"]["nvidia-cudnn-cu13"] == "9.16.0.29"
    unit = "sha256sum /etc/systemd/system/sglang.service; systemctl show -P InvocationID sglang.service"
    serving = the_lab.exec(host, unit, check=True).stdout

    the_lab.sandbox.write_inventory(lambda h: the_lab.host_data(h, unfixed, {"service_profile": KIMI,
                                                                             "service_model_path": KIMI_DIR}))
    refused = run_pyinfra(the_lab, "-y")
    assert refused.returncode != 0
    assert CUDNN_REFUSAL in refused.output, refused.output[-4000:]
    assert "SGLang refuses release r-" in refused.output and "CuDNN 9.13" in refused.output
    after = active_release(the_lab, host)
    assert after["id"] == before["id"]                        # /opt/ml-env did not move
    assert the_lab.exec(host, unit, check=True).stdout == serving   # unit unchanged, not restarted
    built = set(the_lab.exec(host, "ls /opt/servestack/releases", check=True).stdout.split())
    refused_id = next(name for name in built if name.startswith("r-") and name != before["id"])
    kept = json.loads(the_lab.exec(host, f"cat /opt/servestack/releases/{refused_id}/release.json", check=True).stdout)
    assert f"SGLang refuses release {refused_id}" in refused.output
    assert kept["packages"]["nvidia-cudnn-cu13"] == "9.13.0.50"   # built and checked: kept for inspection


def test_a_newer_dependency_published_later_does_not_change_what_the_next_host_installs(lab):
    the_lab = lab(2, private_artifacts=True)
    write_inventory(the_lab, lambda h: {"service_profile": GLM})
    apply(the_lab, "deploy.py", "--limit", "h1")
    first = active_release(the_lab, the_lab.hosts[0])
    # tqdm: sglang requires it unpinned; a release uploaded after the stack's bound appears
    tqdm = build_wheel(standin_wheel("tqdm", "99.0.0", {"requires_dist": []}), the_lab.state_dir / "more")
    the_lab.serve_more([tqdm], {"tqdm-99.0.0-py3-none-any.whl": NEWER})
    apply(the_lab, "deploy.py", "--limit", "h2")
    second = active_release(the_lab, the_lab.hosts[1])
    # (the ids differ only because each sandbox host reaches the artifact server at its own address,
    # which is an input; a fleet's hosts sharing a mirror share the id)
    assert second["inputs"]["exclude_newer"] == first["inputs"]["exclude_newer"]
    assert second["packages"] == first["packages"]
    assert locked_files(the_lab, the_lab.hosts[1], second) == locked_files(the_lab, the_lab.hosts[0], first)
    # the newer release was there to be taken: resolved without the bound, it is picked
    h2 = the_lab.hosts[1]
    release = f"/opt/servestack/releases/{second['id']}"
    unbounded = the_lab.exec(h2, f"cd {release} && /opt/servestack/uv/bin/uv pip compile pyproject.toml --quiet "
                                 f"--python venv/bin/python --overrides overrides.txt --no-header", check=True).stdout
    assert "tqdm==99.0.0" in unbounded and f"tqdm=={first['packages']['tqdm']}" != "tqdm==99.0.0"
