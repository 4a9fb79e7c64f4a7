from kvbench.timing import Stats, time_samples


def test_stats_by_hand():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median_ms, s.min_ms, s.max_ms, s.rounds) == (3.0, 1.0, 5.0, 5)
    assert s.iqr_ms == 2.0  # quartiles 2 and 4 (inclusive method)
    assert s.noisy  # 2 / 3 > 10%
    assert not Stats.of([10.0, 10.2, 10.1, 10.0, 10.1]).noisy


def test_time_samples_runs_setup_before_every_sample_and_warmup():
    calls = []
    stats = time_samples(lambda state: calls.append(state), "cpu", warmup=2, rounds=3,
                         setup=lambda: len(calls))
    assert calls == [0, 1, 2, 3, 4]
    assert stats.rounds == 3
