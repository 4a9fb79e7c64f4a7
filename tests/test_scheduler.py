"""Continuous batching's bookkeeping (kvbench.serving.scheduler) on a seeded trace of 1,000
requests: no request lost or duplicated, no block leaked or held twice, under both preemption modes
and
both ways of reserving blocks."""

import itertools
import math

import pytest

from kvbench.errors import KvbenchError
from kvbench.serving.scheduler import BlockPool, CachingPool, Request, Scheduler
from kvbench.serving.workloads import gaps, trace
from kvbench.sizing.lengths import parse_len_dist

TRACE = trace(1000, seed=0, prompt=parse_len_dist("lognormal:200:1.0"),
              output=parse_len_dist("lognormal:100:1.0"), rate=0.5, max_len=2048)


def test_the_trace_is_seeded_and_shaped():
    again = trace(1000, seed=0, prompt=parse_len_dist("lognormal:200:1.0"),
                  output=parse_len_dist("lognormal:100:1.0"), rate=0.5, max_len=2048)
    assert again == TRACE and len({r.id for r in TRACE}) == 1000
    assert all(1 <= r.output_len and r.reach <= 2048 for r in TRACE)
    arrivals = [r.arrival for r in TRACE]
    assert arrivals == sorted(arrivals) and 1800 < arrivals[-1] < 2200  # 0.5 a step


class Checked(Scheduler):
    """Checks every step: each block free or held by exactly one running sequence, which
    holds enough blocks for what it caches."""

    def step(self):
        super().step()
        held = [b for seq in self.running for b in seq.blocks]
        assert len(held) == len(set(held)) == len(self.pool.owner)
        assert not set(held) & set(self.pool.free)
        assert len(held) + len(self.pool.free) == self.pool.n_blocks
        for seq in self.running:
            assert len(seq.blocks) >= self.blocks_for(seq.cached)


@pytest.mark.parametrize("reserve", ["paged", "prealloc"])
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.slow
def test_no_request_lost_or_duplicated_and_no_block_leaked(reserve, preempt, chunk):
    scheduler = Checked(TRACE, n_blocks=600, block_size=16, reserve=reserve, preempt=preempt,
                        chunk=chunk)
    records = scheduler.run()
    assert sorted(records) == list(range(1000))
    for r in records.values():
        assert r.finished is not None and r.first_token is not None
        assert r.request.arrival <= r.first_token <= r.finished
    # every token generated exactly once per request (a preempted one resumes, not restarts)
    assert sum(scheduler.decoded) == sum(r.output_len for r in TRACE)
    assert len(scheduler.pool.free) == 600 and not scheduler.pool.owner  # all returned
    assert max(scheduler.blocks_in_use) <= 600
    if reserve == "paged":  # the budget is tight enough that sequences were preempted
        assert sum(r.preempted for r in records.values()) > 0
        assert (scheduler.swapped_blocks > 0) == (preempt == "swap")
        assert (scheduler.recomputed_tokens > 0) == (preempt == "recompute")


@pytest.mark.slow
def test_paged_serves_the_trace_sooner_than_preallocating():
    paged = Scheduler(TRACE, n_blocks=600, block_size=16, reserve="paged")
    oracle = Scheduler(TRACE, n_blocks=600, block_size=16, reserve="prealloc")
    max_len = Scheduler(TRACE, n_blocks=600, block_size=16, reserve="prealloc",
                        reserve_len=2048)
    for s in (paged, oracle, max_len):
        s.run()
    # the same work in fewer steps: more sequences at once
    assert paged.now < oracle.now < max_len.now


def test_a_request_bigger_than_the_whole_budget_is_one_line():
    big = [Request(0, 0, 1000, 100)]
    with pytest.raises(KvbenchError, match="that request can never run"):
        Scheduler(big, n_blocks=10, block_size=16)


def test_the_pool_refuses_a_block_freed_by_another():
    pool = BlockPool(2)
    block = pool.take(7)
    with pytest.raises(AssertionError, match="does not hold"):
        pool.release_all([block], 8)


def test_a_scheduler_that_leaks_a_finished_sequences_blocks_is_caught():
    class Leaky(Checked):
        def _finish(self, seq):
            seq.blocks = []  # forgotten, never returned to the pool
            super()._finish(seq)

    with pytest.raises((AssertionError, KvbenchError)):
        Leaky(TRACE, n_blocks=600, block_size=16).run(max_steps=20_000)


# The scheduler's decisions on traces small enough to follow by hand; each test fails when
# its decision is reversed.

def _states(scheduler, steps):
    """After each step: the running requests and the waiting ones, by id."""
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(([q.request.id for q in scheduler.running],
                    [q.request.id for q in scheduler.waiting], len(scheduler.pool.free)))
    return out


def test_the_newest_sequence_is_preempted_and_none_is_admitted_in_that_step():
    # 4 blocks of 4 positions; three prompts of 4 arrive together and take one block each.
    # Step 2: request 0 grows into the last free block; request 1 needs one more, none is
    # free, so the most recently admitted (2) is preempted. Request 0 then finishes (2
    # outputs) and frees 2 blocks, but a step that preempted admits nothing: 2 waits a step.
    reqs = [Request(0, 0.0, 4, 2), Request(1, 0.0, 4, 6), Request(2, 0.0, 4, 6)]
    s = Scheduler(reqs, n_blocks=4, block_size=4)
    states = _states(s, 3)
    assert states[0] == ([0, 1, 2], [], 1)
    assert states[1] == ([1], [2], 2)  # 2 preempted (not 0, the oldest); not readmitted
    assert [s.records[i].preempted for i in range(3)] == [0, 0, 1]
    assert states[2][0] == [1, 2]  # readmitted in the next step


class _Prefills:
    """An engine that records each prefill call (step, request, first, end)."""

    def __init__(self, scheduler_now):
        self.now, self.calls = scheduler_now, []

    def prefill(self, seq, start, end):
        self.calls.append((self.now(), seq.request.id, start, end))

    def decode(self, seqs):
        pass

    def finish(self, seq):
        pass


def test_a_step_prefills_its_whole_chunk_budget_oldest_prefill_first():
    # chunks of 8 positions a step, two prompts of 20: request 0's prompt in 8 + 8 + 4, and
    # in that third step the 4 left of the budget begin request 1's; then 8, then 8
    reqs = [Request(0, 0.0, 20, 3), Request(1, 0.0, 20, 3)]
    s = Scheduler(reqs, n_blocks=100, block_size=4, chunk=8)
    s.engine = engine = _Prefills(lambda: s.now)
    s.run()
    assert engine.calls == [(0, 0, 0, 8), (1, 0, 8, 16), (2, 0, 16, 20), (2, 1, 0, 4),
                            (3, 1, 4, 12), (4, 1, 12, 20)]
    by_step = {}
    for step, _, start, end in engine.calls:
        by_step[step] = by_step.get(step, 0) + end - start
    assert by_step == {0: 8, 1: 8, 2: 8, 3: 8, 4: 8}
    assert s.records[0].first_token == 2 and s.records[1].first_token == 4


