"""Continuous batching's bookkeeping: a seeded request trace, a pool of KV blocks and a
scheduler that admits requests while blocks last, decodes every running sequence each step,
frees a sequence's blocks when it finishes, and preempts when the pool runs dry (vLLM's
policy: the most recently admitted sequence goes first, by recompute or by swap). No torch:
this is the accounting a serving engine does on the host, stepped in discrete decode steps.

Two ways to reserve, on the same trace and pool: `paged` takes a block whenever a sequence's
next token needs one; `prealloc` reserves, when it admits a request, the blocks of the
longest a request may get (`reserve_len`, a server's --max-len, as a cache preallocated to
the maximum length does; without it the request's own prompt + output, an oracle no server
has).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from kvbench.errors import KvbenchError
from kvbench.lengths import LenDist, draw

PREEMPT = ("recompute", "swap")
RESERVE = ("paged", "prealloc")


@dataclass(frozen=True)
class Request:
    id: int
    arrival: int  # the step it arrives at
    prompt_len: int
    output_len: int  # tokens it generates, the first with its prefill

    @property
    def reach(self) -> int:
        """Positions it holds once finished."""
        return self.prompt_len + self.output_len


def trace(n: int, seed: int, prompt: LenDist, output: LenDist, per_step: float,
          max_len: int) -> list[Request]:
    """n requests arriving as a Poisson process of `per_step` requests per decode step, their
    prompt and output lengths drawn from the distributions (seeded), prompt + output capped
    at max_len."""
    rng = random.Random(seed)
    prompts = draw(prompt, n, seed, max_len - 1)
    outputs = draw(output, n, seed + 1, max_len - 1)
    now, requests = 0.0, []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        now += rng.expovariate(per_step)
        requests.append(Request(i, int(now), p, max(1, min(o, max_len - p))))
    return requests


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
        self.owner[block] = request
        return block

    def release(self, block: int, request: int) -> None:
        if self.owner.get(block) != request:
            raise AssertionError(f"request {request} frees block {block} it does not hold")
        del self.owner[block]
        self.free.append(block)


@dataclass
class Running:
    request: Request
    blocks: list[int] = field(default_factory=list)
    generated: int = 0  # tokens generated so far (kept across a preemption)
    admitted: int = 0

    @property
    def length(self) -> int:
        """Positions cached: the prompt and every generated token but the newest."""
        return self.request.prompt_len + self.generated


@dataclass
class Record:
    """One request's life: when it arrived, got its first token and finished."""

    request: Request
    first_token: int | None = None
    finished: int | None = None
    preempted: int = 0


class Scheduler:
    """Admits, decodes, finishes and preempts on a BlockPool, one decode step at a time.

    A step: arrived requests are admitted first come first served while their blocks can be
    taken (paged: the prompt's blocks and the first token's; prealloc: every block the
    request may reach); an admitted request's prefill yields its first token. Then every
    other running sequence decodes one token, taking a block when its next position starts
    one; when none is free the most recently admitted sequence is preempted (recompute:
    its blocks freed, it waits at the head of the queue and recomputes its prompt and
    tokens when readmitted; swap: its blocks' contents go to host memory and come back on
    readmission). A finished sequence frees its blocks.
    """

    def __init__(self, requests: list[Request], n_blocks: int, block_size: int,
                 reserve: str = "paged", preempt: str = "recompute",
                 reserve_len: int | None = None):
        if reserve not in RESERVE:
            raise KvbenchError(f"unknown reserve {reserve!r}; use paged or prealloc")
        if preempt not in PREEMPT:
            raise KvbenchError(f"unknown --preempt {preempt!r}; use recompute or swap")
        self.block_size, self.reserve, self.preempt = block_size, reserve, preempt
        self.reserve_len = reserve_len
        for r in requests:
            if self.blocks_for(r.reach) > n_blocks:
                raise KvbenchError(
                    f"request {r.id} ({r.prompt_len} prompt + {r.output_len} output tokens) "
                    f"needs {self.blocks_for(r.reach)} blocks of {block_size} but the budget "
                    f"is {n_blocks}: that request can never run; raise --kv-blocks or "
                    "lower --max-len")
        self.pool = BlockPool(n_blocks)
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.records = {r.id: Record(r) for r in requests}
        self.now = 0
        self.swapped_blocks = 0  # block copies to and from the host (swap)
        self.recomputed_tokens = 0  # positions prefilled again (recompute)
        self.blocks_in_use: list[int] = []  # per step
        self.decoded: list[int] = []  # tokens generated per step

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def run(self, max_steps: int = 10**7) -> dict[int, Record]:
        while not self.done:
            if self.now >= max_steps:
                raise KvbenchError(f"the trace did not finish in {max_steps} steps")
            self.step()
        return self.records

    def step(self) -> None:
        while self.pending and self.pending[0].arrival <= self.now:
            self.waiting.append(Running(self.pending.popleft()))
        tokens = self._admit()
        for seq in list(self.running):
            if seq.admitted == self.now or seq not in self.running:
                continue  # its prefill gave this step's token, or it was preempted
            if not self._grow(seq, seq.length + 1):
                continue  # preempted itself
            seq.generated += 1
            tokens += 1
            self._finish_if_done(seq)
        self.blocks_in_use.append(len(self.pool.owner))
        self.decoded.append(tokens)
        self.now += 1

    def _admit(self) -> int:
        tokens = 0
        while self.waiting:
            seq = self.waiting[0]
            # a sequence back from preemption resumes with the tokens it had
            need = (self.blocks_for(self.reserve_len or seq.request.reach)
                    if self.reserve == "prealloc" else self.blocks_for(seq.length + 1))
            if need > len(self.pool.free):
                break
            self.waiting.popleft()
            seq.blocks = [self.pool.take(seq.request.id) for _ in range(need)]
            if self.preempt == "swap" and self.records[seq.request.id].preempted:
                self.swapped_blocks += self.blocks_for(seq.length)  # back from the host
            elif seq.generated:
                self.recomputed_tokens += seq.length  # its prompt and tokens prefilled again
            seq.admitted = self.now
            self.running.append(seq)
            record = self.records[seq.request.id]
            if record.first_token is None:
                record.first_token = self.now
            seq.generated += 1  # the prefill's token (or the resumed step's)
            tokens += 1
            self._finish_if_done(seq)
        return tokens

    def _grow(self, seq: Running, positions: int) -> bool:
        """Blocks for `positions`; preempting the newest sequences while none is free.
        False if `seq` itself was preempted."""
        while len(seq.blocks) < self.blocks_for(positions):
            block = self.pool.take(seq.request.id)
            if block is not None:
                seq.blocks.append(block)
                continue
            victim = self.running[-1]  # the most recently admitted
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Running) -> None:
        self.running.remove(seq)
        if self.preempt == "swap":
            self.swapped_blocks += len(seq.blocks)  # to the host
        for block in seq.blocks:
            self.pool.release(block, seq.request.id)
        seq.blocks = []
        self.records[seq.request.id].preempted += 1
        self.waiting.appendleft(seq)

    def _finish_if_done(self, seq: Running) -> None:
        if seq.generated < seq.request.output_len:
            return
        self.running.remove(seq)
        for block in seq.blocks:
            self.pool.release(block, seq.request.id)
        seq.blocks = []
        self.records[seq.request.id].finished = self.now
