"""Deliberately broken measurement code: the tests that check the real code must reject each.

Each variant is the real code with one bug, reading the clock and synchronize through
kvbench.measure.timing so the tests' fake device drives them the same way.
"""

from kvbench.measure import costs, timing
from kvbench.measure.timing import Stats


def _loop(tasks, device, warmup, rounds, sync_before=True, sync_after=True, time_setup=False):
    for _ in range(warmup):
        for work, setup in tasks.values():
            work(setup())
    samples = {name: [] for name in tasks}
    for _ in range(rounds):
        for name, (work, setup) in tasks.items():
            if time_setup:
                start = timing.clock()
            state = setup()
            if sync_before:
                timing.synchronize(device)
            if not time_setup:
                start = timing.clock()
            work(state)
            if sync_after:
                timing.synchronize(device)
            samples[name].append((timing.clock() - start) * 1e3)
    return {name: Stats.of(s) for name, s in samples.items()}


def no_sync_after_work(tasks, device, warmup, rounds):
    """Stops the clock while the work's kernels are still queued."""
    return _loop(tasks, device, warmup, rounds, sync_after=False)


def no_sync_before_work(tasks, device, warmup, rounds):
    """Starts the clock while setup's kernels are still queued."""
    return _loop(tasks, device, warmup, rounds, sync_before=False)


def timer_includes_setup(tasks, device, warmup, rounds):
    """Starts the clock before setup."""
    return _loop(tasks, device, warmup, rounds, time_setup=True)


def step_min_bytes_one_element_short(s, length, dtype_bytes):
    """Counts the new k and v one element short."""
    return costs.step_min_bytes(s, length, dtype_bytes) - dtype_bytes


def kv_bytes_one_position_short(s, length, dtype_bytes):
    """Forgets the position just written."""
    return costs.kv_bytes(s, length - 1, dtype_bytes)