def test_a_trace_caps_each_request_and_draws_outputs_apart_from_prompts():
    # prompts of exactly 10 against --max-len 10: the prompt keeps 9 positions and the output
    # the 1 left; prompts of 3 leave 7 positions for outputs drawn at 9
    from kvbench.sizing.lengths import LenDist, draw

    long = trace(4, seed=1, prompt=LenDist("uniform", 10, 10), output=LenDist("uniform", 5, 5),
                 rate=float("inf"), max_len=10)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in long] == [(0.0, 9, 1)] * 4
    short = trace(4, seed=1, prompt=LenDist("uniform", 3, 3), output=LenDist("uniform", 9, 9),
                  rate=float("inf"), max_len=10)
    assert [(r.prompt_len, r.output_len) for r in short] == [(3, 7)] * 4
    # the same distribution for both: outputs are drawn with a seed of their own (seed + 1)
    dist = LenDist("uniform", 1, 1000)
    same = trace(50, seed=3, prompt=dist, output=dist, rate=1.0, max_len=4096)
    assert [r.prompt_len for r in same] == list(draw(dist, 50, 3, 4095))
    assert [r.output_len for r in same] == [min(o, 4096 - r.prompt_len) for o, r in
                                            zip(draw(dist, 50, 4, 4095), same)]
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(same)]
    assert all(g > 0 for g in gaps) and same[0].arrival > 0  # Poisson: every arrival its own


