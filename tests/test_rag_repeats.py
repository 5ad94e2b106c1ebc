"""`minipic-bench rag --repeats R`: the run of median requests/s is the one reported."""

from benchmarks.rag_runs import median_run


def test_the_median_run_is_reported_with_every_repeat_beside_it():
    rows = [{"requests_per_second": x, "i": i} for i, x in enumerate((80.0, 68.0, 85.0, 75.0, 79.0))]
    runs = [f"run{i}" for i in range(5)]
    run, row = median_run(runs, rows)
    assert run == "run4" and row["i"] == 4  # 68 75 [79] 80 85
    assert row["requests_per_second_runs"] == [80.0, 68.0, 85.0, 75.0, 79.0]
    # an even count reports the lower middle; ties keep run order; one run is itself
    run, row = median_run(runs[:4], rows[:4])
    assert run == "run3" and row["requests_per_second"] == 75.0  # 68 [75] 80 85
    tie = [{"requests_per_second": 70.0, "i": i} for i in range(3)]
    assert median_run(runs[:3], tie)[0] == "run1"
    run, row = median_run(runs[:1], rows[:1])
    assert run == "run0" and row["requests_per_second_runs"] == [80.0]


def test_repeats_below_one_are_refused_by_name(capsys):
    import pytest

    from benchmarks import cli
    with pytest.raises(SystemExit):
        cli.main(["rag", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
