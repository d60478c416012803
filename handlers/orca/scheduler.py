"""Orca's iteration-level scheduler (the paper's Algorithm 2) with KV memory in blocks, as pure policy.

The scheduler is asked for a batch before every iteration, not before every
request: a request that finishes leaves at the end of the iteration that
produced its last token, and one that arrives joins at the next iteration.
Selection is first come, first served over the whole pool, running requests
and waiting ones alike, up to ``max_batch``.

KV memory is in blocks (``kv_blocks.py``), handed out as a request grows
rather than reserved for its whole life, so memory holds the tokens that
exist, not the ones a request might make.  A waiting request starts when
the blocks for its prompt are free (less the blocks of a registered prefix
it shares), leaving one block of headroom per request already chosen for
the iteration; if they are not free the selection stops there, so no later
request overtakes it (strict FCFS, no starvation).  When a running request
needs a block and none is free, the newest running request behind it is
*preempted*: its blocks go back, and it waits, at its place in arrival
order, to compute its prompt and the tokens it made again (recompute, as
vLLM does; nothing is lost or re-sent).  If the request itself is the newest,
it is the one that waits.  So running out of KV memory makes requests wait
or recompute, never fail, and the oldest request always progresses.
With one engine worker on CPU there is no pipelining, so the paper's
``n_workers`` exclusion of requests still in flight does not arise.

``iteration_level=False`` is the paper's baseline, request-level batching
(FasterTransformer behind a serving system's batch window): a batch starts
only when the previous one has finished entirely, and nobody joins it
midway.  The engine also holds that batch's answers until its longest
request is done.  It is kept here, in the same engine, so that a benchmark
compares scheduling alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handlers.orca.kv_blocks import BlockAllocator, blocks_for
from handlers.orca.sampling import TokenChooser


@dataclass(eq=False)
class GenerationRequest:
    """One request's state in the pool."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = -1  # set by the scheduler: its place in FCFS order
    blocks: list[int] = field(default_factory=list)  # its block table while it runs
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # positions whose keys and values are in its blocks
    chooser: TokenChooser = field(default_factory=TokenChooser)  # greedy unless the request samples
    stop_ids: frozenset[int] = frozenset()  # a token that ends the request (kept as its last)
    cancelled: bool = False  # its client has what it needs (a stop string seen): end it at the next iteration
    preemptions: int = 0  # times its blocks were taken back (it recomputed them)

    @property
    def started(self) -> bool:
        return bool(self.blocks)

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens or self.stopped or self.cancelled

    @property
    def stopped(self) -> bool:
        """It made one of its stop tokens (rather than running out of ``max_new_tokens``)."""
        return bool(self.generated) and self.generated[-1] in self.stop_ids

    @property
    def length(self) -> int:
        """Its tokens so far: prompt and generated."""
        return len(self.prompt) + len(self.generated)

    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.generated)

    def next_tokens(self) -> tuple[int, ...]:
        """What the next iteration feeds it: every token not yet cached (its prompt at initiation, the prompt
        and the tokens it made after a preemption, what follows a shared prefix), else its last token."""
        if self.cached >= len(self.prompt):
            return tuple(self.generated[self.cached - len(self.prompt) :])
        return self.prompt[self.cached :] + tuple(self.generated)


class IterationScheduler:
    """The request pool and Algorithm 2's selection over KV blocks (``kv_blocks.BlockAllocator``)."""

    def __init__(self, max_batch: int, blocks: BlockAllocator, iteration_level: bool = True) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.max_batch = max_batch
        self.blocks = blocks
        self.iteration_level = iteration_level
        self.pool: list[GenerationRequest] = []  # in arrival order
        self._arrivals = 0
        self.preemptions = 0  # a counter, for tests and benchmarks

    def add(self, request: GenerationRequest) -> None:
        # Its last token is never fed back: it holds at most prompt + max_new_tokens - 1 positions.
        most = blocks_for(len(request.prompt) + request.max_new_tokens - 1, self.blocks.block_size)
        if most > self.blocks.blocks:
            raise ValueError(f"a request of up to {most} blocks cannot fit in {self.blocks.blocks} KV blocks")
        request.arrival = self._arrivals
        self._arrivals += 1
        self.pool.append(request)

    def select(self) -> list[GenerationRequest]:
        """The next iteration's batch: the pool's first requests in arrival order (see the module doc), each
        with the blocks its new tokens need."""
        candidates = self.pool
        if not self.iteration_level:
            running = [r for r in self.pool if r.started]
            if running:  # request-level: the batch in progress runs to its end, alone
                candidates = running
        batch: list[GenerationRequest] = []
        for request in candidates:
            if len(batch) == self.max_batch:
                break
            ready = self._grow(request) if request.started else self._start(request, headroom=len(batch))
            if not ready:
                break  # strict FCFS: nobody behind it goes first
            batch.append(request)
        return batch

    def _start(self, request: GenerationRequest, headroom: int) -> bool:
        tokens = request.tokens()
        shared = self.blocks.share_prefix(tokens)
        need = blocks_for(len(tokens), self.blocks.block_size) - len(shared)
        if need + headroom > self.blocks.free:
            self.blocks.release(shared)
            return False
        request.blocks = shared + self.blocks.allocate(need)
        request.cached = len(shared) * self.blocks.block_size
        return True

    def _grow(self, request: GenerationRequest) -> bool:
        """Blocks for a running request's next token, preempting the newest running requests if none is free;
        False when it is the newest and had to give its own blocks back."""
        need = blocks_for(request.length, self.blocks.block_size) - len(request.blocks)
        while need > self.blocks.free:
            victim = next(r for r in reversed(self.pool) if r.started)
            self.preempt(victim)
            if victim is request:
                return False
        request.blocks += self.blocks.allocate(need)
        return True

    def preempt(self, request: GenerationRequest) -> None:
        """Take a running request's blocks back; it waits, in its place, to compute them again."""
        self.blocks.release(request.blocks)
        request.blocks = []
        request.cached = 0
        request.preemptions += 1
        self.preemptions += 1

    def computed(self, request: GenerationRequest) -> None:
        """After an iteration that computed a request's prompt: offer its full blocks for sharing."""
        self.blocks.register(request.tokens(), request.blocks, request.cached)

    def finish(self, request: GenerationRequest) -> None:
        """Take a finished (or failed) request out of the pool and free its blocks."""
        self.pool.remove(request)
        if request.blocks:
            self.blocks.release(request.blocks)
            request.blocks = []