class Counted(Scheduler):
    """Counts every preemption as it happens, with what the sequence had cached: the
    scheduler's own counters must add up to these."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []  # (request, positions cached) at each preemption

    def _preempt(self, seq):
        self.events.append((seq.request.id, seq.cached))
        super()._preempt(seq)


class _Swaps:
    """An engine that counts the blocks each swap moves."""

    def __init__(self, block_size):
        self.block_size, self.out, self.back = block_size, [], []

    def swap_out(self, seq):
        self.out.append(-(-seq.cached // self.block_size))

    def swap_in(self, seq):
        self.back.append(-(-seq.cached // self.block_size))

    def prefill(self, seq, start, end):
        pass

    def decode(self, seqs):
        pass

    def finish(self, seq):
        pass


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_counters_add_up_to_every_preemption(preempt):
    s = Counted(TRACE[:300], n_blocks=300, block_size=16, preempt=preempt)
    s.engine = engine = _Swaps(16)
    records = s.run()
    per_request = {}
    for rid, _ in s.events:
        per_request[rid] = per_request.get(rid, 0) + 1
    assert max(per_request.values()) >= 2  # some request was preempted more than once
    assert s.preemptions == len(s.events)
    assert {i: r.preempted for i, r in records.items() if r.preempted} == per_request
    if preempt == "recompute":
        assert s.recomputed_tokens == sum(cached for _, cached in s.events)
        assert s.swapped_blocks == 0 and not engine.out
    else:
        # each swapped sequence came back, its blocks moved out and in again
        assert len(engine.back) == len(engine.out) == len(s.events)
        assert s.swapped_blocks == sum(engine.out) + sum(engine.back)
        assert s.recomputed_tokens == 0


def test_max_seqs_caps_the_running_batch_and_its_reversal_does_not():
    # five requests at once on a pool that holds all of them: vLLM's max_num_seqs 2 keeps two
    # running; without it all five run together
    from kvbench.serving.scheduler import Request, Scheduler

    reqs = [Request(i, 0.0, 4, 4) for i in range(5)]
    capped = Scheduler(reqs, n_blocks=64, block_size=4, max_seqs=2)
    capped.run()
    free = Scheduler(reqs, n_blocks=64, block_size=4)
    free.run()
    assert max(capped.batch) == 2 and max(free.batch) == 5
    assert all(r.finished is not None for r in capped.records.values())


def test_max_batched_tokens_counts_decodes_before_prefill_positions():
    # three sequences decoding and a 10-token prompt waiting, a budget of 6 tokens a step:
    # 3 decodes leave 3 prefill positions; the prompt takes 4 steps (3 + 3 + 3 + 1)
    from kvbench.serving.scheduler import Request, Scheduler

    running = [Request(i, 0.0, 2, 20) for i in range(3)]
    late = Request(3, 0.5, 10, 2)
    sched = Scheduler([*running, late], n_blocks=64, block_size=4, max_batched_tokens=6)
    sched.step(0.0)  # the three prompts: 6 positions, the whole budget
    assert sched.batch[-1] == 0 and len(sched.running) == 3
    steps = 0
    sched.step(1.0)  # three decodes; the late prompt begins with 3 positions
    while sched.records[3].first_token is None:
        steps += 1
        sched.step(1.0 + steps)
    assert sched.records[3].first_token == 4  # steps 1, 2, 3 and 4: 3 + 3 + 3 + 1 positions
    assert all(b <= 3 for b in sched.batch)


def test_a_token_budget_below_one_chunk_is_refused():
    from kvbench.errors import KvbenchError
    from kvbench.serving.scheduler import Request, Scheduler

    with pytest.raises(KvbenchError, match="below one --prefill-chunk of 64"):
        Scheduler([Request(0, 0.0, 4, 4)], 8, 4, chunk=64, max_batched_tokens=32)


def test_a_watermark_keeps_blocks_free_at_admission_and_none_admits_both():
    # two 16-position requests (4 blocks each) on 10 blocks: a 30% watermark (3 blocks) lets
    # the first in (10 - 4 = 6 >= 3) and keeps the second waiting (6 - 4 = 2 < 3)
    from kvbench.serving.scheduler import Request, Scheduler

    reqs = [Request(0, 0.0, 16, 2), Request(1, 0.0, 16, 2)]
    held = Scheduler(reqs, n_blocks=10, block_size=4, watermark=0.3)
    held.step()
    assert [s.request.id for s in held.running] == [0] and len(held.waiting) == 1
    both = Scheduler(reqs, n_blocks=10, block_size=4)
    both.step()
    assert len(both.running) == 2


def test_v0_runs_prefills_alone_and_v1_mixes_them_with_decodes():
    # a request decoding when a second arrives: v0's next step prefills it alone (no decode),
    # v1's decodes the first and prefills the second in the same step
    from kvbench.serving.scheduler import Request, Scheduler

    reqs = [Request(0, 0.0, 4, 6), Request(1, 1.5, 4, 2)]
    for policy, batches in (("vllm-v0", [0, 1, 0]), ("vllm", [0, 1, 1])):
        sched = Scheduler(reqs, n_blocks=16, block_size=4, policy=policy)
        for clock in (0.0, 1.0, 2.0):
            sched.step(clock)
        assert sched.batch == batches, policy
        assert sched.records[1].first_token == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"watermark": 1.0}, "--watermark is a fraction"),
    ({"policy": "vllm-v2"}, "unknown --policy"),
])
def test_bad_vllm_rules_are_refused(kwargs, message):
    from kvbench.errors import KvbenchError
    from kvbench.serving.scheduler import Request, Scheduler

    with pytest.raises(KvbenchError, match=message):
        Scheduler([Request(0, 0.0, 4, 4)], 8, 4, **kwargs)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_gaps_coefficient_of_variation(burstiness):
    # gamma gaps of shape k and mean 1/rate: coefficient of variation 1/sqrt(k) (2, 1, 0.5);
    # 4,000 seeded arrivals at 10 per second
    import statistics

    from kvbench.serving.workloads import trace
    from kvbench.sizing.lengths import LenDist

    lens = LenDist("uniform", 4, 8)
    arrivals = [r.arrival for r in trace(4000, 0, lens, lens, 10.0, 64, burstiness)]
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.08)
    assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness ** -0.5, rel=0.1)


def test_poisson_arrivals_are_the_draws_they_always_were():
    import random

    from kvbench.serving.workloads import trace
    from kvbench.sizing.lengths import LenDist

    lens = LenDist("uniform", 4, 8)
    rng, now, want = random.Random(3), 0.0, []
    for _ in range(5):
        now += rng.expovariate(2.0)
        want.append(now)
    assert [r.arrival for r in trace(5, 3, lens, lens, 2.0, 64)] == want


# The paper's baselines: contiguous reservations, Orca (Pow2), static batching.

def test_first_fit_takes_the_lowest_run_and_none_when_the_free_blocks_are_scattered():
    pool = BlockPool(8)
    held = {b: pool.take(1) for b in range(8)}  # blocks 0..7, all held by request 1
    for b in (1, 2, 4, 5, 6):
        pool.release_all([held[b]], 1)  # free: 1 2 | 4 5 6
    assert pool.take_run(9, 3) == [4, 5, 6]  # the only run of 3
    assert pool.take_run(9, 3) is None  # 2 free blocks: no run of 3
    assert pool.take_run(9, 1) == [1]  # the lowest run that fits
    assert sorted(pool.free) == [2] and all(pool.owner[b] == 9 for b in (1, 4, 5, 6))
    for b in (4, 6):
        pool.release_all([b], 9)  # free: 2 | 4 | 6: three blocks, no two consecutive
    assert pool.take_run(7, 2) is None and len(pool.free) == 3


def _scattered(contiguous):
    # block size 1, 21 blocks; each reservation is the request's own prompt + output.
    # Admitted in order at step 0: L1 [0-4], S1 [5-7], L2 [8-12], S2 [13-15], L3 [16-20].
    # The Ss make their tokens at steps 0 and 1 and leave 3 + 3 blocks free, apart, from
    # step 2 (a finished request's blocks are free from the next step); the Ls make theirs
    # at steps 0..3. F (4 positions) arrives at 1.5: the scattered blocks take it at step 2,
    # one run of 4 only once the Ls have finished at step 3: at step 4.
    L, S = (1, 4), (1, 2)  # (prompt, output): 5 and 3 positions
    lens = [L, S, L, S, L]
    reqs = [Request(i, 0.0, p, o) for i, (p, o) in enumerate(lens)] + [Request(5, 1.5, 3, 1)]
    s = Scheduler(reqs, n_blocks=21, block_size=1, reserve="prealloc", contiguous=contiguous)
    return s.run()


def test_a_contiguous_reservation_waits_for_a_run_that_scattered_blocks_would_give():
    assert _scattered(contiguous=False)[5].first_token == 2
    assert _scattered(contiguous=True)[5].first_token == 4


def test_pow2_reserves_the_reach_rounded_up_to_a_power_of_two_at_most_max_len():
    from kvbench.serving.scheduler import reserved

    for (prompt, output), want in {(1, 0): 1, (1, 1): 2, (2, 1): 4, (3, 2): 8, (4, 4): 8,
                                   (5, 4): 16, (100, 100): 256}.items():
        assert reserved(Request(0, 0, prompt, output), "pow2", None) == want, (prompt, output)
    assert reserved(Request(0, 0, 5, 4), "pow2", 12) == 12  # 16 capped at --max-len
    # and the scheduler holds what it reserves: 9 positions -> 16 -> 4 blocks of 4
    s = Scheduler([Request(0, 0, 5, 4)], n_blocks=8, block_size=4, reserve="pow2")
    s.step()
    assert s.blocks_in_use == [4]


def test_static_batching_admits_the_next_batch_only_when_this_one_has_finished():
    # 4 blocks of 2, each request reserving 4 positions (2 blocks): A and B make the batch;
    # B's one token comes with its prefill at step 0 and its blocks are free from step 1, but
    # C waits for A (tokens at steps 0, 1, 2; free from step 3). Continuous batching takes C
    # as soon as B's blocks are free.
    reqs = [Request(0, 0, 1, 3), Request(1, 0, 1, 1), Request(2, 0, 1, 1)]

    def first(static):
        s = Scheduler(reqs, n_blocks=4, block_size=2, reserve="prealloc", reserve_len=4,
                      contiguous=True, static=static)
        return s.run()[2].first_token

    assert first(static=True) == 3 and first(static=False) == 1


def test_paged_cannot_be_contiguous_or_static():
    for flag in ("contiguous", "static"):
        with pytest.raises(KvbenchError, match="use prealloc or pow2"):
            Scheduler([Request(0, 0, 1, 1)], 4, 2, reserve="paged", **{flag: True})


@pytest.mark.slow
def test_the_built_in_workloads_have_the_papers_means_after_the_filters():
    # ShareGPT 161.31 / 337.99, Alpaca 19.31 / 58.45 (vLLM paper, Fig. 11), within 1.5% over
    # 20,000 seeded draws; every request passes vLLM's benchmark's filters
    from kvbench.serving.workloads import WORKLOADS, kept, lengths, workload_trace

    for w in WORKLOADS.values():
        pairs = lengths(w, 20_000, 3, 2048)
        assert all(p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048 for p, o in pairs)
        assert sum(p for p, _ in pairs) / len(pairs) == pytest.approx(w.prompt_mean, rel=0.015)
        assert sum(o for _, o in pairs) / len(pairs) == pytest.approx(w.output_mean, rel=0.015)
    assert kept(4, 4, 2048) and not kept(3, 4, 2048) and not kept(4, 3, 2048)
    assert kept(1024, 1024, 2048) and not kept(1025, 4, 2048) and not kept(1000, 1049, 2048)
    assert not kept(100, 100, 199)  # --max-len below 2048 filters too
    reqs = workload_trace("sharegpt", 50, 0, 2.0, 2048)
    assert reqs == workload_trace("sharegpt", 50, 0, 2.0, 2048)  # seeded
    assert [r.arrival for r in reqs] == gaps(50, 0, 2.0)  # arrivals as every trace draws them
    with pytest.raises(KvbenchError, match="keeps too few"):
        lengths(WORKLOADS["sharegpt"], 10, 0, 9)


def test_v1_allocates_a_prefill_chunk_by_chunk_and_preempts_the_newest_for_a_chunk():
    # 4 blocks of 4, chunks of 4, admission on the first chunk's blocks alone (vLLM with
    # scheduler_reserve_full_isl off). A (prompt 4) decodes 9 tokens, holding 1, 2, then 3
    # blocks; B's prompt of 12 (3 blocks) is admitted at step 1 with its first chunk's block
    # only, takes its second at step 2 and at step 3 finds the pool full: B, the newest, is
    # preempted (and again each time it comes back, until A finishes). Allocating the whole
    # prompt at admission (v0), B waits until A has finished at step 8 and is never preempted.
    def run(per_chunk):
        s = Scheduler([Request(0, 0.0, 4, 9), Request(1, 0.0, 12, 2)], n_blocks=4,
                      block_size=4, chunk=4, reserve_full_prompt=False)
        s.per_chunk = per_chunk
        held = []
        while not s.done:
            s.step()
            held.append({q.request.id: len(q.blocks) for q in s.running})
        return s, held

    s, held = run(per_chunk=True)
    assert held[:4] == [{0: 1}, {0: 2, 1: 1}, {0: 2, 1: 2}, {0: 2}]
    assert s.records[1].preempted == 3 and s.records[0].preempted == 0
    assert s.recomputed_tokens == 8 + 4 + 4  # B's chunks thrown away: 8, then 4 twice
    s, held = run(per_chunk=False)
    assert all(1 not in h for h in held[:9]) and held[9] == {1: 3}
    assert s.records[1].preempted == 0 and s.records[1].first_token == 11
    assert Scheduler([Request(0, 0, 4, 1)], 4, 4, policy="vllm-v0").per_chunk is False


def test_v1_admits_a_prompt_only_when_the_whole_of_it_fits():
    # vLLM 0.33's admission gate (scheduler_reserve_full_isl, its default): the same trace as
    # above. B's prompt needs 3 blocks; from step 1 A holds 2 of the 4 (then 3), so B waits,
    # allocates nothing and is never preempted, until A has finished at step 8: admitted at
    # step 9, its 3 chunks at steps 9, 10, 11 (the token with the last), its decode at 12.
    # Gating on the first chunk alone admits B at step 1 and preempts it 3 times.
    s = Scheduler([Request(0, 0.0, 4, 9), Request(1, 0.0, 12, 2)], n_blocks=4, block_size=4,
                  chunk=4)
    s.run()
    assert (s.records[1].preempted, s.records[1].first_token, s.records[1].finished) == (
        0, 11, 12)
    assert s.preemptions == 0 and s.recomputed_tokens == 0


# Prefix caching (vLLM v1's automatic prefix caching), worked out by hand.

def test_a_shared_prompt_is_prefilled_once_and_its_last_position_always():
    # blocks of 4; a shared prompt of 16 (4 blocks). A (prompt 20) prefills all 20 and keys
    # the 4 shared blocks and its own block 4; B (prompt 20, arriving next step) finds the 4
    # shared blocks: 16 positions not prefilled, 4 prefilled. C's prompt is the shared 16
    # alone: 3 blocks are found, the 4th recomputed (its last position makes its token),
    # at step 2, once A has finished and B holds the shared blocks.
    reqs = [Request(0, 0.0, 20, 3, prefix=16), Request(1, 0.5, 20, 3, prefix=16),
            Request(2, 1.5, 16, 2, prefix=16)]
    s = Scheduler(reqs, n_blocks=32, block_size=4, prefix_caching=True)
    s.step()
    assert (s.hit_positions, s.query_positions) == (0, 20)
    s.step()
    b = next(q for q in s.running if q.request.id == 1)
    a = next(q for q in s.running if q.request.id == 0)
    assert b.blocks[:4] == a.blocks[:4] and b.blocks[4] != a.blocks[4]
    assert (s.hit_positions, s.query_positions) == (16, 40)
    # the shared four once; A's block 4 and the one its decode at step 1 opened; B's block 4
    assert len(s.pool.owner) == 4 + 2 + 1
    s.step()
    c = next(q for q in s.running if q.request.id == 2)
    assert c.blocks[:3] == b.blocks[:3] and c.blocks[3] not in b.blocks  # (A finished)
    assert (s.hit_positions, s.query_positions) == (28, 56)
    s.run()
    assert len(s.pool.free) == 32 and not s.pool.owner  # every holder released


def test_other_groups_and_other_requests_never_share():
    reqs = [Request(0, 0.0, 20, 2, prefix=16, group=0), Request(1, 0.5, 20, 2, prefix=16,
                                                               group=1),
            Request(2, 1.5, 20, 2)]
    s = Scheduler(reqs, n_blocks=32, block_size=4, prefix_caching=True)
    s.run()
    assert s.hit_positions == 0


def test_a_preempted_request_re_hits_its_own_blocks():
    # 6 blocks of 4: A (prompt 8) and B (prompt 8) decode until the pool runs dry; B, the
    # newest, is preempted by recompute and its full blocks stay keyed in the free queue;
    # readmitted, it finds them and prefills only its last block
    reqs = [Request(0, 0.0, 8, 8), Request(1, 0.0, 8, 8)]
    s = Scheduler(reqs, n_blocks=6, block_size=4, prefix_caching=True)
    s.run()
    rec = s.records[1]
    assert rec.preempted >= 1 and s.records[0].preempted == 0
    assert s.hit_positions > 0 and s.recomputed_tokens > s.hit_positions - 1
    off = Scheduler(reqs, n_blocks=6, block_size=4, prefix_caching=False)
    off.run()
    assert off.records[1].preempted == rec.preempted  # the same decisions, fewer positions


def test_blocks_are_evicted_least_recently_freed_first():
    # 3 blocks of 4. A (prompt 5, 1 token) takes blocks 0 and 1, keys block 0 (the shared 4)
    # and frees both at step 0, its last block first: the free queue is 2, 1, 0. B (prompt 5,
    # 1 token, other content) takes 2 and 1 from the front; block 0 keeps its key, and C
    # (A's group) finds it at step 2
    pool_blocks = 3
    reqs = [Request(0, 0.0, 5, 1, prefix=4), Request(1, 0.5, 5, 1),
            Request(2, 1.5, 5, 1, prefix=4)]
    s = Scheduler(reqs, n_blocks=pool_blocks, block_size=4, prefix_caching=True)
    s.run()
    assert s.hit_positions == 4  # C found A's shared block: B did not evict it
    # handed out from the back instead (the most recently freed first), B evicts it
    from kvbench.serving import scheduler as sched_mod

    class Mru(sched_mod.CachingPool):
        def take(self, request):
            if self.free:
                self.free.rotate(1)  # the most recently freed to the front
            return super().take(request)

    s = Scheduler(reqs, n_blocks=pool_blocks, block_size=4, prefix_caching=True)
    s.pool = Mru(pool_blocks)
    s.run()
    assert s.hit_positions == 0


def test_prefix_caching_needs_paged_blocks_and_recompute():
    for kwargs in ({"reserve": "prealloc"}, {"preempt": "swap"}):
        with pytest.raises(KvbenchError, match="--prefix-caching"):
            Scheduler([Request(0, 0, 4, 1)], 4, 4, prefix_caching=True, **kwargs)


def test_each_step_records_the_work_a_cost_model_reads():
    # A (prompt 5, 3 tokens) and B (prompt 3, 2 tokens): step 0 prefills both (8 positions,
    # 2 calls); step 1 decodes A attending 6 positions and B attending 4; step 2 A alone, 7
    s = Scheduler([Request(0, 0.0, 5, 3), Request(1, 0.0, 3, 2)], n_blocks=8, block_size=4)
    s.run()
    assert s.batch == [0, 2, 1] and s.context == [0, 10, 7]
    assert s.prefill_positions == [8, 0, 0] and s.prefill_calls == [2, 0, 0]
    assert s.prefill_sizes == [[5, 3], [], []]
    # chunks of 4: A's 5 in 4 + 1, B's 3 begun with the 3 left in step 1
    s = Scheduler([Request(0, 0.0, 5, 3), Request(1, 0.0, 3, 2)], n_blocks=8, block_size=4,
                  chunk=4)
    s.run()
    assert s.prefill_positions[:2] == [4, 4] and s.prefill_calls[:2] == [1, 2]
    assert s.prefill_sizes[:2] == [[4], [1, 3]]


def test_a_token_budget_of_two_decodes_at_most_two_a_step():
    # vLLM v0's steps: prefills alone whenever a waiting request fits, decodes in the
    # others. With a budget of 2 tokens a step (blocks of 2) three or more sequences come to
    # be decoding at once, but a step decodes at most 2 of them: each takes one token
    reqs = [Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 2), Request(2, 1.0, 2, 5),
            Request(3, 1.0, 6, 1), Request(4, 2.0, 4, 6)]
    sched = Scheduler(reqs, n_blocks=64, block_size=2, max_batched_tokens=2, policy="vllm-v0")
    sched.run()
    assert max(sched.batch) == 2 and all(r.finished is not None for r in sched.records.values())
    free = Scheduler(reqs, n_blocks=64, block_size=2, policy="vllm-v0")
    free.run()
    assert max(free.batch) >= 3  # the same trace without the budget decodes more at once


# vLLM 0.33's rules (issue 49), each worked out by hand; each test fails when its rule is
# reversed. scripts/peer-vllm.sh runs vLLM's own Scheduler beside this one, step for step.

def test_a_finished_request_frees_its_blocks_and_seat_only_after_its_step():
    # blocks of 4. A (prompt 4, 1 token) finishes with its prefill at step 0; its block is
    # free from step 1, as vLLM frees it in update_from_output(). B (prompt 8: 2 blocks, of a
    # pool of 2) waits for it: admitted at step 1, not 0.
    s = Scheduler([Request(0, 0.0, 4, 1), Request(1, 0.0, 8, 1)], n_blocks=2, block_size=4)
    s.run()
    assert [s.records[i].first_token for i in (0, 1)] == [0, 1]
    # its seat too: one sequence at a time, B admitted the step after A's last token
    s = Scheduler([Request(0, 0.0, 4, 1), Request(1, 0.0, 4, 1)], n_blocks=8, block_size=4,
                  max_seqs=1)
    s.run()
    assert [s.records[i].first_token for i in (0, 1)] == [0, 1]


def test_the_watermark_counts_the_null_block_and_holds_only_while_something_runs():
    # 9 blocks of 4 (vLLM's pool of 10 with its null block), watermark 0.2: int(0.2 * 10) = 2
    # blocks kept free, not int(0.2 * 9) = 1. A (prompt 3, 2 tokens) holds 1 block through
    # step 1; B (prompt 28: 7 blocks) arrives for step 1: 7 + 2 > 8 free, so it waits, and
    # is admitted at step 2 into the idle pool (no watermark while nothing runs): 7 <= 9.
    reqs = [Request(0, 0.0, 3, 2), Request(1, 0.5, 28, 1)]
    s = Scheduler(reqs, n_blocks=9, block_size=4, watermark=0.2)
    assert s.watermark_blocks == 2
    s.run()
    assert s.records[1].first_token == 2
    # a request that needs the whole pool runs (vLLM never holds the watermark against it)
    alone = Scheduler([Request(0, 0.0, 36, 1)], n_blocks=9, block_size=4, watermark=0.2)
    assert alone.run()[0].first_token == 0
    # v0 kept its watermark at every admission, of its own pool
    with pytest.raises(KvbenchError, match="can never run"):
        Scheduler([Request(0, 0.0, 36, 1)], n_blocks=9, block_size=4, watermark=0.2,
                  policy="vllm-v0")


def test_freed_blocks_with_no_cached_content_are_reused_first_and_cached_ones_last():
    # vLLM's free_blocks(): a request's blocks freed last block first; those holding cached
    # content (full, keyed) to the back in that order, the rest (its partial last block) to
    # the front. Pool of 5: the request holds 0, 1, 2 (0 and 1 full and keyed), free 3, 4.
    pool = CachingPool(5)
    held = [pool.take(7) for _ in range(3)]
    pool.register(held[0], ("own", 7, 0))
    pool.register(held[1], ("own", 7, 1))
    pool.release_all(held[::-1], 7)
    assert list(pool.free) == [2, 3, 4, 1, 0]  # block 2 reused first; block 0 evicted last
    assert pool.take(8) == 2 and pool.cached(("own", 7, 0)) == 0


def test_two_blocks_may_hold_one_prefix_and_a_lookup_finds_the_first_keyed():
    pool = CachingPool(4)
    a, b = pool.take(1), pool.take(2)
    key = ("shared", 0, 0)
    pool.register(a, key)
    pool.register(b, key)  # computed twice, in the same step: both stay keyed
    assert pool.cached(key) == a
    pool.release_all([a], 1)
    pool.release_all([b], 2)
    assert list(pool.free) == [2, 3, a, b]
    pool.take(3), pool.take(3)  # blocks 2, 3
    assert pool.take(3) == a and pool.cached(key) == b  # a evicted: b still holds it


def test_priority_scheduling_preempts_the_lowest_priority_even_when_already_scheduled():
    # 3 blocks of 4. A (priority 1) is admitted at step 0 and holds 2 blocks from step 1;
    # B (priority 0, higher) arrives for step 1 and takes the last block. At step 2 A's
    # decode is scheduled first (it has its blocks), then B's needs a block: vLLM's priority
    # policy preempts the lowest priority, A, undoing A's scheduled token, and B decodes.
    # First come first served preempts the newest, B itself, and A decodes.
    reqs = [Request(0, 0.0, 4, 6, priority=1), Request(1, 0.5, 4, 6, priority=0)]
    steps = {}
    for scheduling in ("priority", "fcfs"):
        s = Scheduler(reqs, n_blocks=3, block_size=4, scheduling=scheduling, decisions=True)
        for _ in range(3):
            s.step()
        steps[scheduling] = s.decisions[2]
    assert (steps["priority"].scheduled, steps["priority"].preempted) == (((1, 1),), (0,))
    assert (steps["fcfs"].scheduled, steps["fcfs"].preempted) == (((0, 1),), (1,))


def test_priority_scheduling_admits_by_priority_then_arrival():
    # one sequence at a time; C (priority 0) arrives last but runs second, after A
    reqs = [Request(0, 0.0, 4, 1, priority=2), Request(1, 0.0, 4, 1, priority=1),
            Request(2, 0.5, 4, 1, priority=0)]
    s = Scheduler(reqs, n_blocks=8, block_size=4, max_seqs=1, scheduling="priority")
    s.run()
    assert [s.records[i].first_token for i in (0, 1, 2)] == [2, 0, 1]
    with pytest.raises(KvbenchError, match="--scheduling"):
        Scheduler(reqs, n_blocks=8, block_size=4, scheduling="lottery")


def test_a_long_prefill_is_capped_per_request_unless_it_runs_alone():
    # vLLM's long_prefill_token_threshold: 8 positions a step for each prompt while another
    # request is running or waiting; alone, the rest of the budget.
    s = Scheduler([Request(0, 0.0, 20, 1), Request(1, 0.0, 20, 1)], n_blocks=16,
                  block_size=4, long_prefill=8, decisions=True)
    s.run()
    assert [d.scheduled for d in s.decisions] == [((0, 8), (1, 8)), ((0, 8), (1, 8)),
                                                  ((0, 4), (1, 4))]
    alone = Scheduler([Request(0, 0.0, 20, 1)], n_blocks=16, block_size=4, long_prefill=8,
                      decisions=True)
    alone.run()
    assert alone.decisions[0].scheduled == ((0, 20),)


# The scheduler's figures and decisions at their edges (issue 47's mutation run at HEAD): each
# worked out by hand, each failing when its comparison, count or order is shifted.

def _steps(s, n=None):
    """Run s (n steps, or to the end) and return its decisions' scheduled tuples."""
    if n is None:
        s.run()
    else:
        for _ in range(n):
            s.step()
    return [d.scheduled for d in s.decisions]


