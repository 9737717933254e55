"""The GPUs, as the NVIDIA driver reports them (skipped with the reason where no driver answers)."""


def test_driver_version(target):
    """The driver is at or above the manifest's minimum for the CUDA it installs."""
    target.check("driver_version")


def test_gpu_capability(target):
    """Every GPU reports the expected compute capability (host data gpu_compute_capability)."""
    target.check("gpu_capability")


def test_gpu_count(target):
    """The driver lists as many GPUs as host data gpu_count says."""
    target.check("gpu_count")
