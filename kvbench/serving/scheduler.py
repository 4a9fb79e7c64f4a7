"""Continuous batching's bookkeeping: a seeded request trace, a pool of KV blocks and a
scheduler that decodes every running sequence each step, preempts when the pool runs dry,
admits waiting requests while blocks last and frees a sequence's blocks after the step it
finishes in (vLLM 0.33's v1 policy: the most recently admitted sequence is preempted first,
by recompute or by swap, and nothing new is admitted in a step that preempted). No torch:
this is the accounting a serving engine does on the host. An `engine`
(kvbench.serving.engine) may carry out each step's decisions on a real cache as the step
runs; without one the scheduler only counts.

Three ways to reserve, on the same trace and pool: `paged` takes a block whenever a
sequence's next position needs one; `prealloc` reserves, when it admits a request, the blocks
of the longest a request may get (`reserve_len`, a server's --max-len, as a cache
preallocated to the maximum length does; without it the request's own prompt + output, an
oracle no server has); `pow2` reserves the request's prompt + output rounded up to a power
of two (at most reserve_len), the vLLM paper's Orca (Pow2). A reservation is `contiguous`
when it must be one run of consecutive blocks, as a cache preallocated per request is: the
paper's Orca baselines, where free blocks scattered between reservations (external
fragmentation) cannot take a request they add up to. `static` batching admits a batch only
when the one before has wholly finished (FasterTransformer's, the paper's static batching).

Positions: a request of prompt P generating O tokens caches P + O - 1 positions (its last
token is never fed back). Its prefill writes positions 0..P-1 and yields token 1; the step
that yields token g+1 writes position P+g-1. A sequence resumed by recompute prefills its
prompt and its g tokens (positions 0..P+g-1) and so yields token g+1.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from kvbench.errors import KvbenchError

POLICIES = ("vllm", "vllm-v0")  # v1's mixed steps, or v0's prompt-only steps
SCHEDULING = ("fcfs", "priority")  # vLLM's --scheduling-policy
PREEMPT = ("recompute", "swap")
RESERVE = ("paged", "prealloc", "pow2")


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    arrival: float  # when it arrives, on the scheduler's clock (steps, or seconds)
    prompt_len: int
    output_len: int  # tokens it generates, the first with its prefill
    prefix: int = 0  # its first `prefix` positions are shared prompt `group`'s (a system prompt)
    group: int = 0
    priority: int = 0  # under --scheduling priority: lower runs first (vLLM's convention)

    @property
    def rank(self) -> tuple:
        """Its place under priority scheduling: priority, then arrival, then id."""
        return (self.priority, self.arrival, self.id)

    def block_key(self, j: int, block_size: int) -> tuple:
        """What block j of this request holds, as prefix caching hashes it (its tokens and
        every token before them): a block wholly inside the shared prompt is that prompt's,
        the same for every request that starts with it; any other is this request's own."""
        if (j + 1) * block_size <= self.prefix:
            return ("shared", self.group, j)
        return ("own", self.id, j)

    @property
    def reach(self) -> int:
        """Prompt + output: the positions a server reserving per request must allow for."""
        return self.prompt_len + self.output_len


def check_limits(chunk: int | None, max_seqs: int | None, max_batched_tokens: int | None,
                 watermark: float, policy: str, block_size: int = 1) -> None:
    """Refuse, in one line, vLLM limits the Scheduler cannot take."""
    for flag, value in (("--max-seqs", max_seqs), ("--max-batched-tokens", max_batched_tokens)):
        if value is not None and value < 1:
            raise KvbenchError(f"{flag} must be a positive integer, got {value}")
    if max_batched_tokens is not None and max_batched_tokens < block_size:
        raise KvbenchError(f"--max-batched-tokens {max_batched_tokens} is below one block of "
                           f"{block_size} positions; raise it or lower --block-size")
    if max_batched_tokens is not None and chunk is not None and max_batched_tokens < chunk:
        raise KvbenchError(f"--max-batched-tokens {max_batched_tokens} is below one "
                           f"--prefill-chunk of {chunk} positions; raise it or lower the chunk")
    if not 0 <= watermark < 1:
        raise KvbenchError(f"--watermark is a fraction of the pool kept free, from 0 up to 1; "
                           f"got {watermark}")
    if policy not in POLICIES:
        raise KvbenchError(f"unknown --policy {policy!r}; use {' or '.join(POLICIES)}")