def test_two_prefills_share_one_token_budget_in_the_order_admitted():
    # budget 8: A's prompt of 6 takes 6, B's chunk the 2 left; next step B's other 4 and A's
    # decode (A first: admitted first): 1 + 4. Tokens made: 1 (A's prefill), then 2.
    s = Scheduler([Request(0, 0.0, 6, 2), Request(1, 0.0, 6, 1)], n_blocks=16, block_size=4,
                  max_batched_tokens=8, decisions=True)
    assert _steps(s) == [((0, 6), (1, 2)), ((0, 1), (1, 4))]
    assert s.decoded == [1, 2] and s.batch == [0, 1]  # tokens made; sequences decoding
    assert [d.blocks_in_use for d in s.decisions] == [3, 0]  # 2 + 1, then both finished
    assert s.finished == 2 and s.prefill_positions == [8, 4] and s.prefill_calls == [2, 1]


def test_a_budget_of_one_token_still_admits_a_one_token_chunk():
    # budget 2 (blocks of 2): A decodes (1), B is admitted with the 1 left: 1 of its 3
    s = Scheduler([Request(0, 0.0, 2, 3), Request(1, 0.5, 3, 1)], n_blocks=16, block_size=2,
                  max_batched_tokens=2, decisions=True)
    assert _steps(s, 2) == [((0, 2),), ((0, 1), (1, 1))]


