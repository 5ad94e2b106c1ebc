"""benchmarks/suite_compiles: JAX's duration events charged to the running test file, and the
workers' files merged into one table (no JAX work: the events are fed by hand)."""

import json

from benchmarks import suite_compiles as sc


def test_events_go_to_the_running_file_and_workers_merge(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sc, "_sums", type(sc._sums)(sc._sums.default_factory))
    monkeypatch.setattr(sc, "_current", ["tests/test_a.py"])
    sc._on_duration(sc.COMPILE, 2.0)
    sc._on_duration(sc.BUILD[0], 0.5)
    sc._on_duration("/jax/other_event", 9.0)  # not counted
    sc._current[0] = "tests/test_b.py"
    sc._on_duration(sc.COMPILE, 1.0)
    sc._on_duration(sc.BUILD[1], 0.25)
    (tmp_path / "gw0.json").write_text(json.dumps(dict(sc._sums)))
    (tmp_path / "gw1.json").write_text(json.dumps({"tests/test_b.py": [3, 4.0, 1.0]}))
    assert sc.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "5 compiles, 7 s; tracing and lowering 2 s"
    assert lines[2].split() == ["4", "5.0", "1.2", "tests/test_b.py"]  # the costlier first
    assert lines[3].split() == ["1", "2.0", "0.5", "tests/test_a.py"]
