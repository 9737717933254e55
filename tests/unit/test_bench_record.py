"""bench/record.py: the one way every benchmark in bench/ keeps its figures."""

import json

from bench import record


def test_a_result_is_named_by_commit_kind_and_time_and_holds_what_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    path = record.write_result({"rows": [1, 2]}, "weights")
    written = json.loads(path.read_text())
    assert path.name == f"{written['commit']}-weights-{written['utc']}.json"
    assert written["rows"] == [1, 2] and written["commit"].split("-")[0] == record.git_sha().split("-")[0]
    labelled = record.write_result({"commit": "before-abc", "utc": "20260101T000000Z"})
    assert labelled.name == "before-abc-20260101T000000Z.json"