def test_a_zero_token_chunk_is_never_scheduled():
    # --prefill-chunk 4 spent by A's chunk: B (older? no: newer, mid-prefill) gets none this
    # step, and no (B, 0) entry appears
    s = Scheduler([Request(0, 0.0, 8, 1), Request(1, 0.0, 8, 1)], n_blocks=16, block_size=4,
                  chunk=4, decisions=True)
    assert _steps(s) == [((0, 4),), ((0, 4),), ((1, 4),), ((1, 4),)]


def test_a_partial_chunk_before_a_decode_does_not_stop_the_decodes_after_it():
    # long prefill 4: B (prompt 20, admitted first) chunks 4 a step; C (prompt 4) is done in
    # step 0 and decodes from step 1, after B's partial chunk in the order admitted
    s = Scheduler([Request(0, 0.0, 20, 1), Request(1, 0.0, 4, 3)], n_blocks=16, block_size=4,
                  long_prefill=4, decisions=True)
    assert _steps(s, 3) == [((0, 4), (1, 4)), ((0, 4), (1, 1)), ((0, 4), (1, 1))]
    assert s.records[1].tokens == [0, 1, 2] and s.decoded == [1, 1, 1]


def test_a_chunk_that_opens_two_blocks_takes_both():
    # blocks of 4; A's 12-position prompt in chunks of 8: its second step takes 4 more
    # positions; a first chunk of 8 needs 2 blocks at once
    s = Scheduler([Request(0, 0.0, 12, 1)], n_blocks=8, block_size=4, chunk=8, decisions=True)
    s.step()
    assert len(s.running[0].blocks) == 2 and s.decisions[0].blocks_in_use == 2
    s.step()
    assert s.finished == 1 and s.records[0].first_token == 1


