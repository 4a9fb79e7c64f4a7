"""Timing: the order of setup, synchronisation, clock and work, and the statistics.

A fake device stands in for a GPU: work and setup queue device time that only a synchronize
drains, and host time passes only when the code under test does something. A correct timer
then measures exactly the work's host + device time, and each broken variant something else.
"""

import broken_measure
import pytest

from kvbench.measure import timing
from kvbench.measure.timing import Stats, time_interleaved, time_samples

SETUP_HOST_MS, SETUP_DEVICE_MS = 100.0, 50.0
WORK_HOST_MS, WORK_DEVICE_MS = 1.0, 5.0


class FakeDevice:
    def __init__(self):
        self.now_ms = 0.0  # host clock
        self.queued_ms = 0.0  # device work not yet drained
        self.events: list[str] = []

    def clock(self) -> float:
        self.events.append("clock")
        return self.now_ms / 1e3  # seconds, like perf_counter

    def synchronize(self, device: str) -> None:
        self.events.append("sync")
        self.now_ms += self.queued_ms
        self.queued_ms = 0.0

    def setup(self):
        self.events.append("setup")
        self.now_ms += SETUP_HOST_MS
        self.queued_ms += SETUP_DEVICE_MS
        return "state"

    def work(self, state):
        assert state == "state"
        self.events.append("work")
        self.now_ms += WORK_HOST_MS
        self.queued_ms += WORK_DEVICE_MS


@pytest.fixture
def fake(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(timing, "clock", device.clock)
    monkeypatch.setattr(timing, "synchronize", device.synchronize)
    return device


def check_timer(time_fn, fake: FakeDevice) -> None:
    """What any timer kvbench uses must satisfy: raises AssertionError otherwise."""
    stats = time_fn({"t": (fake.work, fake.setup)}, "cuda:0", 2, 3)["t"]
    # untimed warmups first, then per sample: setup, sync, start, work, sync, stop
    assert fake.events[:4] == ["setup", "work"] * 2
    assert fake.events[4:] == ["setup", "sync", "clock", "work", "sync", "clock"] * 3
    # exactly the work's host and device time: setup never timed, queued kernels always
    exact = pytest.approx(WORK_HOST_MS + WORK_DEVICE_MS, rel=1e-12)
    assert stats.median_ms == exact and stats.min_ms == exact and stats.max_ms == exact
    assert stats.rounds == 3


def test_the_timer_synchronises_around_the_work_and_never_times_setup(fake):
    check_timer(time_interleaved, fake)


@pytest.mark.parametrize("broken", [broken_measure.no_sync_after_work,
                                    broken_measure.no_sync_before_work,
                                    broken_measure.timer_includes_setup])
def test_each_broken_timer_fails_the_check(fake, broken):
    with pytest.raises(AssertionError):
        check_timer(broken, fake)


def test_interleaved_rounds_alternate_tasks(fake):
    order = []
    tasks = {name: ((lambda _, n=name: order.append(n)), lambda: None) for name in "abc"}
    time_interleaved(tasks, "cpu", warmup=1, rounds=2)
    assert order == list("abc") * 3


def test_time_samples_runs_setup_before_every_sample_and_warmup():
    calls = []
    stats = time_samples(lambda state: calls.append(state), "cpu", warmup=2, rounds=3,
                         setup=lambda: len(calls))
    assert calls == [0, 1, 2, 3, 4]
    assert stats.rounds == 3


def test_stats_by_hand():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median_ms, s.min_ms, s.max_ms, s.rounds) == (3.0, 1.0, 5.0, 5)
    assert s.iqr_ms == 2.0  # quartiles 2 and 4 (inclusive method)
    assert s.noisy  # 2 / 3 > 10%
    even = Stats.of([1.0, 2.0, 4.0, 10.0])
    # median of an even count is the mean of the middle two; inclusive quartiles 1.75 and 5.5
    assert (even.median_ms, even.iqr_ms) == (3.0, 3.75)
    assert Stats.of([7.0]) == Stats(7.0, 7.0, 7.0, 0.0, 1)
    assert not Stats.of([10.0, 10.2, 10.1, 10.0, 10.1]).noisy
    # the 10% rule's edge: IQR 1.0 of median 10.0 is not above 10%
    assert not Stats(10.0, 9.0, 11.0, 1.0, 5).noisy and Stats(10.0, 9.0, 11.0, 1.01, 5).noisy
