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
    site = tmp_path / "site"
    zipfile.ZipFile(build_wheel(torch_wheel(installed), tmp_path)).extractall(site)
    expect = {"packages": {"torch": pinned}, "torch_cuda": cuda, "imports": ["torch"]}
    run = subprocess.run([sys.executable, str(CHECK), json.dumps(expect)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site)}, timeout=60)
    return run.stdout.splitlines()


@pytest.mark.parametrize("installed", ["2.11.0", "2.9.1+cu130"])
def test_the_pinned_build_passes(tmp_path, installed):
    assert check(tmp_path, installed, pinned=installed) == ["OK"]


def test_pypis_torch_2_11_0_reports_cu130_and_passes_its_unlabelled_pin(tmp_path):
    assert check(tmp_path, "2.11.0", pinned="2.11.0") == ["OK"]
    site_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], text=True,
                                  capture_output=True, env={"PYTHONPATH": str(tmp_path / "site")})
    assert site_version.stdout.strip() == "2.11.0+cu130"


def test_a_cuda_12_8_build_fails_by_its_label_or_its_cuda(tmp_path):
    assert check(tmp_path / "a", "2.9.1+cu128", pinned="2.9.1+cu130") == [
        "PROBLEM torch is 2.9.1+cu128, expected 2.9.1+cu130",
        "PROBLEM torch.__version__ is 2.9.1+cu128, expected 2.9.1+cu130",
        "PROBLEM torch.version.cuda is '12.8', expected '13.0'"]
    assert check(tmp_path / "b", "2.11.0+cu128", pinned="2.11.0") == [
        "PROBLEM torch is 2.11.0+cu128, expected 2.11.0",
        "PROBLEM torch.version.cuda is '12.8', expected '13.0'"]
