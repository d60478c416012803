"""Orca's engine: one thread that runs iteration after iteration over the request pool.

Mechanism only: before each iteration it asks the scheduler (policy,
``scheduler.py``) for a batch, runs that batch's new tokens through the
model in one selective-batching pass (``gpt2.py``), appends each request's
next token (greedy, or sampled by the request's own settings,
``sampling.py``), reports it (``on_token``, for streaming) and completes
the requests that are done, at once, while the others continue.  New
requests are added to the pool under the lock at any time and are seen by
the next selection; the model runs outside the lock, so arrivals never wait
for an iteration to finish.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from handlers.orca.attention import IterationModel, Step
from handlers.orca.decode_programs import DecodePrograms
from handlers.orca.kv_cache import KVCache, blocks_for
from handlers.orca.sampling import GREEDY, Sampling, TokenChooser, choose_tokens
from handlers.orca.scheduler import GenerationRequest, IterationScheduler

logger = logging.getLogger(__name__)

BATCH_SIZE_HISTORY = 4096
DEFAULT_BLOCK_SIZE = 16  # positions per KV block
TokenCallback = Callable[[int, int, bool], None]  # (token, index in the answer, last?)


class GenerationError(ValueError):
    """A request the engine cannot take (the handler answers it with a 400)."""


@dataclass
class _Entry:
    request: GenerationRequest
    future: Future
    on_token: TokenCallback | None


MAX_STOP_IDS = 16


def check_stop_ids(stop_ids: Sequence[int], vocab: int) -> None:
    """Raise ``GenerationError`` unless ``stop_ids`` are at most ``MAX_STOP_IDS`` token ids of the vocabulary."""
    if isinstance(stop_ids, str | bytes) or not isinstance(stop_ids, Sequence):
        raise GenerationError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
    if len(stop_ids) > MAX_STOP_IDS:
        raise GenerationError(f"stop_token_ids holds {len(stop_ids)} ids; at most {MAX_STOP_IDS}")
    bad = [t for t in stop_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"stop token id {bad[0]!r} is outside the vocabulary [0, {vocab})")


def check_request(prompt: Sequence[int], max_new_tokens: int, vocab: int, most_new: int, max_tokens: int) -> None:
    """Raise ``GenerationError`` naming why a request cannot be served (any engine's admission rule)."""
    if not prompt:
        raise GenerationError("input_ids is empty")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise GenerationError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if not 1 <= max_new_tokens <= most_new:
        raise GenerationError(f"max_new_tokens must be in 1..{most_new}, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > max_tokens:
        raise GenerationError(
            f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the "
            f"{max_tokens} tokens a request may hold"
        )


class OrcaEngine:
    """Generation for many requests at once, iteration by iteration."""

    def __init__(
        self, model: IterationModel, slots: int, max_tokens: int, max_batch: int, max_new_tokens: int,
        device: str | torch.device = "cpu", iteration_level: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
        kv_blocks: int | None = None, prefill_chunk: int = 0, cuda_graphs: bool = False,
    ) -> None:  # fmt: skip
        """KV memory holds ``slots`` requests of ``max_tokens`` tokens, in blocks of ``block_size`` positions
        (``kv_blocks`` blocks instead when given: tests and benchmarks make memory scarce with it).

        ``prefill_chunk`` > 0: a prompt is computed at most that many tokens per iteration (chunked prefill),
        so a long prompt shares its iterations with the running requests' decode steps instead of stalling
        them for one long iteration; its first token comes after its last chunk.  0: whole prompts.

        ``cuda_graphs`` (CUDA only): decode iterations replay a CUDA graph per (batch, context) bucket
        (``decode_programs.py``); one KV block more is allocated, the padding rows' scratch."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be ≥ 0 (0: whole prompts), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if max_tokens > model.positions:
            raise ValueError(f"the model has {model.positions} positions; max_tokens {max_tokens} cannot be used")
        per_request = blocks_for(max_tokens, block_size)
        blocks = slots * per_request if kv_blocks is None else kv_blocks
        if blocks < per_request:
            raise ValueError(f"{blocks} KV blocks of {block_size} positions cannot hold one request of "
                             f"{max_tokens} tokens ({per_request} blocks)")  # fmt: skip
        self.model = model
        self.device = device
        self.max_tokens = max_tokens
        self.max_new_tokens = max_new_tokens
        graphs = cuda_graphs and torch.device(device).type == "cuda"
        self.kv = KVCache(model.kv_shape(blocks + (1 if graphs else 0), block_size), dtype=model.dtype, device=device)
        self.decode: DecodePrograms | None = None
        if graphs:
            scratch = self.kv.blocks.allocate(1)[0]  # held for the engine's life: no request ever gets it
            try:
                self.decode = DecodePrograms(model, self.kv, max_batch, max_tokens, scratch, graphs=True)
                logger.info("Orca: decode iterations captured as CUDA graphs: %s", self.decode.describe())
            except Exception:  # graphs are an optimisation: the eager iterations serve the same tokens
                logger.warning("Orca: could not capture decode iterations as CUDA graphs; running them eagerly",
                               exc_info=True)  # fmt: skip
        self.scheduler = IterationScheduler(max_batch, self.kv.blocks, iteration_level=iteration_level)
        self.peak_blocks = 0  # the most blocks in use at once (a counter, for tests and benchmarks)
        self._held: list[GenerationRequest] = []  # request-level batching: done, answered with their batch
        self._entries: dict[int, _Entry] = {}  # id(request) → its future and callback
        self._cond = threading.Condition()
        self._closed = False
        self._cancels = 0  # cancel() calls not yet acted on
        self.iterations = 0
        self.tokens = 0  # tokens generated
        # The latest iterations' batch sizes, for tests and benchmarks; bounded,
        # since a serving worker runs iterations for as long as it lives.
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_SIZE_HISTORY)
        self._thread = threading.Thread(target=self._loop, name="orca-engine", daemon=True)
        self._thread.start()

    # -- admission --------------------------------------------------------------------

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Raise ``GenerationError`` with the reason when a request cannot be served."""
        check_request(prompt, max_new_tokens, self.model.vocab, self.max_new_tokens, self.max_tokens)

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int, on_token: TokenCallback | None = None,
        sampling: Sampling = GREEDY, stop_token_ids: Sequence[int] = (),
    ) -> Future:  # fmt: skip
        """Queue a request; its future gets the generated ids (a list) when it is done: ``max_new_tokens`` of
        them, or fewer ending with the first of ``stop_token_ids`` it made."""
        self.check(prompt, max_new_tokens)
        check_stop_ids(stop_token_ids, self.model.vocab)
        chooser = TokenChooser.for_request(sampling, self.device)
        request = GenerationRequest(tuple(prompt), max_new_tokens, chooser=chooser, stop_ids=frozenset(stop_token_ids))
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._entries[id(request)] = _Entry(request, future, on_token)
            self.scheduler.add(request)
            self._cond.notify()
        return future

    def cancel(self, future: Future) -> bool:
        """End ``future``'s request before its next iteration: its future gets the tokens made so far.

        The caller has what it needs (the handler saw a stop string in the text); the request's KV blocks
        are freed at once rather than after ``max_new_tokens``.  False when the request is already answered."""
        with self._cond:
            for entry in self._entries.values():
                if entry.future is future:
                    entry.request.cancelled = True
                    self._cancels += 1
                    self._cond.notify()
                    return True
        return False

    def _end_cancelled(self) -> None:
        """Answer the requests whose clients cancelled them (under the lock, before a selection)."""
        if not self._cancels:
            return
        self._cancels = 0
        for request in [r for r in self.scheduler.pool if r.cancelled]:
            self._complete(request)

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.scheduler.pool and not self._closed:
                    self._cond.wait()
                self._end_cancelled()
                if not self.scheduler.pool:
                    if self._closed:
                        return  # closed and drained
                    continue
                batch = self.scheduler.select()
                self.peak_blocks = max(self.peak_blocks, self.kv.blocks.in_use)
            steps = [Step(self._chunk(r.next_tokens()), r.cached, r.blocks) for r in batch]
            # A request whose prompt is still being computed in chunks makes no token this iteration.
            done = [r.cached + len(s.tokens) >= r.length for r, s in zip(batch, steps, strict=True)]
            try:
                logits = self.decode.iterate(steps) if self.decode is not None else None
                if logits is None:  # not a decode iteration, or larger than every captured bucket
                    logits = self.model.iterate(steps, self.kv)
            except Exception as exc:  # noqa: BLE001 - fails this iteration's requests, not the engine
                logger.exception("Orca iteration failed for %d requests", len(batch))
                with self._cond:
                    for request in batch:
                        self._complete(request, error=exc)
                continue
            if all(done):
                next_ids: list[int | None] = list(choose_tokens(logits, [r.chooser for r in batch]))
            else:
                rows = [i for i, d in enumerate(done) if d]
                chosen = choose_tokens(logits[rows], [batch[i].chooser for i in rows]) if rows else []
                next_ids = [None] * len(batch)
                for i, token in zip(rows, chosen, strict=True):
                    next_ids[i] = token
            with self._cond:
                self.iterations += 1
                self.batch_sizes.append(len(batch))
                for request, step, token in zip(batch, steps, next_ids, strict=True):
                    request.cached += len(step.tokens)
                    if len(step.tokens) > 1:  # prompt tokens computed: its full blocks may be shared
                        self.scheduler.computed(request)
                    if token is None:
                        continue  # a chunk of its prompt: the next iteration computes more of it
                    request.generated.append(token)
                    self.tokens += 1
                    entry = self._entries.get(id(request))  # None only after close() gave up on it
                    if entry is not None and entry.on_token is not None:
                        self._report(entry.on_token, token, len(request.generated) - 1, request.finished)
                    if request.finished:
                        self._complete(request)
                if self._held and not any(r.started for r in self.scheduler.pool):
                    for request in self._held:  # the request-level batch is over: everyone answered
                        self._answer(request)
                    self._held.clear()

    def _chunk(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        return tokens[: self.prefill_chunk] if self.prefill_chunk and len(tokens) > self.prefill_chunk else tokens

    @staticmethod
    def _report(on_token: TokenCallback, token: int, index: int, last: bool) -> None:
        try:
            on_token(token, index, last)
        except Exception:  # noqa: BLE001 - a streaming client's failure is not the engine's
            logger.exception("Orca token callback failed")

    def _complete(self, request: GenerationRequest, error: BaseException | None = None) -> None:
        self.scheduler.finish(request)
        if error is None and not self.scheduler.iteration_level:
            self._held.append(request)
            return
        self._answer(request, error)

    def _answer(self, request: GenerationRequest, error: BaseException | None = None) -> None:
        entry = self._entries.pop(id(request), None)
        if entry is None or entry.future.done():
            return
        if error is None:
            entry.future.set_result(list(request.generated))
        else:
            entry.future.set_exception(error)

    # -- shutdown ---------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, finish the ones in the pool (up to ``timeout_s``), stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            for entry in list(self._entries.values()):
                if not entry.future.done():
                    entry.future.set_exception(RuntimeError("the engine closed before this request finished"))
            self._entries.clear()
