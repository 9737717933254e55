"""The CUDA toolkit: the new one answers with the manifest's version, the kept one is untouched,
/usr/local/cuda points where policy says, and code it compiles runs on these GPUs."""

import pytest


def test_nvcc_version(target):
    """`<cuda_install_path>/bin/nvcc --version` reports the manifest's nvcc version."""
    target.check("nvcc_version")


def test_version_json(target):
    """version.json agrees with the manifest (or, for a packaged toolkit, its package does)."""
    target.check("version_json")


def test_cuda_link(target):
    """/usr/local/cuda resolves where cuda_link_policy says ('keep': where it did before the install)."""
    target.check("cuda_link")


@pytest.mark.deployed
def test_kept_toolkits(target):
    """Each kept toolkit (CUDA 12.8) has the fingerprint the toolkit step recorded before installing."""
    target.check("kept_toolkits")


def test_cuda_sample(target):
    """files/verify/vector_add.cu, built with the new nvcc for the GPUs' own architecture, adds
    correctly on every GPU (what catches "no kernel image is available")."""
    target.check("cuda_sample")
