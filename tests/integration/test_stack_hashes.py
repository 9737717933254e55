"""A mirror cannot change what is installed: the first build of a stack fixes its wheel hashes on the control
machine, and a later host whose index serves other bytes under the same file name is refused, unchanged.

Two sandbox hosts of one lab. h1 converges from the lab's indexes and so fixes the stack's hashes (in the
sandbox's own `stack_locks_dir`). h2 is pointed at a mirror of the torch index whose torch wheel has the same
name, version and file name but other bytes (sandbox/standins/wheels.py `other_bytes_wheel`).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pyinfra_run import run_pyinfra
from sandbox.standins.index import write_simple_index
from sandbox.standins.wheels import other_bytes_wheel

pytestmark = pytest.mark.integration
ACTIVE = "readlink /opt/ml-env; python=/opt/ml-env/bin/python; $python -c 'import torch; print(torch.__file__)'"


def mirror_of_the_torch_index(the_lab):
    """A copy of the lab's torch index at <root>/mirror/torch whose torch wheels have other bytes; returns the
    path of its torch wheel."""
    served = the_lab.artifacts.indexes["torch"]
    mirror = the_lab.artifacts.root / "mirror" / "torch"
    wheels = [other_bytes_wheel(wheel, the_lab.state_dir / "other") if wheel.name.startswith("torch-") else wheel
              for wheel in sorted(served.rglob("*.whl"))]
    write_simple_index(mirror, wheels)
    return next(mirror.rglob("torch-*.whl"))


def test_a_mirror_serving_other_bytes_is_refused_by_the_hashes_the_first_build_fixed(lab):
    the_lab = lab(2, private_artifacts=True)
    first, second = the_lab.hosts
    locks = the_lab.state_dir / "locks"
    dry = run_pyinfra(the_lab, "--dry", "--diff", "--limit", first.name)
    assert dry.returncode == 0, dry.output[-3000:]
    assert "its lock fixes the stack's wheel hashes in " + str(locks) in dry.output
    assert not locks.exists()   # a dry run fixes nothing

    converged = run_pyinfra(the_lab, "-y", "--limit", first.name)
    assert converged.returncode == 0, converged.output[-4000:]
    [fixed_file] = locks.iterdir()
    fixed = json.loads(fixed_file.read_text())
    assert fixed["fixed"].endswith(f"by {first.name}, release " + the_lab.exec(first, "readlink /opt/ml-env",
                                                                             check=True).stdout.split("/")[-2])
    assert "fixed the stack's wheel hashes in " + str(fixed_file) in converged.output

    mirrored = mirror_of_the_torch_index(the_lab)
    other = "sha256:" + hashlib.sha256(mirrored.read_bytes()).hexdigest()
    assert other not in fixed["packages"]["torch"]["hashes"]
    mirror_url = f"{the_lab.server_url(second)}/mirror/torch"
    the_lab.sandbox.write_inventory(lambda host: the_lab.host_data(
        host, the_lab.state_dir / "stack.toml", {"index_torch_url": mirror_url} if host.name == second.name else {}))
    before = the_lab.exec(second, ACTIVE, check=True).stdout
    dry = run_pyinfra(the_lab, "--dry", "--diff", "--limit", second.name)
    assert f"its wheels must have the hashes fixed in {fixed_file}" in dry.output, dry.output[-3000:]

    refused = run_pyinfra(the_lab, "-y", "--limit", second.name)
    assert refused.returncode != 0
    assert (f"the resolution differs from the stack's hashes fixed in {fixed_file} (a mirror cannot change what is "
            f"installed): torch {fixed['packages']['torch']['version']}: the index lists a file it does not have "
            f"({other})") in refused.output, refused.output[-4000:]
    assert the_lab.exec(second, ACTIVE, check=True).stdout == before   # the hand-made env still serves
    assert json.loads(fixed_file.read_text()) == fixed                 # the fixed hashes did not move