def test_a_preempted_request_resumes_before_the_requests_waiting_behind_it():
    # 3 blocks of 4, two sequences at most. A and B (prompts 4) run; C arrives for step 1 and
    # waits (two running). At step 1 A takes the free block for its 5th position, B finds
    # none and, the newest, is preempted. A finishes at step 5; at step 6 B, at the head of
    # the queue, is admitted (its 4 + 1 positions recomputed) before C.
    reqs = [Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 6), Request(2, 0.5, 4, 1)]
    s = Scheduler(reqs, n_blocks=3, block_size=4, decisions=True, max_seqs=2)
    s.run()
    assert s.decisions[1].preempted == (1,) and s.decisions[5].finished == (0,)
    assert s.decisions[6].scheduled == ((1, 5), (2, 4))


def test_priority_skips_a_lowest_priority_that_preempted_itself_and_goes_on():
    # blocks of 2, 5 of them. Step 0: D (priority 0) and L (priority 1) are admitted, D first;
    # step 1: both decode (D takes a 2nd block) and A (priority 0, prompt 4: 2 blocks) is
    # admitted: no block is left. Step 2: L's 3rd position needs a block; the lowest priority
    # is L itself: preempted, and A after it still decodes, in L's freed block (FCFS, or a
    # loop that stopped there, would leave A out).
    reqs = [Request(0, 0.5, 4, 4, priority=0), Request(1, 0.0, 1, 4, priority=1),
            Request(2, 1.5, 4, 1, priority=2), Request(3, 0.0, 2, 4, priority=0)]
    s = Scheduler(reqs, n_blocks=5, block_size=2, scheduling="priority", decisions=True)
    assert _steps(s, 3) == [((3, 2), (1, 1)), ((3, 1), (1, 1), (0, 4)), ((3, 1), (0, 1))]
    assert s.decisions[2].preempted == (1,)


