"""The release check (files/scripts/check_release.py) judges torch as the real wheels describe themselves.

PyPI's torch 2.11.0 has `Version: 2.11.0` in its METADATA while `torch.__version__` says
'2.11.0+cu130' (its torch/version.py; shared/notes/real-stack.md); the download.pytorch.org builds
carry the label in both ('2.9.1+cu130'). The stand-in torch wheels reproduce exactly that
(sandbox/standins/wheels.py `_torch_version_py`), and the check runs against them here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sandbox.standins.wheels import build_wheel, torch_wheel

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "files" / "scripts" / "check_release.py"


def check(tmp_path: Path, installed: str, pinned: str, cuda: str = "13.0") -> list[str]:
    """The problems the check records (its result file) for torch `installed` against the pin."""
    site = tmp_path / "site"
    zipfile.ZipFile(build_wheel(torch_wheel(installed), tmp_path)).extractall(site)
    expect = {"packages": {"torch": pinned}, "torch_cuda": cuda, "imports": ["torch"]}
    result = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(CHECK), json.dumps(expect), str(result)], capture_output=True,
                         text=True, env={"PYTHONPATH": str(site)}, timeout=60)
    record = json.loads(result.read_text())
    assert run.returncode == (1 if record["problems"] else 0) and record["ok"] == (not record["problems"])
    assert record["expected"] == expect and record["found"]["torch"]["version"].startswith(installed)
    return record["problems"]


@pytest.mark.parametrize("installed", ["2.11.0", "2.9.1+cu130"])
def test_the_pinned_build_passes(tmp_path, installed):
    assert check(tmp_path, installed, pinned=installed) == []


def test_pypis_torch_2_11_0_reports_cu130_and_passes_its_unlabelled_pin(tmp_path):
    assert check(tmp_path, "2.11.0", pinned="2.11.0") == []
    site_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], text=True,
                                  capture_output=True, env={"PYTHONPATH": str(tmp_path / "site")})
    assert site_version.stdout.strip() == "2.11.0+cu130"


def test_a_cuda_12_8_build_fails_by_its_label_or_its_cuda(tmp_path):
    assert check(tmp_path / "a", "2.9.1+cu128", pinned="2.9.1+cu130") == [
        "torch is 2.9.1+cu128, expected 2.9.1+cu130",
        "torch.__version__ is 2.9.1+cu128, expected 2.9.1+cu130",
        "torch.version.cuda is '12.8', expected '13.0'"]
    assert check(tmp_path / "b", "2.11.0+cu128", pinned="2.11.0") == [
        "torch is 2.11.0+cu128, expected 2.11.0",
        "torch.version.cuda is '12.8', expected '13.0'"]


def test_the_check_exits_without_tearing_down_what_its_imports_built(tmp_path):
    """Its result is written before it exits: the interpreter's teardown after importing real torch, flashinfer
    and sglang (~2 s, bench/results/*release-check-imports*) is skipped, atexit handlers included."""
    site = tmp_path / "site"
    zipfile.ZipFile(build_wheel(torch_wheel("2.11.0"), tmp_path)).extractall(site)
    (site / "at_exit.py").write_text(f"import atexit\natexit.register(open, {str(tmp_path / 'torn-down')!r}, 'w')\n")
    expect = {"packages": {"torch": "2.11.0"}, "torch_cuda": "13.0", "imports": ["at_exit"]}
    run = subprocess.run([sys.executable, str(CHECK), json.dumps(expect), str(tmp_path / "check.json")],
                         capture_output=True, text=True, env={"PYTHONPATH": str(site)}, timeout=60)
    assert run.returncode == 0 and json.loads((tmp_path / "check.json").read_text())["ok"], run.stderr
    assert not (tmp_path / "torn-down").exists()
