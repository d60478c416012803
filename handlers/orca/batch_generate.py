"""Request-level batching as a TorchServe user writes it: a batch window over transformers' ``generate``.

Orca's paper measures against a serving system's batch window in front of
an engine that generates whole requests (FasterTransformer).  The engine's
own ``request`` policy (``scheduler.py``) is that schedule on Orca's
engine, with two favours no batched ``generate`` gets: prompts are not
padded, and a request that has made its tokens stops computing.  This is
the other baseline, the one a user builds without Orca: whatever requests
wait when the model is free (up to ``max_batch``, first come first served)
become one batch, their prompts left-padded to the longest with an
attention mask, and ``GPT2LMHeadModel.generate`` runs greedy decoding with
its KV cache for the batch's largest ``max_new_tokens``.  Every row is
computed until then; each request gets its own first ``max_new_tokens``
tokens when the batch is done.  As in the Orca engine, end-of-text does
not stop a request, so both make exactly ``max_new_tokens`` tokens and
their answers can be compared token for token.

It has the Orca engine's interface (``check``, ``submit``, ``close``,
``batch_sizes``) so that a benchmark drives both alike.  Streaming does not
apply: every token of a batch is ready only at its end.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from handlers.orca.engine import BATCH_SIZE_HISTORY, check_request

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    prompt: tuple[int, ...]
    max_new_tokens: int
    future: Future


def padded_batch(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest, and the attention mask that hides the padding.

    Left, not right: ``generate`` appends every row's next token at the end,
    so each row's real tokens must end there.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


class BatchGenerateEngine:
    """Greedy generation, a padded batch at a time, through ``hf.generate`` (see the module doc)."""

    def __init__(self, hf: nn.Module, max_batch: int, max_new_tokens: int, max_tokens: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.hf = hf
        self.vocab = int(hf.config.vocab_size)
        positions = getattr(hf.config, "n_positions", None) or hf.config.max_position_embeddings  # GPT-2's or Llama's
        if max_tokens > positions:
            raise ValueError(f"the model has {positions} positions; requests of {max_tokens} cannot fit")
        self.max_batch = max_batch
        self.max_new_tokens = max_new_tokens
        self.max_tokens = max_tokens
        eos = hf.config.eos_token_id
        # No padding token (GPT-2's case): end-of-text pads, masked out.
        self._pad_id = int(hf.config.pad_token_id if hf.config.pad_token_id is not None else
                           eos[0] if isinstance(eos, list) else eos)  # fmt: skip
        self._queue: deque[_Waiting] = deque()
        self._running: list[_Waiting] = []  # the batch generate() is on
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_SIZE_HISTORY)
        self._thread = threading.Thread(target=self._loop, name="batch-generate", daemon=True)
        self._thread.start()

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Raise ``GenerationError`` with the reason when a request cannot be served."""
        check_request(prompt, max_new_tokens, self.vocab, self.max_new_tokens, self.max_tokens)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, on_token: object = None) -> Future:
        """Queue a request; its future gets the generated ids (a list) when its batch is done."""
        if on_token is not None:
            raise ValueError("a batched generate call cannot stream: its tokens are ready only at the end")
        self.check(prompt, max_new_tokens)
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._queue.append(_Waiting(tuple(prompt), max_new_tokens, future))
            self._cond.notify()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                self._running = batch
            try:
                answers: list[list[int] | BaseException] = list(self._generate(batch))
            except Exception as exc:  # noqa: BLE001 - fails this batch's requests, not the engine
                logger.exception("batched generate failed for %d requests", len(batch))
                answers = [exc] * len(batch)
            with self._cond:
                self._running = []
                self.batches += 1
                self.batch_sizes.append(len(batch))
                for waiting, answer in zip(batch, answers, strict=True):
                    if waiting.future.done():  # close() gave up on it
                        continue
                    if isinstance(answer, BaseException):
                        waiting.future.set_exception(answer)
                    else:
                        waiting.future.set_result(answer)

    def _generate(self, batch: list[_Waiting]) -> list[list[int]]:
        ids, mask = padded_batch([w.prompt for w in batch], self._pad_id)
        device = self.hf.lm_head.weight.device
        ids, mask = ids.to(device), mask.to(device)
        from transformers import GenerationConfig

        # The cache is asked for explicitly: the catalog builds GPT-2 without one
        # (its plain handler runs one forward pass per request).
        config = GenerationConfig(
            max_new_tokens=max(w.max_new_tokens for w in batch),  # every row runs this long
            do_sample=False, use_cache=True, pad_token_id=self._pad_id, eos_token_id=None,
        )  # fmt: skip
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=mask, generation_config=config)
        start = ids.shape[1]
        return [out[row, start : start + w.max_new_tokens].tolist() for row, w in enumerate(batch)]

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, finish the queued ones (up to ``timeout_s``), stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            for waiting in [*self._running, *self._queue]:
                if not waiting.future.done():
                    waiting.future.set_exception(RuntimeError("the engine closed before this request finished"))
            self._queue.clear()