def test_priority_goes_on_past_a_victim_in_the_middle_of_the_running():
    # blocks of 2, 3 of them. Admitted by priority: C (priority 0), then A and B (priority 1,
    # the same arrival: by id); a block each. Step 1: C's 3rd position needs a block; the
    # lowest priority, latest arrival is a tie of A and B: the first of them in the running,
    # A, in the middle, is preempted, and B after it decodes.
    reqs = [Request(0, 0.0, 1, 2, priority=1), Request(1, 0.0, 1, 3, priority=1),
            Request(2, 0.0, 2, 2, priority=0), Request(3, 1.5, 2, 4, priority=1)]
    s = Scheduler(reqs, n_blocks=3, block_size=2, scheduling="priority", decisions=True)
    assert _steps(s, 2) == [((2, 2), (0, 1), (1, 1)), ((2, 1), (1, 1))]
    assert s.decisions[1].preempted == (0,)


def test_a_priority_victim_already_scheduled_gives_its_tokens_back_to_the_budget():
    # blocks of 2, 4 of them, a budget of 3, admission on the first chunk. V (priority 2)
    # runs from step 1, B (priority 1) from step 2; A (priority 1, prompt 6) is admitted at
    # step 3 with the 1 token left. Step 4: V's decode is scheduled (V has its blocks), then
    # B's needs a block: the lowest priority, V, is preempted and its token returned, so
    # B's decode and A's next chunk take 1 + 2 of the 3 (without the return: A's chunk 1).
    reqs = [Request(0, 2.5, 6, 2, priority=1), Request(1, 0.5, 1, 4, priority=2),
            Request(2, 1.5, 1, 6, priority=1)]
    s = Scheduler(reqs, n_blocks=4, block_size=2, max_batched_tokens=3,
                  scheduling="priority", reserve_full_prompt=False, decisions=True)
    assert _steps(s, 5) == [(), ((1, 1),), ((1, 1), (2, 1)), ((1, 1), (2, 1), (0, 1)),
                            ((2, 1), (0, 2))]
    assert s.decisions[4].preempted == (1,)


def test_run_stops_at_max_steps_exactly():
    reqs = [Request(0, 0.0, 4, 3)]  # 3 steps: the prefill's token, then 2 decodes
    Scheduler(reqs, n_blocks=4, block_size=4).run(max_steps=3)
    with pytest.raises(KvbenchError, match="did not finish in 2 steps"):
        Scheduler(reqs, n_blocks=4, block_size=4).run(max_steps=2)


def test_a_steps_clock_admits_what_has_arrived_by_it():
    s = Scheduler([Request(0, 3.0, 4, 1)], n_blocks=4, block_size=4)
    s.step(5.0)  # the clock says 5: the request of 3.0 has arrived, though the step is 0
    assert s.records[0].first_token == 0


def test_v0_decodes_when_the_waiting_request_does_not_fit():
    # v0: a step of prefills whenever a waiting request fits; B (prompt 16: 4 blocks) does
    # not fit beside A, so A's decode steps go on (not an empty prefill step)
    reqs = [Request(0, 0.0, 4, 4), Request(1, 0.5, 16, 1)]
    s = Scheduler(reqs, n_blocks=4, block_size=4, policy="vllm-v0", decisions=True)
    assert _steps(s, 3) == [((0, 4),), ((0, 1),), ((0, 1),)]


def test_block_keys_share_only_whole_blocks_of_the_prefix():
    r = Request(7, 0.0, 40, 1, prefix=20, group=3)
    assert [r.block_key(j, 8) for j in range(3)] == [("shared", 3, 0), ("shared", 3, 1),
                                                     ("own", 7, 2)]  # 16..23 passes 20


def test_poisson_gaps_are_exponential_draws_of_the_seed():
    import random

    rng, now, want = random.Random(5), 0.0, []
    for _ in range(3):
        now += rng.expovariate(2.0)
        want.append(now)
    assert gaps(3, 5, 2.0) == want and gaps(2, 5, math.inf) == [0.0, 0.0]


def test_an_output_is_capped_at_the_positions_its_prompt_leaves():
    # --max-len 10 and a prompt of 1: outputs drawn at 50 are cut to 9
    reqs = trace(3, 0, parse_len_dist("uniform:1:1"), parse_len_dist("uniform:50:50"),
                 math.inf, 10)
    assert [r.output_len for r in reqs] == [9, 9, 9]


def test_the_limits_are_refused_by_name_and_at_their_edges():
    from kvbench.serving.scheduler import check_limits

    with pytest.raises(KvbenchError, match=r"^--max-seqs must be a positive integer, got 0$"):
        Scheduler([Request(0, 0.0, 4, 1)], 4, 4, max_seqs=0)
    with pytest.raises(KvbenchError, match=r"^--max-batched-tokens must be a positive"):
        check_limits(None, None, 0, 0.0, "vllm")
    with pytest.raises(KvbenchError, match="below one block of 4 positions"):
        Scheduler([Request(0, 0.0, 4, 1)], 4, 4, max_batched_tokens=2)
    check_limits(32, None, 32, 0.0, "vllm")  # a budget of exactly one chunk is enough
    with pytest.raises(KvbenchError, match=r"^unknown --policy 'v2'; use vllm or vllm-v0$"):
        check_limits(None, None, None, 0.0, "v2")
    with pytest.raises(KvbenchError, match="^contiguous and static reservations reserve"):
        Scheduler([Request(0, 0.0, 4, 1)], 4, 4, static=True)
    with pytest.raises(KvbenchError, match="^--prefix-caching shares paged blocks"):
        Scheduler([Request(0, 0.0, 4, 1)], 4, 4, prefix_caching=True, preempt="swap")


def test_a_request_is_refused_by_what_its_reservation_needs():
    # paged caches prompt + output − 1 positions: 4 + 5 → 8 → 2 blocks of 4 fit; 4 + 6 → 9
    # does not. prealloc reserves --max-len: 16 → 4 blocks, more than 2.
    Scheduler([Request(0, 0.0, 4, 5)], n_blocks=2, block_size=4)
    with pytest.raises(KvbenchError, match="needs 3 blocks of 4 but the budget is 2"):
        Scheduler([Request(0, 0.0, 4, 6)], n_blocks=2, block_size=4)
    with pytest.raises(KvbenchError, match="needs 4 blocks of 4 but the budget is 2"):
        Scheduler([Request(0, 0.0, 4, 1)], n_blocks=2, block_size=4, reserve="prealloc",
                  reserve_len=16)


def test_defaults_of_a_bare_scheduler():
    s = Scheduler([Request(0, 0.0, 4, 1)], 4, 4)
    assert s.decisions is None and s.per_chunk and s.finished == 0  # no log unless asked
    assert not Scheduler([Request(0, 0.0, 4, 1)], 4, 4, reserve="prealloc").per_chunk
    with pytest.raises(AssertionError, match="does not hold"):
        CachingPool(2).release_all([1], 9)  # a block no one holds


