"""The active release (venv_path): the pinned stack, torch on these GPUs, SGLang's SM120 support
and the recorded source patches."""

import pytest


@pytest.mark.deployed
def test_package_version(target, package):
    """Each manifest package is installed at its exact version, local label included (+cu130)."""
    target.check("package_version", package)


def test_torch_cuda_build(target):
    """torch.version.cuda is the manifest CUDA's major.minor."""
    target.check("torch_cuda_build")


def test_torch_device_capability(target):
    """torch sees gpu_count devices, each of the expected compute capability."""
    target.check("torch_device_capability")


def test_torch_cuda_op(target):
    """A small sum and matmul on every device give the right results."""
    target.check("torch_cuda_op")


@pytest.mark.deployed
def test_sglang_sm120(target):
    """SGLang's is_sm120_supported() is True inside the venv (on SM120 hosts)."""
    target.check("sglang_sm120")


@pytest.mark.deployed
def test_patches_applied(target):
    """The recorded SGLang patch set is applied and no patched file changed since."""
    target.check("patches_applied")