def reserved(r: Request, reserve: str, reserve_len: int | None) -> int:
    """Positions a request needs blocks for at most: prealloc's reservation (reserve_len, or
    the request's own reach), or what paged fills (its last token is never cached)."""
    if reserve == "prealloc":
        return reserve_len or r.reach
    if reserve == "pow2":  # at most twice the request's own reach
        return min(1 << (r.reach - 1).bit_length(), reserve_len or math.inf)
    return r.reach - 1


def refuse_unfit(requests: list[Request], n_blocks: int, block_size: int, reserve: str,
                 reserve_len: int | None = None) -> None:
    """One line for the first request the whole pool cannot hold, before anything runs."""
    for r in requests:
        need = math.ceil(reserved(r, reserve, reserve_len) / block_size)
        if need > n_blocks:
            raise KvbenchError(
                f"request {r.id} ({r.prompt_len} prompt + {r.output_len} output tokens) "
                f"needs {need} blocks of {block_size} but the budget is {n_blocks}: that "
                "request can never run; raise --kv-blocks or lower --max-len")


class BlockPool:
    """Fixed-size blocks handed out from a free list, each with one owner at a time."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.free = deque(range(n_blocks))
        self.owner: dict[int, int] = {}  # block -> the request holding it

    def take(self, request: int) -> int | None:
        if not self.free:
            return None
        block = self.free.popleft()
        if block in self.owner:
            raise AssertionError(f"block {block} handed out twice")
        self._hand_out(block, request)
        return block

    def _hand_out(self, block: int, request: int) -> None:
        self.owner[block] = request

    def take_run(self, request: int, n: int) -> list[int] | None:
        """n consecutive blocks, the run that starts lowest (first fit), or None when no
        run of n blocks is free, however many free blocks there are."""
        free, start = sorted(self.free), None
        for i, block in enumerate(free):
            if i == 0 or block != free[i - 1] + 1:
                start = i  # a new run of consecutive free blocks begins here
            if i - start + 1 == n:
                run = free[start:i + 1]
                taken = set(run)
                self.free = deque(b for b in self.free if b not in taken)
                for b in run:
                    self._hand_out(b, request)
                return run
        return None

    def release_all(self, blocks: list[int], request: int) -> None:
        """`request`'s blocks back to the back of the free queue, in the order given."""
        for block in blocks:
            if self.owner.get(block) != request:
                raise AssertionError(f"request {request} frees block {block} it does not hold")
            del self.owner[block]
            self.free.append(block)