def test_idle_prefix_hits_count_once_at_admission():
    # blocks of 4, a shared prompt of 8 (2 blocks). A (prompt 9) computes and frees them; B
    # (prompt 9, same prefix) arrives when only those 2 cached blocks and 1 more are free:
    # it needs 3 blocks of which 2 are idle hits: 3 − 2 + 2 = 3 <= 3 free: admitted at once.
    reqs = [Request(0, 0.0, 9, 1, prefix=8), Request(1, 1.5, 9, 1, prefix=8),
            Request(2, 0.0, 4, 9)]
    s = Scheduler(reqs, n_blocks=6, block_size=4, prefix_caching=True, decisions=True)
    s.run()
    assert s.hit_positions == 8 and s.records[1].first_token == 2


def _decisions(spec, **kw):
    reqs = [Request(*a, prefix=p, group=0) for a, p in spec]
    s = Scheduler(reqs, decisions=True, **kw)
    s.run(300)
    return s


def test_the_whole_prompt_gate_counts_idle_prefix_hits_as_blocks_to_take():
    # (found by a search of small traces against the gate with idle hits subtracted.) At
    # step 5, request 2 (prompt 8, its first 4 positions a cached prefix no one holds) waits:
    # its 4 blocks less 2 hits, plus the 2 idle hits it takes out of the free queue, exceed
    # the 3 free blocks; subtracting them instead would admit it.
    s = _decisions([((0, 0.5, 3, 4), 4), ((1, 1.5, 8, 2), 0), ((2, 1.5, 8, 5), 4)],
                   n_blocks=8, block_size=2, max_batched_tokens=6, long_prefill=2, chunk=4,
                   prefix_caching=True)
    assert s.decisions[4].preempted == (2,) and s.decisions[5].scheduled == ((1, 2),)


def test_a_swapped_request_back_from_the_host_lets_the_next_waiting_one_in():
    # (found by a search against `break` after a swap-in.) At step 5 request 1, swapped out
    # at step 4, cannot come back yet, but the loop must go on past a swapped one brought
    # back: request 2 is admitted with a chunk of 3 beside request 0's decode.
    s = _decisions([((0, 0.0, 1, 6), 8), ((1, 0.5, 1, 6), 8), ((2, 1.5, 6, 5), 8),
                    ((3, 0.0, 3, 5), 8)], n_blocks=8, block_size=2, max_batched_tokens=4,
                   chunk=4, preempt="swap")
    assert s.decisions[4].preempted == (1,) and s.decisions[5].scheduled == ((0, 1), (2, 3))
    assert s.swapped_blocks == 4


def test_v0_admits_on_its_whole_prompt_less_its_prefix_hits():
    # (found by a search against hits added instead of subtracted.) v0 with prefix caching:
    # at step 8 request 1 (prompt 3) is admitted beside request 2's chunk: its blocks are its
    # whole prompt's less the blocks found cached.
    s = _decisions([((0, 1.5, 9, 3), 8), ((1, 2.5, 3, 3), 0), ((2, 1.5, 2, 5), 8)],
                   n_blocks=8, block_size=2, chunk=3, prefix_caching=True, policy="vllm-v0")
    assert s.decisions[8].scheduled == ((2, 2), (1, 1))


def test_a_running_chunk_that_opens_two_blocks_takes_both():
    # blocks of 4, chunks of 8: step 0 admits 8 positions (2 blocks); step 1's chunk of 8
    # more takes 2 blocks in _grow, not 1
    s = Scheduler([Request(0, 0.0, 20, 1)], n_blocks=8, block_size=4, chunk=8)
    s.step()
    s.step()
    assert len(s.running[0].blocks) == 4


def test_priority_scheduling_is_refused_under_v0():
    with pytest.raises(KvbenchError) as refused:
        Scheduler([Request(0, 0.0, 4, 1)], 4, 4, scheduling="priority", policy="vllm-v0")
    assert str(refused.value) == "--scheduling priority is vLLM v1's; use --policy vllm"


def _admitted_first(window: int, threshold: float, prefix_caching: bool = True) -> list[int]:
    # r0 runs (3 of 8 blocks of 4 at step 1: the pool 0.375 used) and holds its shared
    # prompt; at step 1 r1 (its own prompt) and r2 (r0's prompt: one whole block cached)
    # arrive, one seat left (max_seqs 2): who is admitted at step 1
    reqs = [Request(0, 0, 8, 20, prefix=8), Request(1, 1, 8, 1), Request(2, 1, 8, 1, prefix=8)]
    s = Scheduler(reqs, n_blocks=8, block_size=4, prefix_caching=prefix_caching, max_seqs=2,
                  decisions=True, cache_aware=(window, threshold))
    s.step()
    s.step()
    return [i for i, _ in s.decisions[1].scheduled if i != 0]


def test_cache_aware_admission_puts_a_cached_prefix_first_above_its_threshold():
    assert _admitted_first(0, 0.5) == [1]  # off (vLLM's default): arrival order
    assert _admitted_first(2, 0.5) == [1]  # the pool 0.375 used, below 0.5: no reordering
    assert _admitted_first(2, 0.3) == [2]  # above 0.3: r2's cached block first
    assert _admitted_first(2, 0.375) == [2]  # used exactly the threshold: reordered too
    assert _admitted_first(1, 0.3) == [1]  # a window of one: nothing to trade places with
    assert _admitted_first(2, 0.3, prefix_caching=False) == [1]  # no cache: vLLM ignores it


def test_among_equal_priorities_the_victim_is_the_latest_arrival():
    # A and B, both priority 1, hold 2 blocks each of 4; at step 5 both need a fifth: vLLM
    # preempts max((priority, arrival)) of the running, B (arrived 0.1 s after A), and A
    # decodes. The earliest arrival would be A.
    reqs = [Request(0, 0.0, 4, 6, priority=1), Request(1, 0.1, 4, 6, priority=1)]
    s = Scheduler(reqs, n_blocks=4, block_size=4, scheduling="priority", decisions=True)
    for _ in range(6):
        s.step()
    assert (s.decisions[5].scheduled, s.decisions[5].preempted) == (((0, 1),), (1,))


def test_a_request_prefilled_again_after_preemption_keeps_its_first_tokens_step():
    # A's first token at step 0; preempted at step 2 (B, priority 0, needs its block) and
    # prefilled again at step 7 with its 2 tokens: its TTFT still counts from step 0
    reqs = [Request(0, 0.0, 4, 6, priority=1), Request(1, 0.5, 4, 6, priority=0)]
    s = Scheduler(reqs, n_blocks=3, block_size=4, scheduling="priority", decisions=True)
    s.run()
    assert s.decisions[2].preempted == (0,) and s.decisions[7].scheduled == ((0, 6),)
    assert s.records[0].first_token == 0 and s.records[1].first_token == 1
