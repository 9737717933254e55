"""bench/converge.py --shape: the no-op's own command texts, sorted by host, and the shape deploy that
sends them where the no-op sends them (run here through pyinfra's @local connector: the texts only
append to a file in a temporary directory)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("converge_bench", ROOT / "bench" / "converge.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_sent_texts_are_numbered_per_host_in_the_order_sent(tmp_path):
    sent, texts = tmp_path / "sent", tmp_path / "texts"
    sent.mkdir()
    texts.mkdir()
    for number, name in enumerate(["h1", "h-2", "h1", "h-2", "h1"], start=1):
        (sent / f"{number:03d}-{name}.sh").write_text(f"{number}")
    _bench().sort_by_host(sent, texts)
    assert {path.name: path.read_text() for path in texts.iterdir()} == {
        "h1-1.sh": "1", "h1-2.sh": "3", "h1-3.sh": "5", "h-2-1.sh": "2", "h-2-2.sh": "4"}
    assert list(sent.iterdir()) == []


def test_the_shape_sends_its_texts_where_the_no_op_sends_them(tmp_path):
    bench = _bench()
    (tmp_path / "shape.py").write_text(bench.SHAPE_DEPLOY)
    texts, log = tmp_path / "texts", tmp_path / "log"
    texts.mkdir()
    for number in range(1, 5):
        (texts / f"@local-{number}.sh").write_text(f"echo {number} >> {log}")
    env = {**os.environ, "SHAPE_TEXTS": str(texts), "SHAPE_OPERATIONS": "6", "SHAPE_COMMANDS": "4"}
    result = subprocess.run([sys.executable, "-m", "pyinfra", "-y", "--json", "@local", "shape.py"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert log.read_text().split() == ["1", "2", "3", "4"]
    assert len(json.loads(result.stdout[result.stdout.index("{"):])["results"]["operations"]) == 6
