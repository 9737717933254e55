"""The SGLang patch step over SSH on a sandbox host, against the real sglang 0.5.9 and 0.5.10 sources.

Each scenario gets its own venv on the host, holding sglang from the lab's index (the real PyPI
wheel's files), installed with the host's own pip; the step is the real operation, run by pyinfra.
"""

import pytest

from pyinfra_run import apply, dry_run, run_pyinfra

pytestmark = pytest.mark.integration

SM120 = "0001-sm120-torch-symm-mem"
KIMI = "0002-kimi-k25-eagle3-hooks"
SYMM_TABLE = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
KIMI_MODEL = "sglang/srt/models/kimi_k25.py"
DEPLOY = """\
from pyinfra import host
from operations.patches import sglang_patches

sglang_patches(name="SGLang patches", python=host.data.get("test_python"),
               record_path=host.data.get("test_record"))
"""


@pytest.fixture(scope="module")
def patch_host(lab, tmp_path_factory):
    the_lab = lab(1)
    host = the_lab.hosts[0]
    index = f"{the_lab.server_url(host)}/pypi.org/simple"
    trusted = host.controller_address
    for name, version in (("v059", "0.5.9"), ("v0510", "0.5.10"), ("conflict", "0.5.9")):
        the_lab.exec(host, f"python3 -m venv /opt/pt/{name} && /opt/pt/{name}/bin/pip install -q --no-deps "
                           f"--index-url {index} --trusted-host {trusted} sglang=={version}",
                     check=True, timeout=300)
    deploy = tmp_path_factory.mktemp("patches") / "patches_deploy.py"
    deploy.write_text(DEPLOY)
    return the_lab, host, str(deploy)


def site_file(name: str, path: str) -> str:
    return f"/opt/pt/{name}/lib/python3.11/site-packages/{path}"


def hashes(the_lab, host, name: str) -> str:
    files = " ".join(site_file(name, path) for path in (SYMM_TABLE, KIMI_MODEL))
    return the_lab.exec(host, f"sha256sum {files}", check=True).stdout


def data(name: str) -> list[str]:
    return ["--data", f"test_python=/opt/pt/{name}/bin/python", "--data", f"test_record=/opt/pt/{name}/patches.json"]


def test_dry_run_shows_each_diff_and_changes_nothing_then_applies_once(patch_host):
    the_lab, host, deploy = patch_host
    before = hashes(the_lab, host, "v059")
    dry = dry_run(the_lab, deploy, *data("v059"))
    assert "+    12: {" in dry.output and "+    def get_embed_and_head" in dry.output
    assert hashes(the_lab, host, "v059") == before
    assert apply(the_lab, deploy, *data("v059")).totals["success"] == 1
    assert hashes(the_lab, host, "v059") != before
    record = the_lab.exec(host, "cat /opt/pt/v059/patches.json", check=True).stdout
    assert f'"name": "{SM120}"' in record and f'"name": "{KIMI}"' in record and '"state": "applied"' in record
    compiled = the_lab.exec(host, f"ls {site_file('v059', 'sglang/srt/models/__pycache__')}", check=True).stdout
    assert "kimi_k25.cpython-311.pyc" in compiled
    again = apply(the_lab, deploy, *data("v059"))
    assert again.totals["success"] == 0 and again.totals["error"] == 0


def test_on_0_5_10_the_kimi_patch_is_reported_upstream(patch_host):
    the_lab, host, deploy = patch_host
    assert apply(the_lab, deploy, *data("v0510")).totals["success"] == 1
    again = run_pyinfra(the_lab, "-y", "-v", *data("v0510"), target=deploy)
    assert again.returncode == 0
    assert f"sglang 0.5.10 patches: all in place ({SM120} applied, {KIMI} upstream)" in again.output


def test_a_file_that_is_not_what_a_patch_expects_refuses_the_whole_set(patch_host):
    the_lab, host, deploy = patch_host
    # A local edit of a line the Kimi hunk's context needs (the end of load_weights).
    the_lab.exec(host, "sed -i 's/self.language_model.load_weights(language_weights)$/"
                       "self.language_model.load_weights(language_weights)  # local edit/' "
                       f"{site_file('conflict', KIMI_MODEL)}", check=True)
    before = hashes(the_lab, host, "conflict")
    run = run_pyinfra(the_lab, "-y", *data("conflict"), target=deploy)
    assert run.returncode != 0
    assert "patches refused, no file changed" in run.output and KIMI_MODEL in run.output and "hunk" in run.output
    assert hashes(the_lab, host, "conflict") == before
    assert the_lab.exec(host, "test -e /opt/pt/conflict/patches.json").returncode != 0