class CachingPool(BlockPool):
    """Blocks shared by content (vLLM's automatic prefix caching): a full block is kept under
    its key (Request.block_key) and any request whose content has that key at that place
    holds the same block, counted once per holder. Blocks are handed out from the front of
    the free queue and lose their key when they are. A block no one holds any more goes back
    as vLLM's free_blocks() puts it: one that holds cached content to the back, still keyed
    (a later request, or its own request readmitted after a preemption, can find it again;
    the least recently freed is evicted first), one that holds none (a partial last block)
    to the front, reused first. Two blocks may hold the same content (two requests computed
    it in the same step): both stay keyed, and a lookup finds the first keyed."""

    def __init__(self, n_blocks: int):
        super().__init__(n_blocks)
        self.owner: dict[int, set[int]] = {}  # block -> the requests holding it
        self.block_of: dict[tuple, dict[int, None]] = {}  # key -> blocks holding it, in order
        self.key_of: dict[int, tuple] = {}

    def _hand_out(self, block: int, request: int) -> None:
        if (key := self.key_of.pop(block, None)) is not None:  # evicted: about to be written
            del self.block_of[key][block]
            if not self.block_of[key]:
                del self.block_of[key]
        self.owner[block] = {request}

    def take_run(self, request: int, n: int) -> list[int] | None:
        raise AssertionError("prefix caching shares blocks; it reserves no runs")

    def cached(self, key: tuple) -> int | None:
        blocks = self.block_of.get(key)
        return next(iter(blocks)) if blocks else None

    def share(self, block: int, request: int) -> None:
        """`request` holds `block` too (a hit): out of the free queue if no one held it."""
        if block not in self.owner:
            self.free.remove(block)
            self.owner[block] = set()
        self.owner[block].add(request)

    def register(self, block: int, key: tuple) -> None:
        """`block` is full and holds `key`'s content."""
        if block not in self.key_of:
            self.block_of.setdefault(key, {})[block] = None
            self.key_of[block] = key

    def release_all(self, blocks: list[int], request: int) -> None:
        """`request`'s blocks, in the order given (the eviction order: vLLM frees a
        request's last block first); those no one holds any more back to the free queue."""
        first: list[int] = []
        last: list[int] = []
        for block in blocks:
            holders = self.owner.get(block, set())
            if request not in holders:
                raise AssertionError(f"request {request} frees block {block} it does not hold")
            holders.remove(request)
            if not holders:
                del self.owner[block]
                (last if block in self.key_of else first).append(block)
        self.free.extendleft(reversed(first))  # the first given at the very front
        self.free.extend(last)


@dataclass(slots=True)
class Running:
    request: Request
    blocks: list[int] = field(default_factory=list)
    generated: int = 0  # tokens generated so far (kept across a preemption)
    swapped: bool = False  # its cache waits in host memory (preempted by swap)
    prefilled: int | None = None  # positions its prefill has written so far; None: decoding
    hit: int = 0  # positions found in the prefix cache when it was (last) admitted
    registered: int = 0  # its leading full blocks already keyed in the prefix cache
    active: bool = False  # in the scheduler's running list (a set's test, not a list's)

    @property
    def length(self) -> int:
        """Positions cached once its next token is made: the prompt and every token so far."""
        return self.request.prompt_len + self.generated

    @property
    def cached(self) -> int:
        """Positions cached now (the newest token is not yet fed back; mid-prefill, the
        positions its chunks have written)."""
        if self.prefilled is not None:
            return self.prefilled
        return self.request.prompt_len + max(self.generated - 1, 0)


@dataclass(frozen=True)
class Step:
    """One step's decisions, as a user can diff them against another scheduler's."""

    scheduled: tuple[tuple[int, int], ...]  # (request id, tokens), in the order scheduled
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    blocks_in_use: int


@dataclass(slots=True)
class Record:
    """One request's life, in steps: when it got its first token and finished."""

    request: Request
    first_token: int | None = None
    finished: int | None = None
    preempted: int = 0
    tokens: list[int] = field(default_factory=list)  # the step that made each output token


