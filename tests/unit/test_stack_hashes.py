"""Where a stack's wheel hashes are fixed on the control machine, and how that file is read."""

from __future__ import annotations

import pytest

from servestack.errors import ConfigError
from servestack.releases import release_inputs
from servestack.settings import settings_from_data
from servestack.stack_hashes import hashes_path, read_fixed, write_fixed


def inputs(**data) -> dict:
    return release_inputs(settings_from_data("h1", data), "x86_64", "3.11.2")


def test_a_mirror_does_not_move_the_file_new_pins_do(tmp_path):
    here = hashes_path(str(tmp_path), inputs())
    mirrored = hashes_path(str(tmp_path), inputs(index_torch_url="http://mirror.example/torch/",
                                                  index_pypi_url="http://mirror.example/pypi/"))
    assert mirrored == here and here.name.startswith("sglang-0.5.9-") and here.name.endswith("-py3.11-x86_64.json")
    repinned = inputs()
    repinned["packages"][0] = {**repinned["packages"][0], "version": "0.0.1"}
    assert hashes_path(str(tmp_path), repinned) != here


def test_a_missing_file_is_none_and_a_bad_one_is_refused_naming_it(tmp_path):
    path = tmp_path / "locks" / "s.json"
    assert read_fixed(path) is None
    path.parent.mkdir()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{path}: cannot read the stack's fixed hashes: "):
        read_fixed(path)
    path.write_text('{"packages": {"torch": "2.9.1"}}')
    with pytest.raises(ConfigError, match=f"^{path}: expected a JSON object whose 'packages' maps each name"):
        read_fixed(path)


def test_the_fixed_hashes_are_written_whole_with_no_temporary_left(tmp_path):
    fixed = {"fixed": "t by h1", "packages": {"torch": {"version": "2.9.1+cu130", "hashes": ["sha256:a"]}}}
    path = tmp_path / "l" / "s.json"
    write_fixed(path, fixed)
    assert read_fixed(path) == fixed and [p.name for p in path.parent.iterdir()] == ["s.json"]