class Scheduler:
    """Decodes, preempts, admits and finishes on a BlockPool, one step at a time, as vLLM
    0.33's v1 Scheduler does (scripts/peer-vllm.sh runs vLLM's own beside it, step for step).

    A step: requests whose arrival is due join the queue. The step is scheduled whole, then
    run. The running sequences, in the order admitted, each get their next token or their
    prompt's next chunk (decodes and chunks mixed), taking a block when a position starts
    one; when none is free the most recently admitted sequence is preempted (recompute: its
    blocks freed, it waits at the head of the queue and prefills its prompt and tokens again
    when readmitted; swap, kvbench's own: its blocks' contents go to host memory and come
    back on readmission, into whatever blocks are free then). Then, if nothing was
    preempted, waiting requests are admitted first come first served while their blocks can
    be taken: paged, only if blocks for the whole prompt (less prefix-cache hits) are free
    (vLLM's scheduler_reserve_full_isl; `reserve_full_prompt=False`: the first chunk's), the
    first chunk's allocated; prealloc, every block the request may reach. A swapped request's
    cache is copied back and it decodes from the next step. Then the step runs, and the
    requests that made their last token free their blocks and seats: usable from the next
    step, as vLLM frees them in update_from_output().

    vLLM's limits (its SchedulerConfig): `max_seqs` (max_num_seqs) caps the sequences running
    at once; `max_batched_tokens` (max_num_batched_tokens) caps the tokens a step schedules,
    every one counted, so a prompt longer than what is left is prefilled in chunks over
    several steps; `long_prefill` (long_prefill_token_threshold) caps one request's chunk
    while another runs or waits; `chunk` (kvbench's) caps the prompt positions of a step,
    all requests together. `watermark` keeps int(watermark × (n_blocks + 1)) blocks free
    (vLLM's pool counts its null block) when a request is admitted while others run.
    `scheduling` "priority" orders the queue by (priority, arrival, id) and preempts the
    lowest priority, undoing its work of the step if it was scheduled. `policy` "vllm-v0"
    runs a step of prefills alone whenever a waiting request can be admitted, and decodes
    only in the others (v0's default scheduler without chunked prefill; its watermark held
    at every admission, of n_blocks). `decisions` records each step's Step.
    """

    def __init__(self, requests: list[Request], n_blocks: int, block_size: int,
                 reserve: str = "paged", preempt: str = "recompute",
                 reserve_len: int | None = None, engine=None, chunk: int | None = None,
                 max_seqs: int | None = None, max_batched_tokens: int | None = None,
                 watermark: float = 0.0, policy: str = "vllm", contiguous: bool = False,
                 static: bool = False, prefix_caching: bool = False,
                 long_prefill: int | None = None, reserve_full_prompt: bool = True,
                 decisions: bool = False, scheduling: str = "fcfs",
                 cache_aware: tuple[int, float] = (0, 0.5), lean: bool = False,
                 on_step=None, on_finish=None):
        if reserve not in RESERVE:
            raise KvbenchError(f"unknown --reserve {reserve!r}; use {', '.join(RESERVE)}")
        if (contiguous or static) and reserve == "paged":
            raise KvbenchError("contiguous and static reservations reserve a request's "
                               "blocks when it is admitted; use prealloc or pow2")
        if prefix_caching and (reserve != "paged" or preempt != "recompute"):
            raise KvbenchError("--prefix-caching shares paged blocks and preempts by "
                               "recompute (as vLLM v1 does); use --reserve paged and "
                               "--preempt recompute")
        if scheduling not in SCHEDULING:
            raise KvbenchError(f"unknown --scheduling {scheduling!r}; use fcfs or priority")
        if scheduling == "priority" and policy != "vllm":
            raise KvbenchError("--scheduling priority is vLLM v1's; use --policy vllm")
        self.scheduling = scheduling
        if preempt not in PREEMPT:
            raise KvbenchError(f"unknown --preempt {preempt!r}; use recompute or swap")
        self.block_size, self.reserve, self.preempt = block_size, reserve, preempt
        self.reserve_len = reserve_len
        self.engine = engine
        self.chunk = chunk  # prompt positions prefilled per step, all sequences together
        check_limits(chunk, max_seqs, max_batched_tokens, watermark, policy, block_size)
        self.max_seqs, self.max_batched_tokens = max_seqs, max_batched_tokens
        self.policy = policy
        self.contiguous, self.static = contiguous, static
        # v1 allocates a prefill's blocks chunk by chunk, as each is scheduled; v0 (and any
        # reservation made at admission) the whole prompt's at once
        self.per_chunk = policy == "vllm" and reserve == "paged"
        # v1 counts its watermark on its pool, null block included (kvbench's n_blocks + 1)
        self.watermark_blocks = int(watermark * (n_blocks + (policy == "vllm")))
        # (v1 admits into the whole pool while nothing runs: the watermark never refuses)
        refuse_unfit(requests, n_blocks - (0 if policy == "vllm" else self.watermark_blocks),
                     block_size, reserve, reserve_len)
        self.long_prefill = long_prefill  # vLLM's long_prefill_token_threshold
        # vLLM 0.34's cache_aware_admission_window and _threshold (FCFS with prefix caching)
        self.cache_aware, self.cache_aware_threshold = cache_aware
        if not (prefix_caching and scheduling == "fcfs"):
            self.cache_aware = 0
        self.reserve_full_prompt = reserve_full_prompt  # vLLM's scheduler_reserve_full_isl
        self.prefix_caching = prefix_caching
        self.pool = CachingPool(n_blocks) if prefix_caching else BlockPool(n_blocks)
        self.hit_positions = 0  # prompt positions found in the prefix cache, not prefilled
        self.query_positions = 0  # prompt positions admitted requests asked for
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []  # in the order admitted
        # lean (a fleet's trace, --steps-only): no per-step lists are kept, each step handed
        # to on_step(i, Step | None, tokens, batch, context, prefill positions) instead, a
        # request's record made when it arrives and handed to on_finish(record) and dropped
        # when it finishes, so memory follows the requests in flight, not the trace's length
        self.lean, self.on_step, self.on_finish = lean, on_step, on_finish
        self.records = {} if lean else {r.id: Record(r) for r in requests}
        self.batch_sum = self.batch_max = self.blocks_sum = self.blocks_max = 0
        self.now = 0  # steps taken
        self.preemptions = 0
        self.finished = 0  # requests finished so far
        self.swapped_blocks = 0  # block copies to and from the host (swap)
        self.recomputed_tokens = 0  # positions prefilled again (recompute)
        self.blocks_in_use: list[int] = []  # per step
        self.decoded: list[int] = []  # tokens generated per step
        self.batch: list[int] = []  # sequences decoding per step
        # what each step's work was, for a cost model (kvbench.serving.profile): the positions
        # the decoding sequences attended, and the positions each prefill call wrote
        self.context: list[int] = []
        self.prefill_sizes: list[list[int]] = []  # each prefill call's positions, per step
        self._step_context = 0
        self._step_sizes: list[int] = []
        self._plan: list[tuple[Running, int | None, int]] = []
        self._preempted: list[int] = []
        self._finished: list[int] = []
        # each step's decisions (with `decisions`): who was scheduled with how many tokens,
        # who was preempted, who finished, the blocks in use after it
        self.decisions: list[Step] | None = [] if decisions else None

    @property
    def prefill_positions(self) -> list[int]:
        """Prompt positions prefilled per step."""
        return [sum(sizes) for sizes in self.prefill_sizes]

    @property
    def prefill_calls(self) -> list[int]:
        """Prefill calls (prompts, or chunks of them) per step."""
        return [len(sizes) for sizes in self.prefill_sizes]

    def _reserved(self, r: Request) -> int:
        return reserved(r, self.reserve, self.reserve_len)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    @property
    def idle(self) -> bool:
        """Nothing to do until the next arrival."""
        return not (self.waiting or self.running)

    def run(self, max_steps: int = 10**7) -> dict[int, Record]:
        while not self.done:
            if self.now >= max_steps:
                raise KvbenchError(f"the trace did not finish in {max_steps} steps")
            self.step()
        return self.records

    def step(self, clock: float | None = None) -> None:
        """One step; requests arrived by `clock` (default: the step count) join the queue.

        As vLLM's engine steps: the step is scheduled whole first (the running sequences in
        the order admitted, each its next token or its prompt's next chunk, preempting the
        newest when no block is free; then, if nothing was preempted, waiting requests), then
        run, and only then do finished requests free their blocks and seats: usable from the
        next step, as vLLM frees them in update_from_output()."""
        clock = self.now if clock is None else clock
        while self.pending and self.pending[0].arrival <= clock:
            r = self.pending.popleft()
            if self.lean:
                self.records[r.id] = Record(r)
            self._enqueue(Running(r))
        self._plan = []  # (seq, chunk start or None for a decode, end), as scheduled
        before = self.preemptions
        self._budget = self.max_batched_tokens or math.inf  # every scheduled token counts
        self._prompt = self.chunk or math.inf  # kvbench's cap on prompt positions, all seqs
        # v0: a step of prefills alone, if a waiting request fits
        if self.policy == "vllm-v0" and self.waiting and self._may_admit():
            admitted = len(self.running)
            self._admit()
            if len(self.running) > admitted:
                return self._run_step()
        bs, caching = self.block_size, self.prefix_caching
        for seq in list(self.running):  # oldest first; decodes and prefill chunks mixed (v1)
            if self._budget <= 0:
                break
            if not seq.active:
                continue  # preempted for an older sequence's blocks this step
            if seq.prefilled is None:  # its next token (the loop a long trace spends in)
                length = seq.request.prompt_len + seq.generated
                if len(seq.blocks) * bs < length and not self._grow(seq, length):
                    if self.scheduling == "priority":
                        continue  # it was the lowest: higher ones after it may fit now
                    break  # preempted itself: nothing newer is left to schedule
                self._plan.append((seq, None, length))
                if caching and length // bs > seq.registered:
                    self._register(seq, length)
                self._budget -= 1
                continue
            n = int(min(seq.length - seq.prefilled, self._budget, self._prompt,
                        self._long_prefill()))
            if n <= 0:
                continue
            if self.per_chunk and not self._grow(seq, seq.prefilled + n):
                if self.scheduling == "priority":
                    continue
                break
            self._chunk(seq, n)
        if self.preemptions == before and self.policy == "vllm" and self._may_admit():
            if self.cache_aware:
                self._reorder_by_cached_prefix()
            self._admit()
        self._run_step()

    def _reorder_by_cached_prefix(self) -> None:
        """vLLM 0.34's cache-aware admission (Scheduler._reorder_waiting_by_cached_prefix):
        once the pool is at least the threshold used, the requests among the first
        `cache_aware` waiting that have never run (not preempted ones) trade places so the
        deepest cached prefix goes first, arrival order breaking ties; the others keep their
        places."""
        if len(self.waiting) < 2:
            return
        if 1 - len(self.pool.free) / self.pool.n_blocks < self.cache_aware_threshold:
            return
        head = list(itertools.islice(self.waiting, self.cache_aware))
        slots = [i for i, q in enumerate(head)
                 if not q.swapped and self.records[q.request.id].preempted == 0]
        if len(slots) < 2:
            return
        cached = {i: len(self._hits(head[i])) * self.block_size for i in slots}
        order = sorted(slots, key=lambda i: (-cached[i], i))
        if order == slots:
            return
        reordered = list(head)
        for slot, source in zip(slots, order):
            reordered[slot] = head[source]
        for _ in head:
            self.waiting.popleft()
        self.waiting.extendleft(reversed(reordered))

    def _enqueue(self, seq: Running, front: bool = False) -> None:
        """Into the waiting queue: at the back (an arrival) or the front (preempted, first
        to resume); under priority scheduling in priority order (vLLM's heap)."""
        if self.scheduling == "priority":
            keys = [q.request.rank for q in self.waiting]
            self.waiting.insert(bisect.bisect(keys, seq.request.rank), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _victim(self) -> Running:
        """Whom to preempt: the newest admitted; under priority scheduling the lowest
        priority, the latest arrival of those (the first such in admission order)."""
        if self.scheduling == "priority":
            return max(self.running, key=lambda q: (q.request.priority, q.request.arrival))
        return self.running[-1]

    def _unschedule(self, seq: Running) -> None:
        """seq's work this step undone, its tokens back in the budget (a priority victim
        already scheduled; vLLM restores the budget the same way)."""
        for i, (q, start, end) in enumerate(self._plan):
            if q is seq:
                del self._plan[i]
                n = 1 if start is None else end - start
                self._budget += n
                if start is not None:
                    self._prompt += n
                    self._step_sizes.remove(n)
                    seq.prefilled = start
                return

    def _long_prefill(self) -> float:
        """vLLM's long_prefill_token_threshold: the most prompt positions one request's chunk
        may take in a step, unless it is the only request running or waiting."""
        if not self.long_prefill or len(self.running) + len(self.waiting) <= 1:
            return math.inf
        return self.long_prefill

    def _may_admit(self) -> bool:
        """Static batching admits the next batch only once the running one has finished."""
        return not (self.static and self.running)

    def _watermark(self) -> int:
        """Blocks an admission must leave free: v1 keeps its watermark only while something
        runs (an idle engine admits into the whole pool); v0 at every admission."""
        if self.policy == "vllm" and not self.running:
            return 0
        return self.watermark_blocks

    def _chunk(self, seq: Running, n: int) -> None:
        """The next n positions of seq's prefill, scheduled this step."""
        self._plan.append((seq, seq.prefilled, seq.prefilled + n))
        self._step_sizes.append(n)
        self._budget, self._prompt = self._budget - n, self._prompt - n
        seq.prefilled += n
        self._register(seq, seq.prefilled)

    def _run_step(self) -> None:
        """What the step scheduled, run: the decodes in one batch, each prefill chunk; the
        tokens made; then the finished requests freed, in the order scheduled."""
        plan = self._plan  # (a victim's work was taken out when it was preempted)
        decoding = [seq for seq, start, _ in plan if start is None]
        self._step_context = sum(end for _, start, end in plan if start is None)
        if self.engine is not None:
            if decoding:
                self.engine.decode(decoding)
            for seq, start, end in plan:
                if start is not None:
                    self.engine.prefill(seq, start, end)
        tokens, done = 0, []
        for seq, start, end in plan:
            if start is not None and end < seq.length:
                continue  # a chunk short of the prompt's end makes no token
            record = self.records[seq.request.id]
            if start is not None:
                seq.prefilled = None
                if record.first_token is None:
                    record.first_token = self.now
            record.tokens.append(self.now)  # (a recomputed prefill makes the next token too)
            seq.generated += 1
            tokens += 1
            if seq.generated >= seq.request.output_len:
                done.append(seq)
        for seq in done:
            self._finish(seq)
        self._end_step(tokens, len(decoding))

    def _end_step(self, tokens: int, batch: int) -> None:
        held = len(self.pool.owner)
        context = self._step_context if batch else 0
        self.batch_sum += batch
        self.batch_max = max(self.batch_max, batch)
        self.blocks_sum += held
        self.blocks_max = max(self.blocks_max, held)
        step = None
        if self.decisions is not None:
            step = Step(tuple((seq.request.id, 1 if start is None else end - start)
                              for seq, start, end in self._plan),
                        tuple(self._preempted), tuple(self._finished), held)
        if self.lean:
            if self.on_step is not None:
                self.on_step(self.now, step, tokens, batch, context, sum(self._step_sizes))
        else:
            self.blocks_in_use.append(held)
            self.decoded.append(tokens)
            self.batch.append(batch)
            self.context.append(context)
            self.prefill_sizes.append(self._step_sizes)
            if step is not None and self.decisions is not None:
                self.decisions.append(step)
        self._preempted, self._finished = [], []
        self._step_context = 0
        self._step_sizes = []
        self.now += 1

    def _admit(self) -> None:
        """Waiting sequences admitted in queue order while blocks last, each prefill's first
        chunk scheduled within what is left of the step's budgets."""
        while self.waiting:
            budget = min(self._budget, self._prompt)
            if self.max_seqs is not None and len(self.running) >= self.max_seqs:
                break  # vLLM's max_num_seqs
            seq = self.waiting[0]
            if not seq.swapped and budget <= 0:
                break  # no prompt positions left to prefill this step
            # prefix caching: the leading full blocks of its content already in the pool
            hits = self._hits(seq) if self.prefix_caching and not seq.swapped else []
            start = len(hits) * self.block_size
            n = int(min(seq.length - start, budget, self._long_prefill()))
            if self.reserve != "paged":
                need = self.blocks_for(self._reserved(seq.request))
            elif seq.swapped and (seq.prefilled is None or self.per_chunk):
                need = self.blocks_for(seq.cached)  # its cache, back from the host
            elif self.per_chunk:  # what this step's chunk of its prefill writes
                need = self.blocks_for(start + n) - len(hits)
            else:  # what its whole prefill writes
                need = self.blocks_for(seq.length) - len(hits)
            idle = sum(1 for b in hits if b not in self.pool.owner)  # hits no one holds
            free = len(self.pool.free) - self._watermark()
            if (self.per_chunk and self.reserve_full_prompt and not seq.swapped
                    and self.blocks_for(seq.length) - len(hits) + idle > free):
                break  # vLLM's scheduler_reserve_full_isl: the whole prompt must fit
            if need + idle > free:
                break
            if self.contiguous:  # one run of consecutive blocks, or it waits
                run = self.pool.take_run(seq.request.id, need)
                if run is None:
                    break
                self.waiting.popleft()
                seq.blocks = run
            else:
                self.waiting.popleft()
                for block in hits:
                    self.pool.share(block, seq.request.id)
                seq.blocks = hits + [self.pool.take(seq.request.id) for _ in range(need)]
            self.running.append(seq)
            seq.active = True
            if seq.swapped:  # back from the host; it goes on from the next step
                self.swapped_blocks += self.blocks_for(seq.cached)
                if self.engine is not None:
                    self.engine.swap_in(seq)
                seq.swapped = False
                continue
            seq.prefilled = seq.hit = start
            seq.registered = len(hits)
            if self.prefix_caching:
                self.hit_positions += start
                self.query_positions += seq.length
            self._chunk(seq, n)

    def _hits(self, seq: Running) -> list[int]:
        """The blocks holding seq's leading full blocks of content, as far as the prefix
        cache has them in a row (its last position is always computed: it makes a token)."""
        r, found = seq.request, []
        for j in range((seq.length - 1) // self.block_size):
            block = self.pool.cached(r.block_key(j, self.block_size))
            if block is None:
                break
            found.append(block)
        return found

    def _register(self, seq: Running, positions: int) -> None:
        """seq's blocks filled up to `positions`, keyed in the prefix cache as they are
        scheduled (vLLM caches a block's hash when it allocates the tokens that fill it, so a
        request admitted later in the same step finds it)."""
        if not self.prefix_caching:
            return
        full = positions // self.block_size
        for j in range(seq.registered, full):
            self.pool.register(seq.blocks[j], seq.request.block_key(j, self.block_size))
        seq.registered = max(seq.registered, full)

    def _grow(self, seq: Running, positions: int) -> bool:
        """Blocks for `positions`; preempting the newest sequences while none is free.
        False if `seq` itself was preempted."""
        while len(seq.blocks) < self.blocks_for(positions):
            block = self.pool.take(seq.request.id)
            if block is not None:
                seq.blocks.append(block)
                continue
            victim = self._victim()
            self._unschedule(victim)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Running) -> None:
        self.running.remove(seq)
        seq.active = False
        if self.preempt == "swap":
            self.swapped_blocks += self.blocks_for(seq.cached)  # to the host
            if self.engine is not None:
                self.engine.swap_out(seq)
            seq.swapped = True
        else:  # what it had computed is thrown away and prefilled again when readmitted
            self.recomputed_tokens += seq.cached
            seq.prefilled = None
        self._free(seq)
        seq.registered, seq.hit = 0, 0
        self.records[seq.request.id].preempted += 1
        self.preemptions += 1
        self._preempted.append(seq.request.id)
        self._enqueue(seq, front=True)

    def _free(self, seq: Running) -> None:
        """seq's blocks back to the pool, its last block first (vLLM's order: with prefix
        caching a prefix's leading blocks are the last evicted)."""
        self.pool.release_all(seq.blocks[::-1], seq.request.id)
        seq.blocks = []

    def _finish(self, seq: Running) -> None:
        self.running.remove(seq)
        seq.active = False
        self._free(seq)
        self.records[seq.request.id].finished = self.now
        self.finished += 1
        self._finished.append(seq.request.id)
        if self.engine is not None:
            self.engine.finish(seq)
        if self.lean:  # summarised, then dropped
            if self.on_finish is not None:
                self.on_finish(self.records[seq.request.id])
            del self.records[seq.request.id]
